"""LanceDB as a sync target (embedded, on a folder or an object store URL): item_id, vector and the metadata
columns as a table, rows merged on item_id, the model id and slug in the table's schema metadata. LanceDB has no
aliases: TABLE holds the serving model's rows and another model syncs into TABLE__<slug>; a switch copies TABLE
aside to its model's TABLE__<slug>, then replaces TABLE with the new model's rows in one commit (a new version of
TABLE: a reader opening it meets the old model or the new, never a mix nor no table, as a rename would leave).

Rows go into an empty table in one append (one commit, streamed); into a table that has rows, merged on item_id
(indexed by a BTree) in commits of MERGE_ROWS; small fragments are compacted once they are many."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator

import pyarrow as pa

from imgest.tasks.sync.targets import MODEL_KEY, SLUG_KEY, Model, SyncError, TargetSpec, check_model, physical_name

# Rows a merge commits at a time into a table that has rows. Measured (LanceDB 0.40, 48-d): each merge adds a
# fragment that every later merge scans, so 1,000-row merges slowed from 0.014 s to 0.17 s over 1M rows and a
# first sync of 10M ran at 1,077 rows/s; a 100,000-row merge into 2M indexed rows takes 0.3 s.
MERGE_ROWS = 100_000
SMALL_FRAGMENTS = 32  # compact (optimize) once a table has this many small fragments


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


def _chunks(batches: Iterator[pa.Table], rows: int) -> Iterator[Iterator[pa.Table]]:
    """`batches` in runs of about `rows` rows (whole batches), each consumed before the next is asked for."""
    for first in batches:
        def run(batch: pa.Table = first) -> Iterator[pa.Table]:
            taken = 0
            while batch is not None:
                yield batch
                taken += batch.num_rows
                batch = next(batches, None) if taken < rows else None
        yield run()


def _quoted(item_id: str) -> str:
    """`item_id` as a string literal of Lance's SQL: single quotes, a quote doubled; a backslash is itself there
    (no escapes), and every other character too."""
    return "'" + item_id.replace("'", "''") + "'"


class LanceTarget:
    def __init__(self, spec: TargetSpec):
        import lancedb

        self.spec, self.name, self.collection = spec, spec.name, spec.name
        self.db = lancedb.connect(spec.where, storage_options=object_store_options(spec.where))
        self.table = None
        self.schema: pa.Schema | None = None

    def _names(self) -> set[str]:
        names, token = set(), None
        while True:  # paged
            listed = self.db.list_tables(page_token=token)
            names.update(getattr(listed, "tables", listed))
            token = getattr(listed, "page_token", None)
            if not token:
                return names

    def _made_by(self, name: str) -> tuple[str | None, str | None]:
        """(model id, model slug) a table records in its schema metadata."""
        meta = self.db.open_table(name).schema.metadata or {}
        return tuple(meta[k.encode()].decode() if k.encode() in meta else None for k in (MODEL_KEY, SLUG_KEY))

    def open(self, model: Model, columns: pa.Schema, takes_name: bool = False) -> bool:
        names = self._names()
        # TABLE when it holds this model, or is missing and the model takes the name (no copy to make then); the
        # model's own table beside it otherwise
        if self.name in names:
            mine = self._made_by(self.name)[0] == model.model_id
        else:
            mine = takes_name
        self.collection = self.name if mine else physical_name(self.spec, model)
        if self.collection in names:
            self.table = self.db.open_table(self.collection)
            self.schema = self.table.schema
            found = (self.schema.metadata or {}).get(MODEL_KEY.encode())
            check_model(self.spec, self.collection, found.decode() if found else None, model, self.count())
            missing = [f for f in (columns or []) if f.name not in self.schema.names]
            if missing:  # a metadata column new since the table was made: added, null until its rows are sent
                self.table.add_columns(pa.schema(missing))
                self.schema = self.table.schema
            return False
        fields = [pa.field("item_id", pa.string(), nullable=False),
                  pa.field("vector", pa.list_(pa.float32(), model.dim))]
        fields += [f for f in (columns or []) if f.name not in ("item_id", "vector")]
        self.schema = pa.schema(fields, metadata={MODEL_KEY: model.model_id, SLUG_KEY: model.slug,
                                                  "imgest.metric": "dot"})
        self.table = self.db.create_table(self.collection, schema=self.schema, exist_ok=True)
        return True

    def answers(self) -> str | None:
        return self._made_by(self.name)[0] if self.name in self._names() else None

    def _copy(self, source: str, to: str) -> None:
        """`to` := `source`'s rows and schema, streamed; on an existing table one overwrite commit."""
        table = self.db.open_table(source)
        rows = table.search().limit(None).to_batches(8192)
        self.db.create_table(to, data=rows, schema=table.schema, mode="overwrite")

    def point(self, model: Model) -> None:
        """The swap, in an order a crash at any step leaves safe: TABLE still answers for one model, and rerunning
        finishes it (a sync writes to wherever open() finds the model, and the next switch overwrites leftovers)."""
        names, own = self._names(), physical_name(self.spec, model)
        if self.name in names:
            held, slug = self._made_by(self.name)
            if held != model.model_id:
                if not slug:
                    raise SyncError(f"--to {self.spec.url}: the table {self.name} holds model {held} without its "
                                    "slug (made outside imgest, or by an earlier version): drop it, and the next sync "
                                    "rebuilds it")
                self._copy(self.name, physical_name(self.spec, Model(held, slug, 0)))  # kept current for a rollback
                self._copy(own, self.name)  # the commit readers see
        elif own in names:
            self._copy(own, self.name)
        if own in self._names():  # now a copy of TABLE (or a leftover of a swap killed after its commit)
            self.db.drop_table(own)
        self.table, self.collection = self.db.open_table(self.name), self.name
        self.schema = self.table.schema

    def open_named(self) -> str | None:
        if self.name not in self._names():
            return None
        self.table, self.collection = self.db.open_table(self.name), self.name
        self.schema = self.table.schema
        return self._made_by(self.name)[0]

    def drop(self, model: Model) -> bool:
        collection = physical_name(self.spec, model)
        if collection not in self._names():
            return False
        self.db.drop_table(collection)
        return True

    def _conformed(self, rows: pa.Table) -> pa.Table:
        """The table's columns, in its order (a column the metadata no longer has: null)."""
        return pa.table({f.name: rows[f.name].cast(f.type) if f.name in rows.column_names
                         else pa.nulls(rows.num_rows, f.type) for f in self.schema}, schema=self.schema)

    def _reader(self, batches: Iterator[pa.Table]) -> pa.RecordBatchReader:
        return pa.RecordBatchReader.from_batches(
            self.schema, (b for rows in batches for b in self._conformed(rows).to_batches()))

    def upsert(self, batches: Iterable[pa.Table]) -> None:
        batches = (rows for rows in batches if rows.num_rows)
        first = next(batches, None)
        if first is None:
            return
        batches = itertools.chain([first], batches)
        if self.count() == 0:
            # nothing to match (the rows' ids are unique): one append, one commit, whatever the size
            self.table.add(self._reader(batches))
        else:
            self._indexed()  # a table an earlier sync left without its index (killed, or an older imgest)
            for chunk in _chunks(batches, MERGE_ROWS):
                self.table.merge_insert("item_id").when_matched_update_all().when_not_matched_insert_all() \
                    .execute(self._reader(chunk))
        self._maintain()

    def _maintain(self) -> None:
        """item_id indexed (a merge or a delete looks ids up instead of scanning every row), and the small
        fragments of past nights compacted once they are many (LanceDB's `optimize`: also folds new rows into
        the index and removes versions older than its default 7 days)."""
        if self._indexed() and self.table.stats()["fragment_stats"]["num_small_fragments"] >= SMALL_FRAGMENTS:
            self.table.optimize()

    def _indexed(self) -> bool:
        """Whether item_id was indexed already; indexed now if not."""
        if any(list(index.columns) == ["item_id"] for index in self.table.list_indices()):
            return True
        from lancedb.index import BTree

        self.table.create_index("item_id", config=BTree())
        return False

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
