"""What people read: Markdown for Prefect artifacts and the CLI, PNG plots, readable flow-run names."""
