"""The store's model, which every stage reads: per model its committed rows and live set, the shard format, models,
the catalogue root and metadata, aliases, the migration window's record, retirements, shadow records, drift
references and export, and the store's layout (every key); and the clock its records are stamped with."""
