"""Model migration: the window, coverage, and the alias moves the window allows."""
