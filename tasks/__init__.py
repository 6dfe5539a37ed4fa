"""Stage logic of the pipeline: plain functions, each wrapped by a thin Prefect task."""
