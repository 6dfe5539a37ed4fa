"""What people read of the stages' results: Markdown for Prefect artifacts and the CLI, the cost model, readable
flow-run names. Above the stages (it reads their results), below the flows and the CLI that print it."""
