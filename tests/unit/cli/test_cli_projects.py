"""``ftq projects ...`` and ``--project`` on the commands that create and list work, against the
real API app in process; the config file's ``project`` as the default."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from cli import config, jobs, projects
from cli.errors import CliError
from cli.main import build_parser


@pytest.fixture
def cli(api: TestClient, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> TestClient:
    """The commands talk to ``api``; the config file lives in tmp."""
    monkeypatch.setenv("FTQ_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.delenv("FTQ_PROJECT", raising=False)
    for module in (projects, jobs):
        monkeypatch.setattr(module, "connect", lambda: contextlib.nullcontext(api))
    return api


def run(argv: list[str]) -> str:
    args = build_parser().parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.run(args) == 0
    return out.getvalue()


class TestProjectsCommands:
    def test_create_list_members_and_set(self, cli: TestClient) -> None:
        assert "project vision (proj-" in run(["projects", "create", "vision", "--max-gpus", "4",
                                                "--max-priority", "normal"])
        listed = run(["projects", "list"])
        assert listed.splitlines()[0].split() == ["NAME", "ROLE", "DEFAULT", "MAX", "GPUS", "MAX", "PRIORITY",
                                                  "TRACKING", "SERVERS"]
        assert any(line.split()[:1] == ["vision"] and line.split()[-3:] == ["4", "normal", "all"]
                   for line in listed.splitlines())
        assert "admin is a project admin of vision" in run(["projects", "add-member", "vision", "admin", "--role", "admin"])
        assert run(["projects", "members", "vision"]).strip() == "admin  admin"
        assert run(["projects", "set", "vision", "--max-gpus", "none"]).splitlines()[1].split()[-3:] == [
            "-", "normal", "all"]
        assert run(["projects", "set", "vision", "--max-gpus", "0"]).splitlines()[1].split()[-3:] == [
            "0", "normal", "all"]  # a quota of 0 GPUs shows as 0, not as no quota
        with pytest.raises(CliError, match="--max-gpus: 'lots' is not a number of GPUs"):
            run(["projects", "set", "vision", "--max-gpus", "lots"])

    def test_tracking_servers_names_all_or_none(self, cli: TestClient) -> None:
        run(["projects", "create", "vision", "--tracking-servers", "wandb"])
        assert cli.get("/v1/projects/vision").json()["tracking_servers"] == ["wandb"]
        for value, stored, shown in (("none", [], "none"), ("all", None, "all"), ("wandb,", ["wandb"], "wandb")):
            line = run(["projects", "set", "vision", "--tracking-servers", value]).splitlines()[1]
            assert cli.get("/v1/projects/vision").json()["tracking_servers"] == stored
            assert line.split()[-1] == shown
        with pytest.raises(CliError, match=r"422: tracking_servers: 'elsewhere' is not a tracking server of this box; "
                                           r"its servers: .*wandb"):
            run(["projects", "set", "vision", "--tracking-servers", "wandb,elsewhere"])
        with pytest.raises(CliError, match="--tracking-servers: ',' names no server"):
            run(["projects", "set", "vision", "--tracking-servers", ","])

    def test_default_local_writes_the_config_file_and_submit_uses_it(self, cli: TestClient, job_file: Path) -> None:
        run(["projects", "create", "vision"])
        run(["projects", "add-member", "vision", "admin"])
        assert "work in vision" in run(["projects", "default", "vision", "--local"])
        assert config.load_config()["project"] == "vision" and config.default_project() == "vision"
        job_id = run(["submit", str(job_file)]).strip()
        job = cli.get(f"/v1/jobs/{job_id}").json()
        assert job["project"] == "vision"
        assert cli.get(f"/v1/files/{job['training_file']}").json()["project"] == "vision"
        assert run(["jobs", "--project", "default"]).count("job-") == 0
        assert job_id in run(["jobs", "--project", "vision"])

    def test_the_flag_wins_over_the_config_and_an_unknown_project_is_refused(self, cli: TestClient,
                                                                            job_file: Path) -> None:
        config.save_config({"project": "default"})
        with pytest.raises(CliError, match=r"404: project: no project 'nope' among yours.*\(project\)"):
            run(["submit", str(job_file), "--project", "nope"])
        job_id = run(["submit", str(job_file), "--project", "default"]).strip()
        assert cli.get(f"/v1/jobs/{job_id}").json()["project"] == "default"

    def test_default_on_the_box_moves_the_users_default(self, cli: TestClient) -> None:
        run(["projects", "create", "second"])
        run(["projects", "add-member", "second", "admin"])
        assert "your default project is now second" in run(["projects", "default", "second"])
        assert {p["name"]: p["default"] for p in cli.get("/v1/projects").json()["data"]}["second"] is True


def test_users_create_takes_projects() -> None:
    args = build_parser().parse_args(["users", "create", "ann", "--project", "a", "--project", "b"])
    assert args.projects == ["a", "b"]
    assert SimpleNamespace(**vars(args)).run.__name__ == "run_create"
