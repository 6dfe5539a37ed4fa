"""Milvus as a sync target (a server, or a Milvus Lite file): a collection per model (COLLECTION__<slug>) with
item_id the VARCHAR primary key, the vector a FLOAT_VECTOR searched by inner product (FLAT: exact), metadata as
dynamic fields, the model id a property; COLLECTION a collection alias of the serving model's (alter_alias: one
call, so a search by COLLECTION meets one model or the other).

Ids reach Milvus in filter expressions (`item_id in [...]`), each a double-quoted string literal escaped by
Milvus's expression grammar (a backslash and a double quote escaped, nothing else: the grammar takes any other
character as itself). pymilvus's own `delete(ids=...)` and `get(ids=...)` quote ids without escaping them, so a
key holding a backslash fails the call and one holding `'] or ...` rewrites it; expression templates
(`filter_params`) would carry them as values, but Milvus Lite does not take templates."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import pyarrow as pa

from imgest.redact import one_line
from imgest.tasks.sync.targets import (
    MODEL_KEY,
    SLUG_KEY,
    Model,
    TargetError,
    TargetSpec,
    check_model,
    credential,
    physical_name,
    plain,
    plain_collection,
)

MAX_ID_CHARS = 4096


def literal(item_id: str) -> str:
    """`item_id` as a string literal of Milvus's expression grammar."""
    return '"' + item_id.replace("\\", "\\\\").replace('"', '\\"') + '"'


def ids_filter(item_ids: list[str]) -> str:
    return f"item_id in [{', '.join(map(literal, item_ids))}]"


class _LiteStart(logging.Handler):
    """What Milvus Lite logs when its server does not start (pymilvus then raises only "Open local milvus
    failed"): kept, so the one line can say why."""

    def __init__(self) -> None:
        super().__init__()
        self.cause: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.cause = record.exc_info[1]


