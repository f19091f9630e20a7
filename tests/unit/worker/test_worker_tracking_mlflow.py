"""A job tracked on a real ``mlflow server`` (SQLite backend, proxied artifacts) started here, listed
as a tracking server of the box (``FTQ_TRACKING_SERVERS``): the run has the spec as params, the step
metrics by step and the adapter as an artifact, whether the job names the server or gives its URL
(the older ``mlflow_tracking_uri``), the worker speaking MLflow's REST API itself."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import update

from core.jobs.models import Job
from core.settings import TrackingServer
from trainer.training import layout
from worker.runner import run_job

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    log = (root / "server.log").open("wb")
    server = subprocess.Popen(
        [str(mlflow), "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its uvicorn worker: its own session
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def finished_run(tracking_uri: str, experiment: str) -> object:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    deadline = time.monotonic() + 120
    runs: list = []
    while time.monotonic() < deadline:
        found = client.get_experiment_by_name(experiment)
        runs = client.search_runs([found.experiment_id]) if found else []
        if runs and runs[0].info.status == "FINISHED":
            break
        time.sleep(0.5)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", runs
    return runs[0]


@pytest.mark.parametrize("named_by", [{"mlflow_server": "local"}, {"mlflow_tracking_uri": "<url>/"}])
def test_a_job_is_an_mlflow_run_with_params_metrics_by_step_and_the_adapter(
    runtime, make_job, settings, mlflow_server, named_by
):
    from mlflow.tracking import MlflowClient

    runtime.settings = settings.model_copy(update={"tracking_servers": {
        "local": TrackingServer(kind="mlflow", url=mlflow_server)}})
    experiment = f"ftq-test-{next(iter(named_by))}"
    job_id = make_job("fake:ok:5", name="lr sweep a")
    tracking = {key: value.replace("<url>", mlflow_server) for key, value in named_by.items()}
    spec = {"hyperparameters": {"learning_rate": 0.0002, "max_steps": 5},
            "tracking": {**tracking, "mlflow_experiment": experiment}}
    with runtime.sessionmaker.begin() as session:
        session.execute(update(Job).where(Job.job_id == job_id).values(spec=spec))
    adapter = layout.export_dir(settings.jobs_dir / job_id, "lora")  # what the real trainer writes at the end
    (adapter / "tokenizer").mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"r": 16}')
    (adapter / "tokenizer" / "tokenizer config.json").write_text("{}")  # a space: quoted in the URL

    assert run_job(runtime, job_id) == "succeeded"

    run = finished_run(mlflow_server, experiment)
    client = MlflowClient(tracking_uri=mlflow_server)
    assert run.info.run_name == "lr sweep a" and run.data.tags["ftq.job_id"] == job_id
    assert run.data.params["hyperparameters.learning_rate"] == "0.0002" and run.data.params["job_id"] == job_id
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "adapter")]
    assert artifacts == ["adapter/adapter_config.json", "adapter/tokenizer"]
    nested = [a.path for a in client.list_artifacts(run.info.run_id, "adapter/tokenizer")]
    assert nested == ["adapter/tokenizer/tokenizer config.json"]
