"""Prefect flows: wiring of the stages in tasks/, nothing else."""
