"""Experiment tracking: the worker mirrors a job's params, step metrics and adapter to the
trackers a team already reads (MLflow, TensorBoard, Weights & Biases).

The worker, not the trainer, does it: it already reads every event, and the trainer stays free
of service dependencies. Off unless configured on the box (a default server of
``FTQ_TRACKING_SERVERS`` or ``FTQ_MLFLOW_TRACKING_URI``, ``FTQ_TENSORBOARD_DIR``,
``FTQ_WANDB_PROJECT``) or in the job's ``tracking`` spec (``resolve.trackers_for``), and only to
servers the operator lists, each sent only its own credential; the worker reports which trackers' packages it has
(``resolve.installed``) so the API refuses one that no live worker can run. Every
tracker runs on one background thread per job (``dispatch.Tracking``), so a slow or down tracker
never slows or fails the job: its first error is a warning in the job's events, in ftq's words
(never a server's answer), and the tracker is dropped for the rest of the run.
"""

from worker.tracking.dispatch import JobInfo, Tracker, TrackerFailure, Tracking
from worker.tracking.resolve import installed, start_tracking, trackers_for

__all__ = ["JobInfo", "Tracker", "TrackerFailure", "Tracking", "installed", "start_tracking", "trackers_for"]
