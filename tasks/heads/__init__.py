"""Embedding heads: training data (labels or augmented views), training on frozen base vectors, scoring."""
