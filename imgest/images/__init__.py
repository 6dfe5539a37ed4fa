"""Images: a catalogue's image files listed, their bytes decoded to RGB, JPEGs decoded at a scale by the fastest
decoder measured; what ingest, search, evaluation, heads and duplicates all read images with."""
