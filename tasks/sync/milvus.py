"""Milvus as a sync target (a server, or a Milvus Lite file): item_id the VARCHAR primary key, the vector a
FLOAT_VECTOR searched by inner product (FLAT: exact), metadata as dynamic fields, the model id a property."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import pyarrow as pa

from imgest.tasks.sync.targets import MODEL_KEY, Model, TargetSpec, check_model, plain

MAX_ID_CHARS = 4096


class MilvusTarget:
    def __init__(self, spec: TargetSpec):
        from pymilvus import MilvusClient

        self.spec = spec
        uri = spec.where if spec.local else f"http://{spec.where}"
        token = os.environ.get("MILVUS_TOKEN", "")  # user:password or an API key; never in the URL
        self.client = MilvusClient(uri=uri, token=token) if token else MilvusClient(uri=uri)
        self.name = spec.name

    def open(self, model: Model, columns: pa.Schema) -> bool:
        from pymilvus import DataType, MilvusClient

        if self.client.has_collection(self.name):
            found = self.client.describe_collection(self.name).get("properties", {}).get(MODEL_KEY)
            check_model(self.spec, found, model, self.count())
            if found is None:
                self.client.alter_collection_properties(self.name, properties={MODEL_KEY: model.model_id})
            self.client.load_collection(self.name)
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
            self.client.create_collection(self.name, schema=schema, index_params=index,
                                          properties={MODEL_KEY: model.model_id}, consistency_level="Strong")
        finally:
            if quiet:
                grpc_log.setLevel(level)
        return True

    def upsert(self, rows: pa.Table) -> None:
        data = []
        for row in rows.to_pylist():
            entity = {k: plain(v) for k, v in row.items() if v is not None and k not in ("item_id", "vector")}
            data.append({**entity, "item_id": row["item_id"], "vector": row["vector"]})
        if data:
            self.client.upsert(self.name, data)

    def delete(self, item_ids: list[str]) -> None:
        if item_ids:
            self.client.delete(self.name, ids=list(item_ids))

    def search(self, vector: Iterable[float], k: int) -> list[tuple[str, float]]:
        hits = self.client.search(self.name, data=[list(map(float, vector))], limit=k, output_fields=["item_id"],
                                  search_params={"metric_type": "IP"})[0]
        return [(hit["entity"]["item_id"], float(hit["distance"])) for hit in hits]

    def get(self, item_ids: list[str]) -> dict[str, dict]:
        rows = self.client.get(self.name, ids=list(item_ids), output_fields=["*"]) if item_ids else []
        return {row["item_id"]: {k: v for k, v in row.items() if k != "vector"} for row in rows}

    def count(self) -> int:
        rows = self.client.query(self.name, filter="", output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    def close(self) -> None:
        self.client.close()
        if self.spec.local:  # Milvus Lite serves the file from a thread of this process, holding its lock until
            from milvus_lite.server_manager import server_manager_instance  # released (or the process exits)

            server_manager_instance.release_server(self.spec.where)
