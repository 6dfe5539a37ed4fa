"""What a store holds for each model: committed rows, live vectors, models, the catalogue root, status, export."""
