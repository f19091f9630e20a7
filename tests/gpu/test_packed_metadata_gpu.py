"""Packed metadata, packed attention and the fused loss on a GPU: no host sync, same results.

Run on the lent GPU: ``python -m pytest -m gpu tests/gpu/test_packed_metadata_gpu.py``. Skipped
without CUDA. ``torch.cuda.set_sync_debug_mode("error")`` turns every synchronizing CUDA call
(``.item()``, ``nonzero``, a blocking copy) into a RuntimeError, so "no sync" is checked, not
assumed. flex attention is left out (its first compile takes minutes); ``bench/`` measures it.

Tolerances: bf16 backends against the SDPA block-mask path, worst element over the reference's
largest magnitude < 3e-2 (two bf16 attention implementations differ by a few ulps).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_helpers import no_host_sync  # noqa: E402

from trainer.features.attention.packed import packed_attention_forward  # noqa: E402
from trainer.features.attention.feature import backend_missing
from trainer.features.loss.fused import fused_linear_cross_entropy
from trainer.plan.hardware import detect
from trainer.data.packed_metadata import build_packed_metadata
from trainer.plan.types import ModelFacts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LENGTHS = [300, 17, 1024, 250, 64, 129, 1]
FAST_BACKENDS = ("sdpa", "triton", "torch_varlen")


class _Attention(torch.nn.Module):
    is_causal = True


# What the calls below need of a backend: 8 query heads over 2 KV heads, a sliding window, sinks.
_SHAPE_FACTS = ModelFacts(
    "gpt_oss", head_dim=64, sliding_window=True, attention_sinks=True, grouped_query=True
)


def _missing(backend: str) -> str | None:
    """Why ``backend`` cannot run the calls below on this GPU, or None."""
    return backend_missing(backend, detect("cuda"), _SHAPE_FACTS)


def _qkv(total: int, heads_q: int = 8, heads_kv: int = 2, dim: int = 64, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(
        1, h, total, dim, device="cuda", dtype=torch.bfloat16, generator=g
    )
    return (
        make(heads_q).requires_grad_(),
        make(heads_kv).requires_grad_(),
        make(heads_kv).requires_grad_(),
    )


def _run(
    backend: str, window: int | None, sinks: torch.Tensor | None, cache: bool = True
):
    meta = build_packed_metadata(LENGTHS, "cuda", backend=backend, cache=cache)
    q, k, v = _qkv(sum(LENGTHS))
    out, _ = packed_attention_forward(
        _Attention(),
        q,
        k,
        v,
        None,
        scaling=0.125,
        sliding_window=window,
        s_aux=sinks,
        packed_metadata=meta,
        position_ids=meta.position_ids,
    )
    out.float().square().sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


class TestNoHostSync:
    def test_building_metadata_and_every_structure_does_not_sync(self) -> None:
        with no_host_sync():
            meta = build_packed_metadata(LENGTHS, "cuda")
            meta.varlen(meta.device)
            meta.dense_mask(None, meta.device)
            meta.dense_mask(128, meta.device)
            meta.additive_mask(128, meta.device, torch.bfloat16)
        torch.cuda.synchronize()
        assert meta.cu_seqlens.tolist()[-1] == sum(LENGTHS)
        assert meta.max_seqlen == max(LENGTHS)

    @pytest.mark.parametrize("backend", FAST_BACKENDS)
    @pytest.mark.parametrize(
        ("window", "with_sinks"), [(None, False), (128, False), (128, True)]
    )
    def test_attention_forward_and_backward_do_not_sync(
        self, backend, window, with_sinks
    ) -> None:
        reason = _missing(backend)
        if reason is not None:
            pytest.skip(reason)
        sinks = torch.randn(8, device="cuda") if with_sinks else None
        _run(backend, None, None)  # warm-up: first launches compile kernels / autotune
        with no_host_sync():
            _run(backend, window, sinks)

    def test_the_cache_off_twin_does_sync_so_the_check_is_real(self) -> None:
        with no_host_sync(), pytest.raises(RuntimeError):
            _run("sdpa", None, None, cache=False)

    def test_fused_loss_does_not_sync(self) -> None:
        h = torch.randn(
            4096, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True
        )
        w = torch.randn(32_000, 256, device="cuda", dtype=torch.bfloat16) * 0.05
        y = torch.randint(0, 32_000, (4096,), device="cuda")
        with no_host_sync():
            loss = fused_linear_cross_entropy(h, w, y, num_items=4096)
            loss.backward()
        ref = torch.nn.functional.cross_entropy((h @ w.T).float(), y)
        assert loss.item() == pytest.approx(ref.item(), rel=1e-3)


class TestBackendsAgree:
    @pytest.mark.parametrize("backend", ("triton", "torch_varlen"))
    @pytest.mark.parametrize(
        ("window", "with_sinks"),
        [(None, False), (128, False), (None, True), (128, True)],
    )
    def test_matches_the_sdpa_block_mask_path(
        self, backend, window, with_sinks
    ) -> None:
        reason = _missing(backend)
        if reason is not None:
            pytest.skip(reason)
        sinks = torch.randn(8, device="cuda") if with_sinks else None
        expected = _run("sdpa", window, sinks)
        got = _run(backend, window, sinks)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
            assert _rel(a, b) < 3e-2, (
                f"{backend} {name} window={window} sinks={with_sinks}"
            )
