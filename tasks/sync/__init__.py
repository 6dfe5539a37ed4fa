"""Sync: keep an external vector database (Milvus, Qdrant, LanceDB) in step with a model's live items."""
