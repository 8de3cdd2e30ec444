"""What people read after the evaluations: tau by step in series (history), the report, the Prefect UI's
artifacts, and the training run beside the evaluation (the trainer's logs read, the alarm, tau written into
TensorBoard and MLflow)."""
