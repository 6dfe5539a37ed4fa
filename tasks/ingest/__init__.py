"""Ingest: list the catalogue, plan new/changed/deleted work, decode, encode and write shards, commit a run."""
