"""The HTTP search service (`imgest api`): requests over a searcher that follows its aliases, thumbnails, shadow
traffic."""
