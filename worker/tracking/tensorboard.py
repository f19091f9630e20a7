"""TensorBoard: event files in the job's log directory, written with TensorBoard's own writer.

Scalars ``train/<field>`` per step (the same fields as MLflow's, ``worker.tracking.mlflow``) and
``eval/loss``, plus the spec as a text summary ``spec`` at step 0, so ``tensorboard --logdir`` shows
the run next to its settings. Nothing is uploaded: the directory is the artifact.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from worker.tracking.dispatch import JobInfo, TrackerFailure
from worker.tracking.mlflow import metric_points


class TensorBoardTracker:
    def __init__(self, logdir: Path) -> None:
        self.logdir = Path(logdir)
        self.label = f"TensorBoard files in {self.logdir}"
        self._writer: Any = None

    def start(self, job: JobInfo) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # local, so its reason is safe to show (dispatch.describe shows only classes)
            raise TrackerFailure(f"cannot create {self.logdir}: {exc.strerror or type(exc).__name__}") from exc
        self._writer = EventFileWriter(str(self.logdir))
        self._writer.add_event(_text_event("spec", json.dumps({"job_id": job.job_id, "name": job.name,
                                                               "model": job.model, **job.spec}, indent=2)))

    def log(self, events: list[dict[str, Any]]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        for key, value, ts, step in metric_points(events):
            summary = Summary(value=[Summary.Value(tag=key, simple_value=value)])
            self._writer.add_event(Event(wall_time=ts / 1000, step=step, summary=summary))
        self._writer.flush()

    def finish(self, status: str, artifact_dir: Path | None) -> None:
        self._writer.close()


def _text_event(tag: str, text: str) -> Any:
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto

    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
    tensor = TensorProto(dtype=7, string_val=[text.encode()])  # 7: DT_STRING
    summary = Summary(value=[Summary.Value(tag=tag, metadata=metadata, tensor=tensor)])
    return Event(wall_time=time.time(), step=0, summary=summary)
