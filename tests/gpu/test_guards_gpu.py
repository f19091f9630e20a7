"""The non-finite guard on a CUDA device: the skip stays on the device (no host sync).

Run on the lent GPU: ``python -m pytest -m gpu tests/gpu/test_guards_gpu.py``. Skipped without CUDA.
``trainer.training.guards.arm`` hands the fused AdamW a device flag; with sync debug mode ``error`` any
host read in arm + step would raise. A NaN step leaves parameters, moments and the step count as
they were; a finite one after it trains.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_helpers import no_host_sync  # noqa: E402

from trainer.training import guards  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_nan_step_is_skipped_on_the_device_without_a_host_sync() -> None:
    param = torch.nn.Parameter(torch.ones(1024, device="cuda"))
    optimizer = torch.optim.AdamW([param], lr=0.1, weight_decay=0.1, fused=True)
    param.grad = torch.ones_like(param)
    optimizer.step()  # creates the state (its first step may allocate and sync)
    before = param.detach().clone(), optimizer.state[param]["exp_avg"].clone(), optimizer.state[param]["step"].clone()

    param.grad = torch.full_like(param, float("nan"))
    loss, grad_norm = torch.tensor(float("nan"), device="cuda"), torch.linalg.vector_norm(param.grad)
    with no_host_sync():
        assert guards.arm(optimizer, loss, grad_norm) is True
        optimizer.step()
    torch.cuda.synchronize()
    assert torch.equal(param.detach(), before[0])
    assert torch.equal(optimizer.state[param]["exp_avg"], before[1])
    assert torch.equal(optimizer.state[param]["step"], before[2])

    param.grad = torch.ones_like(param)
    finite_loss = torch.tensor(1.0, device="cuda")  # a host->device copy: made before the no-sync block
    with no_host_sync():
        guards.arm(optimizer, finite_loss, torch.linalg.vector_norm(param.grad))
        optimizer.step()
    torch.cuda.synchronize()
    assert (param.detach() < before[0]).all() and optimizer.state[param]["step"].item() == before[2].item() + 1
