"""LanceDB as a sync target (embedded, on a folder or an object store URL): item_id, vector and the metadata
columns as a table, rows merged on item_id, the model id in the table's schema metadata."""

from __future__ import annotations

import os
from collections.abc import Iterable

import pyarrow as pa

from imgest.tasks.sync.targets import MODEL_KEY, Model, TargetSpec, check_model


def object_store_options(url: str) -> dict[str, str]:
    """Lance's options for an s3:// table: the keys of imgest's Prefect block when one is configured (Lance
    reads AWS_* from the environment itself otherwise), and plain HTTP allowed when the endpoint is http://
    (a loopback or in-cluster S3 server; Lance refuses it by default)."""
    if not url.lower().startswith("s3://"):
        return {}
    from imgest.storage.credentials import storage_options

    found = storage_options(url)
    options = {lance: str(found[ours]) for ours, lance in (("key", "aws_access_key_id"), ("secret",
               "aws_secret_access_key"), ("token", "aws_session_token"), ("endpoint_url", "aws_endpoint"))
               if found.get(ours)}
    if region := found.get("client_kwargs", {}).get("region_name"):
        options["aws_region"] = region
    endpoint = options.get("aws_endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or \
        os.environ.get("AWS_ENDPOINT_URL", "")
    if endpoint.lower().startswith("http://"):
        options["allow_http"] = "true"
    return options


def _quoted(item_id: str) -> str:
    return "'" + item_id.replace("'", "''") + "'"


class LanceTarget:
    def __init__(self, spec: TargetSpec):
        import lancedb

        self.spec, self.name = spec, spec.name
        self.db = lancedb.connect(spec.where, storage_options=object_store_options(spec.where))
        self.table = None
        self.schema: pa.Schema | None = None

    def _exists(self) -> bool:
        listed = self.db.list_tables()
        names = getattr(listed, "tables", listed)
        return self.name in names

    def open(self, model: Model, columns: pa.Schema) -> bool:
        if self._exists():
            self.table = self.db.open_table(self.name)
            self.schema = self.table.schema
            found = (self.schema.metadata or {}).get(MODEL_KEY.encode())
            check_model(self.spec, found.decode() if found else None, model, self.count())
            missing = [f for f in (columns or []) if f.name not in self.schema.names]
            if missing:  # a metadata column new since the table was made: added, null until its rows are sent
                self.table.add_columns(pa.schema(missing))
                self.schema = self.table.schema
            return False
        fields = [pa.field("item_id", pa.string(), nullable=False),
                  pa.field("vector", pa.list_(pa.float32(), model.dim))]
        fields += [f for f in (columns or []) if f.name not in ("item_id", "vector")]
        self.schema = pa.schema(fields, metadata={MODEL_KEY: model.model_id, "imgest.metric": "dot"})
        self.table = self.db.create_table(self.name, schema=self.schema, exist_ok=True)
        return True

    def upsert(self, rows: pa.Table) -> None:
        if not rows.num_rows:
            return
        # the table's columns, in its order (a column the metadata no longer has: null)
        data = pa.table({f.name: rows[f.name].cast(f.type) if f.name in rows.column_names
                         else pa.nulls(rows.num_rows, f.type) for f in self.schema}, schema=self.schema)
        self.table.merge_insert("item_id").when_matched_update_all().when_not_matched_insert_all().execute(data)

    def delete(self, item_ids: list[str]) -> None:
        if item_ids:
            self.table.delete(f"item_id IN ({', '.join(map(_quoted, item_ids))})")

    def search(self, vector: Iterable[float], k: int) -> list[tuple[str, float]]:
        hits = self.table.search(list(map(float, vector))).metric("dot").limit(k).to_list()
        return [(hit["item_id"], 1.0 - float(hit["_distance"])) for hit in hits]  # lance's dot distance: 1 - a.b

    def get(self, item_ids: list[str]) -> dict[str, dict]:
        if not item_ids:
            return {}
        rows = self.table.search().where(f"item_id IN ({', '.join(map(_quoted, item_ids))})") \
            .limit(len(item_ids) + 1).to_list()
        return {r["item_id"]: {k: v for k, v in r.items() if k != "vector"} for r in rows}

    def count(self) -> int:
        return int(self.table.count_rows())

    def close(self) -> None:
        pass
