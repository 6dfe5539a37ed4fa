"""Retrieval evaluation: served-vs-exact and two-retriever comparisons, candidate models, routing tables written."""
