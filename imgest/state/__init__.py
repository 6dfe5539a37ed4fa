"""The store's model, which every stage reads: per model its committed rows and live set, the shard format, models,
the catalogue root and metadata, aliases, the migration window's record, retirements, shadow records, drift
references, status and export; and the clock its records are stamped with."""
