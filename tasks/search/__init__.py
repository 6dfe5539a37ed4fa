"""Search by image or text with the model that built the index, optionally filtered by catalogue metadata."""
