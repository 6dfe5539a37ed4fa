"""imgest: object storage -> decoded images -> batched encoder -> Parquet shards -> FAISS indexes.

The Python API is `from imgest import search, Searcher, FollowingSearcher, Query` (docs/indexes-and-search.md);
everything else is reached through `imgest.flows` (Prefect flows), `imgest.tasks` (their stages) and the
`imgest` command.
"""

from __future__ import annotations

from imgest.memory import prefer_huge_pages
from imgest.names import VERSION
from imgest.redact import redact_logging

__version__ = VERSION
__all__ = ["FollowingSearcher", "Query", "Searcher", "__version__", "search"]

# Every process that imports imgest (the CLI, workers, Dask) masks secrets in Prefect's log records, tracebacks
# included, before they reach its database.
redact_logging()
# Before torch is imported: its large CPU tensors on huge pages (imgest/memory.py).
prefer_huge_pages()


def __getattr__(name: str):
    # Lazy: `import imgest` (the CLI, every worker) must not pay for faiss, torch and Prefect up front.
    if name in ("Query", "Searcher", "search"):
        from imgest.retrieval import query as module

        return getattr(module, name)
    if name == "FollowingSearcher":
        from imgest.retrieval.following import FollowingSearcher

        return FollowingSearcher
    raise AttributeError(f"module 'imgest' has no attribute {name!r}")
