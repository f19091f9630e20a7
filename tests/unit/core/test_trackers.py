"""Which trackers a spec asks for, the refusal when no live worker reports the package, and the
allow-list of tracking servers (core/jobs/trackers.py, FTQ_TRACKING_SERVERS in core/settings.py);
the spec's W&B fields (core/jobs/spec.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.errors import InvalidInput, Unsupported
from core.jobs.spec import TrackingSpec
from core.jobs.trackers import allowed_trackers, asked_for, check_servers, check_trackers, server_for
from core.projects.models import Project
from core.settings import Settings, TrackingServer

ALL = {"mlflow": True, "tensorboard": True, "wandb": True}
SERVERS = {
    "team": TrackingServer(kind="mlflow", url="http://m:5000", credential_env="TEAM_TOKEN", default=True),
    "open": TrackingServer(kind="mlflow", url="https://open.example/mlflow"),
    "wb": TrackingServer(kind="wandb", url="https://wandb.example", credential_env="WB_KEY"),
}


def lacking(*names: str) -> dict:
    return {"trackers": {**ALL, **dict.fromkeys(names, False)}}


class TestAskedFor:
    def test_a_tracker_is_asked_for_by_true_or_by_naming_its_server_or_project(self):
        assert asked_for({}) == {}
        assert asked_for({"mlflow": True, "tensorboard": True, "wandb": True}) == {
            "mlflow": "tracking.mlflow", "tensorboard": "tracking.tensorboard", "wandb": "tracking.wandb"}
        assert asked_for({"mlflow_tracking_uri": "http://m:5000", "wandb_project": "p"}) == {
            "mlflow": "tracking.mlflow_tracking_uri", "wandb": "tracking.wandb_project"}
        assert asked_for({"mlflow_server": "team", "wandb_server": "wb", "wandb_project": "p"}) == {
            "mlflow": "tracking.mlflow_server", "wandb": "tracking.wandb_server"}

    def test_false_wins_over_a_named_server_or_project(self):
        assert asked_for({"mlflow": False, "mlflow_tracking_uri": "http://m:5000", "wandb": False,
                          "wandb_project": "p", "tensorboard": False}) == {}


class TestCheckTrackers:
    def test_no_live_worker_has_it_is_unsupported_naming_field_extra_and_command(self):
        with pytest.raises(Unsupported) as info:
            check_trackers({"wandb": True}, [("box-a", lacking("wandb")), ("box-b", lacking("wandb", "mlflow"))],
                           SERVERS)
        assert info.value.param == "tracking.wandb"
        message = info.value.message
        assert message.startswith("tracking.wandb: no live worker can run W&B: the wandb package is not "
                                  "installed on workers box-a, box-b.")
        assert "the 'tracking' extra: make up SERVICE_EXTRAS=tracking, or pip install 'ftq[tracking]'" in message
        assert message.endswith("or set tracking.wandb to false")

    def test_the_field_named_is_the_one_that_asked(self):
        with pytest.raises(Unsupported) as info:
            check_trackers({"mlflow_tracking_uri": "http://m:5000"}, [("box-a", lacking("mlflow"))], SERVERS)
        assert info.value.param == "tracking.mlflow_tracking_uri"

    def test_one_live_worker_with_the_package_is_enough(self):
        check_trackers({"wandb": True, "tensorboard": True}, [("box-a", lacking("wandb")), ("box-b", lacking())],
                       SERVERS)

    @pytest.mark.parametrize("reports", [
        [],  # no live worker
        [("box-a", lacking("wandb")), ("box-old", {"hardware": {"device": "cpu"}})],  # one did not say
    ])
    def test_accepted_when_the_api_cannot_know(self, reports):
        check_trackers({"wandb": True}, reports, SERVERS)

    def test_a_job_asking_for_nothing_is_never_refused(self):
        check_trackers({"mlflow": None, "wandb": False}, [("box-a", {"trackers": dict.fromkeys(ALL, False)})], SERVERS)

    def test_an_unlisted_url_is_refused_before_the_packages_are_asked_about(self):
        with pytest.raises(InvalidInput) as info:
            check_trackers({"mlflow": False, "mlflow_tracking_uri": "http://127.0.0.1:8000"}, [], SERVERS)
        assert info.value.param == "tracking.mlflow_tracking_uri" and not isinstance(info.value, Unsupported)


class TestAllowedTrackers:
    def test_the_listed_servers_plus_w_and_b_as_the_worker_configures_it_when_none_is_listed(self):
        settings = Settings(tracking_servers={"team": SERVERS["team"]})
        assert allowed_trackers(settings) == {
            "team": SERVERS["team"],
            "wandb": TrackingServer(kind="wandb", url=None, credential_env="WANDB_API_KEY", default=True)}
        listed = Settings(tracking_servers=SERVERS)
        assert allowed_trackers(listed) == SERVERS  # a listed W&B server: no implicit one
        assert allowed_trackers(listed, Project(name="any", tracking_servers=None)) == SERVERS  # null: all the box's

    def test_the_box_mlflow_uri_is_the_default_server_mlflow_sent_mlflows_own_token(self):
        servers = allowed_trackers(Settings(mlflow_tracking_uri="http://mlflow:5000/",
                                            tracking_servers={"open": SERVERS["open"]}))
        assert servers["mlflow"] == TrackingServer(kind="mlflow", url="http://mlflow:5000",
                                                   credential_env="MLFLOW_TRACKING_TOKEN", default=True)
        assert servers["open"] == SERVERS["open"]

    def test_nothing_configured_lists_no_mlflow_server(self):
        assert {s.kind for s in allowed_trackers(Settings()).values()} == {"wandb"}


class TestServerFor:
    def test_a_named_server_or_else_the_default_of_its_kind(self):
        assert server_for({"mlflow_server": "open"}, "mlflow", SERVERS) == ("open", SERVERS["open"])
        assert server_for({}, "mlflow", SERVERS) == ("team", SERVERS["team"])
        assert server_for({"wandb_server": "wb"}, "wandb", SERVERS) == ("wb", SERVERS["wb"])
        assert server_for({}, "wandb", SERVERS) is None  # wb is not marked default

    def test_an_unknown_name_is_refused_naming_the_field_and_the_servers_of_that_kind(self):
        with pytest.raises(InvalidInput) as info:
            server_for({"mlflow_server": "wb"}, "mlflow", SERVERS)  # a W&B server is no MLflow server
        assert info.value.param == "tracking.mlflow_server"
        assert info.value.message == ("tracking.mlflow_server: 'wb' is not an MLflow server of this box; "
                                      "MLflow servers: open, team")
        with pytest.raises(InvalidInput, match="this box lists no W&B server"):
            server_for({"wandb_server": "x"}, "wandb", {"team": SERVERS["team"]})

    def test_the_old_uri_is_taken_only_as_a_listed_servers_url(self):
        assert server_for({"mlflow_tracking_uri": "https://open.example/mlflow/"}, "mlflow", SERVERS)[0] == "open"
        for uri in ("http://127.0.0.1:8000", "http://m:5000/api", "https://open.example"):
            with pytest.raises(InvalidInput) as info:
                server_for({"mlflow_tracking_uri": uri}, "mlflow", SERVERS)
            assert info.value.param == "tracking.mlflow_tracking_uri"
            assert "name one with tracking.mlflow_server instead (MLflow servers: open, team)" in info.value.message

    def test_a_name_and_the_url_of_another_server_are_refused(self):
        named = {"mlflow_server": "team", "mlflow_tracking_uri": "http://m:5000"}
        assert server_for(named, "mlflow", SERVERS)[0] == "team"
        with pytest.raises(InvalidInput) as info:
            server_for({"mlflow_server": "open", "mlflow_tracking_uri": "http://m:5000"}, "mlflow", SERVERS)
        assert info.value.param == "tracking.mlflow_tracking_uri"

    def test_check_servers_refuses_a_name_even_with_the_tracker_off(self):
        with pytest.raises(InvalidInput) as info:
            check_servers({"wandb": False, "wandb_server": "elsewhere"}, SERVERS)
        assert info.value.param == "tracking.wandb_server"
        check_servers({"mlflow": False, "wandb": False}, SERVERS)


class TestTrackingServersSetting:
    def test_read_from_ftq_tracking_servers_as_json(self, monkeypatch: pytest.MonkeyPatch):
        monkeypatch.setenv("FTQ_TRACKING_SERVERS", '{"team": {"kind": "mlflow", "url": "http://m:5000/", '
                           '"credential_env": "TEAM_TOKEN", "default": true}}')
        assert Settings().tracking_servers == {"team": SERVERS["team"]}

    @pytest.mark.parametrize(("servers", "where"), [
        ({"Team": {"kind": "mlflow", "url": "http://m"}}, "not a server name"),
        ({"a": {"kind": "mlflow"}}, "an MLflow server needs its URL"),
        ({"a": {"kind": "mlflow", "url": "http://user:secret@m:5000"}}, "url"),
        ({"a": {"kind": "mlflow", "url": "file:///etc"}}, "url"),
        ({"a": {"kind": "mlflow", "url": "http://m", "credential_env": "A-B"}}, "credential_env"),
        ({"a": {"kind": "mlflow", "url": "http://m", "default": True},
          "b": {"kind": "mlflow", "url": "http://n", "default": True}}, "a, b are all default mlflow servers"),
        ({"a": {"kind": "mlflow", "url": "http://m", "token": "x"}}, "token"),  # credentials are never settings values
    ])
    def test_refused_at_start(self, servers, where):
        with pytest.raises(ValueError, match=where):
            Settings(tracking_servers=servers)

    def test_the_box_mlflow_uri_may_not_clash_with_the_list(self):
        with pytest.raises(ValueError, match="list it once"):
            Settings(mlflow_tracking_uri="http://m:5000", tracking_servers={"mlflow": SERVERS["open"]})
        with pytest.raises(ValueError, match="keep one default"):
            Settings(mlflow_tracking_uri="http://m:5000", tracking_servers={"team": SERVERS["team"]})
        with pytest.raises(ValueError, match="FTQ_MLFLOW_TRACKING_URI: 'databricks' is not an http"):
            Settings(mlflow_tracking_uri="databricks")


class TestWandbSpec:
    def test_project_entity_name_and_tags(self):
        spec = TrackingSpec(wandb=True, wandb_project="my sweeps", wandb_entity="team-1", wandb_name="run a",
                            wandb_tags=["lora", "r16"])
        assert (spec.wandb_project, spec.wandb_tags) == ("my sweeps", ["lora", "r16"])

    @pytest.mark.parametrize(("fields", "where"), [
        ({"wandb_project": "a/b"}, "wandb_project"),
        ({"wandb_entity": "team:x"}, "wandb_entity"),
        ({"wandb_tags": ["x" * 65]}, "wandb_tags"),
        ({"wandb_tags": [str(i) for i in range(51)]}, "wandb_tags"),
        ({"wandb_api_key": "secret"}, "wandb_api_key"),  # the key comes from the worker's environment only
        ({"mlflow_server": "Team A"}, "mlflow_server"),
        ({"wandb_server": "../x"}, "wandb_server"),
    ])
    def test_refused_fields(self, fields, where):
        with pytest.raises(ValidationError) as info:
            TrackingSpec(**fields)
        assert info.value.errors()[0]["loc"][0] == where
