"""FAISS indexes: choose a kind for N, d and a budget; build, update in place, tune to a recall; versions and cards."""
