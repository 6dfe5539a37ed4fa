"""Duplicate images: exact (same bytes) and near (embeddings above a cosine threshold)."""
