"""A project's own list of the box's tracking servers (``Project.tracking_servers``, issue 23
item 3): ``allowed_trackers(settings, project)`` keeps the servers it names, the refusals name the
project and list what it may use, the box's default applies only to a project that may use it;
``credential_variables``, what the trainer's environment goes without."""

from __future__ import annotations

import pytest

from core.errors import InvalidInput
from core.jobs.trackers import (
    allowed_trackers,
    check_trackers,
    credential_variables,
    default_refusal,
    server_for,
    withheld_default,
)
from core.projects.models import Project
from core.settings import Settings, TrackingServer

TEAM = TrackingServer(kind="mlflow", url="http://m:5000", credential_env="TEAM_TOKEN", default=True)
OPEN = TrackingServer(kind="mlflow", url="https://open.example/mlflow")
BOX = Settings(tracking_servers={"team": TEAM, "open": OPEN})
"""The box: MLflow ``team`` (default) and ``open``, and the implicit ``wandb`` (default)."""


def project(*names: str) -> Project:
    return Project(name="vision", tracking_servers=list(names))


def refusal(tracking: dict, servers) -> InvalidInput:
    with pytest.raises(InvalidInput) as info:
        check_trackers(tracking, [], servers)
    return info.value


class TestAllowedTrackers:
    def test_a_project_gets_the_servers_it_names_of_the_boxs(self):
        servers = allowed_trackers(BOX, project("open", "gone"))  # 'gone': no longer on the box, skipped
        assert servers == {"open": OPEN}
        assert (servers.project, sorted(servers.withheld)) == ("vision", ["team", "wandb"])

    def test_null_is_all_the_boxs_and_an_empty_list_none(self):
        box = allowed_trackers(BOX)
        assert allowed_trackers(BOX, Project(name="vision", tracking_servers=None)) == box
        assert sorted(box) == ["open", "team", "wandb"] and box.project is None
        assert allowed_trackers(BOX, project()) == {}


class TestRefusedForTheProject:
    def test_a_server_of_the_box_the_project_may_not_use_names_the_project_and_its_list(self):
        error = refusal({"mlflow_server": "team"}, allowed_trackers(BOX, project("open")))
        assert error.param == "tracking.mlflow_server"
        assert error.message == ("tracking.mlflow_server: project 'vision' may not use the MLflow server 'team'; "
                                 "MLflow servers project 'vision' may use: open")

    def test_an_unknown_name_lists_what_the_project_may_use(self):
        error = refusal({"mlflow_server": "elsewhere"}, allowed_trackers(BOX, project("open")))
        assert error.message == ("tracking.mlflow_server: 'elsewhere' is not an MLflow server of this box; "
                                 "MLflow servers project 'vision' may use: open")

    def test_the_url_of_a_server_the_project_may_not_use(self):
        error = refusal({"mlflow_tracking_uri": "http://m:5000/"}, allowed_trackers(BOX, project("open")))
        assert error.param == "tracking.mlflow_tracking_uri"
        assert error.message.startswith("tracking.mlflow_tracking_uri: this URL is the MLflow server 'team', "
                                        "which project 'vision' may not use; MLflow servers project 'vision' may use")

    def test_a_project_with_none_of_a_kind_says_so_and_how_to_change_it(self):
        error = refusal({"wandb_server": "wandb"}, allowed_trackers(BOX, project("team")))
        assert error.param == "tracking.wandb_server"
        assert "project 'vision' may use no W&B server" in error.message
        assert "ftq projects set vision --tracking-servers" in error.message


class TestTheBoxsDefault:
    def test_turning_mlflow_on_without_a_server_is_refused_where_the_project_lacks_the_default(self):
        servers = allowed_trackers(BOX, project("open"))
        error = refusal({"mlflow": True}, servers)
        assert error.param == "tracking.mlflow"
        assert error.message == (
            "tracking.mlflow: project 'vision' may not use the box's default MLflow server 'team', and the job names "
            "no other; name one with tracking.mlflow_server (MLflow servers project 'vision' may use: open), "
            "or set tracking.mlflow to false")
        check_trackers({"mlflow": True, "mlflow_server": "open"}, [], servers)  # naming one it may use: taken
        check_trackers({}, [], servers)  # not asked for: the box's default just does not apply

    def test_w_and_b_turned_on_by_its_project_field_is_refused_naming_that_field(self):
        servers = allowed_trackers(BOX, project("team"))
        error = refusal({"wandb_project": "sweeps"}, servers)
        assert error.param == "tracking.wandb_project"
        assert error.message.startswith("tracking.wandb_project: project 'vision' may not use the box's default "
                                        "W&B server 'wandb'; project 'vision' may use no W&B server")
        check_trackers({"wandb": False, "wandb_project": "sweeps"}, [], servers)

    def test_a_project_with_the_default_or_the_boxs_own_list_is_not_refused(self):
        for servers in (allowed_trackers(BOX), allowed_trackers(BOX, project("team", "wandb"))):
            check_trackers({"mlflow": True, "wandb": True}, [], servers)
            assert withheld_default("mlflow", servers) is None
            assert default_refusal("mlflow", "tracking.mlflow", servers) is None
        assert server_for({}, "mlflow", allowed_trackers(BOX, project("open"))) is None


class TestCredentialVariables:
    def test_the_trackers_own_and_every_configured_servers(self):
        settings = Settings(mlflow_tracking_uri="http://legacy:5000", tracking_servers={
            "open": OPEN, "wb": TrackingServer(kind="wandb", url="https://wandb.example", credential_env="WB_KEY"),
            "team2": TrackingServer(kind="mlflow", url="http://t:5000", credential_env="TEAM_TOKEN")})
        assert credential_variables(settings) == {
            "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "WANDB_API_KEY",
            "WB_KEY", "TEAM_TOKEN"}
