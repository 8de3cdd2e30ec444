"""Wiring: the Prefect flows that chain the stage tasks, their deployments, history, report and artifacts, and the `dflash-eval` command line."""
