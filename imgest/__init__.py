"""imgest: object storage -> decoded images -> batched encoder -> Parquet shards -> FAISS indexes."""

__version__ = "0.1.0"
