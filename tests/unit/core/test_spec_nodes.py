"""``nodes`` in the job spec: gpus a multiple of nodes. Method full across machines is a valid
spec; whether the box has machines sharing a checkpoint directory for it is admission's question
(tests/unit/core/test_shared_storage_admission.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.jobs.spec import JobSpec

BASE = {"model": "org/m", "training_file": "file-" + "a" * 24}


def _refusal(**fields: object) -> dict:
    with pytest.raises(ValidationError) as refused:
        JobSpec(**BASE, **fields)
    [error] = refused.value.errors()
    return error


class TestNodes:
    def test_one_machine_by_default(self):
        assert JobSpec(**BASE).nodes == 1

    def test_gpus_spread_evenly_over_machines(self):
        assert JobSpec(**BASE, gpus=4, nodes=2).nodes == 2

    def test_gpus_not_a_multiple_of_nodes_is_refused_naming_nodes(self):
        error = _refusal(gpus=3, nodes=2)
        assert error["loc"] == ("nodes",) and "multiple of nodes" in error["msg"]

    def test_method_full_across_machines_is_a_valid_spec(self):
        assert JobSpec(**BASE, gpus=2, nodes=2, method="full").nodes == 2

    def test_qlora_may_span_machines(self):
        assert JobSpec(**BASE, gpus=2, nodes=2, method="qlora").nodes == 2
