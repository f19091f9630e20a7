"""Which trackers a spec asks for, and the refusal when no live worker reports the package
(core/jobs/trackers.py); the spec's W&B fields (core/jobs/spec.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.errors import Unsupported
from core.jobs.spec import TrackingSpec
from core.jobs.trackers import asked_for, check_trackers

ALL = {"mlflow": True, "tensorboard": True, "wandb": True}


def lacking(*names: str) -> dict:
    return {"trackers": {**ALL, **dict.fromkeys(names, False)}}


class TestAskedFor:
    def test_a_tracker_is_asked_for_by_true_or_by_naming_its_server_or_project(self):
        assert asked_for({}) == {}
        assert asked_for({"mlflow": True, "tensorboard": True, "wandb": True}) == {
            "mlflow": "tracking.mlflow", "tensorboard": "tracking.tensorboard", "wandb": "tracking.wandb"}
        assert asked_for({"mlflow_tracking_uri": "http://m:5000", "wandb_project": "p"}) == {
            "mlflow": "tracking.mlflow_tracking_uri", "wandb": "tracking.wandb_project"}

    def test_false_wins_over_a_named_server_or_project(self):
        assert asked_for({"mlflow": False, "mlflow_tracking_uri": "http://m:5000", "wandb": False,
                          "wandb_project": "p", "tensorboard": False}) == {}


class TestCheckTrackers:
    def test_no_live_worker_has_it_is_unsupported_naming_field_extra_and_command(self):
        with pytest.raises(Unsupported) as info:
            check_trackers({"wandb": True}, [("box-a", lacking("wandb")), ("box-b", lacking("wandb", "mlflow"))])
        assert info.value.param == "tracking.wandb"
        message = info.value.message
        assert message.startswith("tracking.wandb: no live worker can run W&B: the wandb package is not "
                                  "installed on workers box-a, box-b.")
        assert "the 'tracking' extra: make up SERVICE_EXTRAS=tracking, or pip install 'ftq[tracking]'" in message
        assert message.endswith("or set tracking.wandb to false")

    def test_the_field_named_is_the_one_that_asked(self):
        with pytest.raises(Unsupported) as info:
            check_trackers({"mlflow_tracking_uri": "http://m:5000"}, [("box-a", lacking("mlflow"))])
        assert info.value.param == "tracking.mlflow_tracking_uri"

    def test_one_live_worker_with_the_package_is_enough(self):
        check_trackers({"wandb": True, "tensorboard": True}, [("box-a", lacking("wandb")), ("box-b", lacking())])

    @pytest.mark.parametrize("reports", [
        [],  # no live worker
        [("box-a", lacking("wandb")), ("box-old", {"hardware": {"device": "cpu"}})],  # one did not say
    ])
    def test_accepted_when_the_api_cannot_know(self, reports):
        check_trackers({"wandb": True}, reports)

    def test_a_job_asking_for_nothing_is_never_refused(self):
        check_trackers({"mlflow": None, "wandb": False}, [("box-a", {"trackers": dict.fromkeys(ALL, False)})])


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
    ])
    def test_refused_fields(self, fields, where):
        with pytest.raises(ValidationError) as info:
            TrackingSpec(**fields)
        assert info.value.errors()[0]["loc"][0] == where
