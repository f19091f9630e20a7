"""``ftq submit`` with a job file's ``tracking``: the CLI sends it as written, so the API's allow-list
of tracking servers (issue 23 item 3) refuses an unlisted URL or name, and the CLI shows the field
and the servers to name; a listed name is submitted."""

from __future__ import annotations

import contextlib
import json

import pytest
import yaml

from cli.errors import CliError
from cli.main import build_parser

SERVERS = {"team": {"kind": "mlflow", "url": "http://mlflow.internal:5000", "credential_env": "TEAM_TOKEN"}}


@pytest.fixture(autouse=True)
def tracking_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The API's FTQ_TRACKING_SERVERS, set before the ``api`` fixture builds its settings."""
    monkeypatch.setenv("FTQ_TRACKING_SERVERS", json.dumps(SERVERS))


def submit(api, job_file, tracking: dict, monkeypatch: pytest.MonkeyPatch) -> int:
    from cli import jobs

    body = yaml.safe_load(job_file.read_text())
    job_file.write_text(yaml.safe_dump({**body, "tracking": tracking}))
    monkeypatch.setattr(jobs, "connect", lambda: contextlib.nullcontext(api))
    args = build_parser().parse_args(["submit", str(job_file)])
    return args.run(args)


@pytest.mark.parametrize(("tracking", "field"), [
    ({"mlflow_tracking_uri": "http://127.0.0.1:8000"}, "tracking.mlflow_tracking_uri"),
    ({"mlflow_server": "elsewhere"}, "tracking.mlflow_server"),
])
def test_an_unlisted_server_is_refused_naming_the_field_and_the_listed_ones(api, job_file, monkeypatch, tracking,
                                                                            field):
    with pytest.raises(CliError) as info:
        submit(api, job_file, tracking, monkeypatch)
    shown = str(info.value)
    assert shown.startswith(f"POST /v1/jobs → 422: {field}: ") and shown.endswith(f"({field})"), shown
    assert "MLflow servers: team" in shown
    assert api.get("/v1/jobs").json()["data"] == []


def test_a_listed_server_by_name_is_submitted(api, job_file, monkeypatch, capsys):
    assert submit(api, job_file, {"mlflow_server": "team"}, monkeypatch) == 0
    job = api.get(f"/v1/jobs/{capsys.readouterr().out.strip()}").json()
    assert job["spec"]["tracking"]["mlflow_server"] == "team"
