"""Qdrant as a sync target (a server, or local mode in a folder): a point per item, its id a UUID derived from
the item_id (uuid5; Qdrant ids are integers or UUIDs), item_id and metadata in the payload, dot product on the
L2-normalised vectors, the model id in the collection's metadata; a collection per model (COLLECTION__<slug>),
COLLECTION a collection alias of the serving model's, moved by one update_collection_aliases call (delete and
create together: the server applies them as one)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable

import pyarrow as pa

from imgest.tasks.sync.targets import (
    MODEL_KEY,
    SLUG_KEY,
    Model,
    TargetSpec,
    check_model,
    credential,
    physical_name,
    plain,
    plain_collection,
)

NAMESPACE = uuid.UUID("5b0e3c1e-8f4b-5d2a-9c61-2a1f0d6b7e44")  # imgest's: uuid5(NAMESPACE, item_id)


def point_id(item_id: str) -> str:
    return str(uuid.uuid5(NAMESPACE, item_id))


class QdrantTarget:
    def __init__(self, spec: TargetSpec):
        from qdrant_client import QdrantClient

        self.spec, self.name, self.collection = spec, spec.name, spec.name
        if spec.local:
            self.client = QdrantClient(path=spec.where)
        else:
            host, _, port = spec.where.rpartition(":")
            self.client = QdrantClient(host=host.strip("[]"), port=int(port),
                                       api_key=credential("QDRANT_API_KEY"),
                                       https=os.environ.get("QDRANT_HTTPS", "") == "1")

    def _alias_of(self) -> str | None:
        """The collection the target's name is an alias of; None when it is none (SyncError: a collection)."""
        for alias in self.client.get_aliases().aliases:
            if alias.alias_name == self.name:
                return alias.collection_name
        if self.client.collection_exists(self.name):
            raise plain_collection(self.spec)
        return None

    def _model_of(self, collection: str) -> str | None:
        return (self.client.get_collection(collection).config.metadata or {}).get(MODEL_KEY)

    def open(self, model: Model, columns: pa.Schema, takes_name: bool = False) -> bool:
        from qdrant_client import models

        self._alias_of()  # a collection under the target's own name is refused before anything is created
        self.collection = physical_name(self.spec, model)
        if self.client.collection_exists(self.collection):
            found = self._model_of(self.collection)
            check_model(self.spec, self.collection, found, model, self.count())
            if found is None:
                self.client.update_collection(self.collection, metadata={MODEL_KEY: model.model_id,
                                                                         SLUG_KEY: model.slug})
            return False
        self.client.create_collection(self.collection, metadata={MODEL_KEY: model.model_id, SLUG_KEY: model.slug},
                                      vectors_config=models.VectorParams(size=model.dim, distance=models.Distance.DOT))
        if not self.spec.local:  # local mode has no payload indexes (it says so in a warning)
            self.client.create_payload_index(self.collection, "item_id", models.PayloadSchemaType.KEYWORD)
        return True

    def answers(self) -> str | None:
        target = self._alias_of()
        return self._model_of(target) if target else None

    def point(self, model: Model) -> None:
        from qdrant_client import models

        collection, now = physical_name(self.spec, model), self._alias_of()
        if now == collection:
            return
        ops = [models.DeleteAliasOperation(delete_alias=models.DeleteAlias(alias_name=self.name))] if now else []
        ops.append(models.CreateAliasOperation(create_alias=models.CreateAlias(collection_name=collection,
                                                                               alias_name=self.name)))
        self.client.update_collection_aliases(change_aliases_operations=ops)

    def open_named(self) -> str | None:
        target = self._alias_of()
        if target is None:
            return None
        self.collection = self.name  # searches go through the alias, as a user's do
        return self._model_of(target)

    def drop(self, model: Model) -> bool:
        collection = physical_name(self.spec, model)
        if collection == self._alias_of() or not self.client.collection_exists(collection):
            return False
        return bool(self.client.delete_collection(collection))

    def upsert(self, batches: Iterable[pa.Table]) -> None:
        from qdrant_client import models

        for rows in batches:  # Qdrant upserts by point id: one call a batch
            points = []
            for row in rows.to_pylist():
                payload = {k: plain(v) for k, v in row.items() if k != "vector"}
                points.append(models.PointStruct(id=point_id(row["item_id"]), vector=row["vector"], payload=payload))
            if points:
                self.client.upsert(self.collection, points=points, wait=True)

    def delete(self, item_ids: list[str]) -> None:
        from qdrant_client import models

        if item_ids:
            self.client.delete(self.collection, wait=True,
                               points_selector=models.PointIdsList(points=[point_id(i) for i in item_ids]))

    def search(self, vector: Iterable[float], k: int) -> list[tuple[str, float]]:
        hits = self.client.query_points(self.collection, query=list(map(float, vector)), limit=k,
                                        with_payload=["item_id"])
        return [(hit.payload["item_id"], float(hit.score)) for hit in hits.points]

    def get(self, item_ids: list[str]) -> dict[str, dict]:
        points = self.client.retrieve(self.collection, ids=[point_id(i) for i in item_ids], with_payload=True) \
            if item_ids else []
        return {p.payload["item_id"]: dict(p.payload) for p in points}

    def count(self) -> int:
        return int(self.client.count(self.collection, exact=True).count)

    def close(self) -> None:
        self.client.close()