class MilvusTarget:
    def __init__(self, spec: TargetSpec):
        from pymilvus import MilvusClient

        # pymilvus logs every failed call at ERROR, with a traceback, before raising it; imgest reports what it
        # raises in one line (masked), so the record would only add a traceback, unmasked, to the terminal. Set
        # after the import: pymilvus configures its loggers when imported, resetting their levels
        logging.getLogger("pymilvus.decorators").setLevel(logging.CRITICAL)
        self.spec = spec
        uri = spec.where if spec.local else f"http://{spec.where}"
        token = credential("MILVUS_TOKEN")  # user:password or an API key; never in the URL
        opened = {"uri": uri, **({"token": token} if token else {})}
        self.client = self._open_lite(opened) if spec.local else MilvusClient(**opened)
        self.name = spec.name
        self.collection = spec.name

    def _open_lite(self, opened: dict):
        """A client of a Milvus Lite file; a file another process holds is one line saying so."""
        from pymilvus import MilvusClient
        from pymilvus.exceptions import MilvusException

        path, lite, why = opened["uri"], logging.getLogger("milvus_lite.server_manager"), _LiteStart()
        propagate, lite.propagate = lite.propagate, False
        lite.addHandler(why)
        try:
            return MilvusClient(**opened)
        except MilvusException as exc:
            if type(why.cause).__name__ == "DataDirLockedError":
                raise TargetError(self.spec.url, (
                    f"the Milvus Lite file {path} is open in another process (a notebook, a script: a client holds "
                    "it until its process releases the server or exits, client.close() is not enough); Milvus Lite "
                    "serves a file to one process at a time: close it there, or sync to a Milvus server "
                    "(milvus://HOST:PORT/COLLECTION)")) from exc
            if why.cause is not None:
                raise TargetError(self.spec.url, f"Milvus Lite could not open {path}: {one_line(why.cause)}") from exc
            raise
        finally:
            lite.removeHandler(why)
            lite.propagate = propagate

    def _alias_of(self) -> str | None:
        """The collection the target's name is an alias of; None when it is none (SyncError: a collection)."""
        listed = self.client.list_aliases()
        if self.name in (listed.get("aliases", []) if isinstance(listed, dict) else listed):
            return self.client.describe_alias(self.name)["collection_name"]
        if self.client.has_collection(self.name):
            raise plain_collection(self.spec)
        return None

    def _model_of(self, collection: str) -> str | None:
        return self.client.describe_collection(collection).get("properties", {}).get(MODEL_KEY)

    def open(self, model: Model, columns: pa.Schema, takes_name: bool = False) -> bool:
        from pymilvus import DataType, MilvusClient

        self._alias_of()  # a collection under the target's own name is refused before anything is created
        self.collection = physical_name(self.spec, model)
        if self.client.has_collection(self.collection):
            found = self._model_of(self.collection)
            check_model(self.spec, self.collection, found, model, self.count())
            if found is None:
                self.client.alter_collection_properties(self.collection, properties={MODEL_KEY: model.model_id,
                                                                                     SLUG_KEY: model.slug})
            self.client.load_collection(self.collection)
            return False
        schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=True)
        schema.add_field("item_id", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_CHARS)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=model.dim)
        index = self.client.prepare_index_params()
        index.add_index("vector", index_type="FLAT", metric_type="IP")  # exact; vectors are L2-normalised
        grpc_log = logging.getLogger("grpc._server")
        level, quiet = grpc_log.level, self.spec.local and grpc_log.level < logging.CRITICAL
        if quiet:  # pymilvus 3.0 asks Milvus Lite's in-process server for AllocTimestamp, which it lacks; the
            grpc_log.setLevel(logging.CRITICAL)  # server logs a traceback, the client goes on and the create holds
        try:
            self.client.create_collection(self.collection, schema=schema, index_params=index,
                                          properties={MODEL_KEY: model.model_id, SLUG_KEY: model.slug},
                                          consistency_level="Strong")
        finally:
            if quiet:
                grpc_log.setLevel(level)
        return True

    def answers(self) -> str | None:
        target = self._alias_of()
        return self._model_of(target) if target else None

    def point(self, model: Model) -> None:
        collection, now = physical_name(self.spec, model), self._alias_of()
        if now is None:
            self.client.create_alias(collection, self.name)
        elif now != collection:
            self.client.alter_alias(collection, self.name)

    def open_named(self) -> str | None:
        target = self._alias_of()
        if target is None:
            return None
        self.collection = self.name  # searches go through the alias, as a user's do
        self.client.load_collection(target)
        return self._model_of(target)

    def drop(self, model: Model) -> bool:
        collection = physical_name(self.spec, model)
        if collection == self._alias_of() or not self.client.has_collection(collection):
            return False
        self.client.drop_collection(collection)
        return True

    def upsert(self, batches: Iterable[pa.Table]) -> None:
        for rows in batches:  # Milvus upserts by primary key: one call a batch
            data = []
            for row in rows.to_pylist():
                entity = {k: plain(v) for k, v in row.items() if v is not None and k not in ("item_id", "vector")}
                data.append({**entity, "item_id": row["item_id"], "vector": row["vector"]})
            if data:
                self.client.upsert(self.collection, data)

    def delete(self, item_ids: list[str]) -> None:
        if item_ids:
            self.client.delete(self.collection, filter=ids_filter(item_ids))

    def search(self, vector: Iterable[float], k: int) -> list[tuple[str, float]]:
        hits = self.client.search(self.collection, data=[list(map(float, vector))], limit=k, output_fields=["item_id"],
                                  search_params={"metric_type": "IP"})[0]
        return [(hit["entity"]["item_id"], float(hit["distance"])) for hit in hits]

    def get(self, item_ids: list[str]) -> dict[str, dict]:
        rows = self.client.query(self.collection, filter=ids_filter(item_ids), output_fields=["*"]) if item_ids \
            else []
        return {row["item_id"]: {k: v for k, v in row.items() if k != "vector"} for row in rows}

    def count(self) -> int:
        rows = self.client.query(self.collection, filter="", output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    def close(self) -> None:
        self.client.close()
        if self.spec.local:  # Milvus Lite serves the file from a thread of this process, holding its lock until
            from milvus_lite.server_manager import server_manager_instance  # released (or the process exits)

            server_manager_instance.release_server(self.spec.where)
