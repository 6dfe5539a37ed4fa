"""Images: a catalogue's image files listed, their bytes decoded to RGB, JPEGs decoded at a scale by the decoder the
model's store records; what ingest, search, evaluation, heads and duplicates all read images with."""
