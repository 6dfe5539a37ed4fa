"""Retrieval evaluation: query sets, metrics, served-vs-exact and two-retriever comparisons, fusion and routing."""
