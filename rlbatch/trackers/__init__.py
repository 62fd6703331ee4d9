"""Experiment trackers (W&B, MLflow) beside metrics.jsonl and TensorBoard: the contract and registry
(``base``, ``registry``), the validation of the ``trackers`` section (``checks``), one run's trackers
on the controller (``session``), and one module per tracker (``wandb_run``, ``mlflow_run``)."""
