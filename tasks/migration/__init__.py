"""Model migration: the window, aliases moved by compare-and-swap, retention of retired models."""
