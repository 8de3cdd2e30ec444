"""Wiring: the evaluation's settings (declared once), its input checks, the Prefect flows that chain the stage
tasks, their deployments, and the `dflash-eval` command line."""
