"""Qdrant as a sync target (a server, or local mode in a folder): a point per item, its id a UUID derived from
the item_id (uuid5; Qdrant ids are integers or UUIDs), item_id and metadata in the payload, dot product on the
L2-normalised vectors, the model id in the collection's metadata."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable

import pyarrow as pa

from imgest.tasks.sync.targets import MODEL_KEY, Model, TargetSpec, check_model, plain

NAMESPACE = uuid.UUID("5b0e3c1e-8f4b-5d2a-9c61-2a1f0d6b7e44")  # imgest's: uuid5(NAMESPACE, item_id)


def point_id(item_id: str) -> str:
    return str(uuid.uuid5(NAMESPACE, item_id))


class QdrantTarget:
    def __init__(self, spec: TargetSpec):
        from qdrant_client import QdrantClient

        self.spec, self.name = spec, spec.name
        if spec.local:
            self.client = QdrantClient(path=spec.where)
        else:
            host, _, port = spec.where.rpartition(":")
            self.client = QdrantClient(host=host.strip("[]"), port=int(port),
                                       api_key=os.environ.get("QDRANT_API_KEY") or None,
                                       https=os.environ.get("QDRANT_HTTPS", "") == "1")

    def open(self, model: Model, columns: pa.Schema) -> bool:
        from qdrant_client import models

        if self.client.collection_exists(self.name):
            found = (self.client.get_collection(self.name).config.metadata or {}).get(MODEL_KEY)
            check_model(self.spec, found, model, self.count())
            if found is None:
                self.client.update_collection(self.name, metadata={MODEL_KEY: model.model_id})
            return False
        self.client.create_collection(self.name, metadata={MODEL_KEY: model.model_id},
                                      vectors_config=models.VectorParams(size=model.dim, distance=models.Distance.DOT))
        if not self.spec.local:  # local mode has no payload indexes (it says so in a warning)
            self.client.create_payload_index(self.name, "item_id", models.PayloadSchemaType.KEYWORD)
        return True

    def upsert(self, rows: pa.Table) -> None:
        from qdrant_client import models

        points = []
        for row in rows.to_pylist():
            payload = {k: plain(v) for k, v in row.items() if k != "vector"}
            points.append(models.PointStruct(id=point_id(row["item_id"]), vector=row["vector"], payload=payload))
        if points:
            self.client.upsert(self.name, points=points, wait=True)

    def delete(self, item_ids: list[str]) -> None:
        from qdrant_client import models

        if item_ids:
            self.client.delete(self.name, points_selector=models.PointIdsList(points=[point_id(i) for i in item_ids]),
                               wait=True)

    def search(self, vector: Iterable[float], k: int) -> list[tuple[str, float]]:
        hits = self.client.query_points(self.name, query=list(map(float, vector)), limit=k, with_payload=["item_id"])
        return [(hit.payload["item_id"], float(hit.score)) for hit in hits.points]

    def get(self, item_ids: list[str]) -> dict[str, dict]:
        points = self.client.retrieve(self.name, ids=[point_id(i) for i in item_ids], with_payload=True) \
            if item_ids else []
        return {p.payload["item_id"]: dict(p.payload) for p in points}

    def count(self) -> int:
        return int(self.client.count(self.name, exact=True).count)

    def close(self) -> None:
        self.client.close()
