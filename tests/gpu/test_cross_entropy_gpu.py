"""The cross-entropy rows kernel on CUDA at production sizes: Llama 3's 128k vocabulary, bf16."""

from __future__ import annotations

import pytest
import torch

from trainer.objectives import token_accuracy
from trainer.features.loss.fused import fused_linear_cross_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp(min=1e-30))


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("vocab", [128_256, 151_936, 1_000])
def test_kernel_matches_the_torch_path(vocab: int, softcap: float | None) -> None:
    """Loss within 1e-5 relative, hidden-state gradient within 1e-2 relative L2 (each path rounds
    the logits' gradient to bf16 once: an ulp apart where the fp32 values straddle a boundary),
    and the token-accuracy count equal."""
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden = 2048, 1024
    h = (torch.randn(tokens, hidden, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    labels[::7] = -100
    labels[:64] = (h[:64].float() @ w.float().T).argmax(-1)  # some hits
    out = []
    for kernel in (False, True):
        hh = h.clone().requires_grad_()
        count = token_accuracy.new_count(torch.device("cuda"))
        with token_accuracy.counting(count):
            loss = fused_linear_cross_entropy(hh, w, labels, num_items=tokens, softcap=softcap, kernel=kernel)
        loss.backward()
        out.append((loss.detach(), hh.grad, count.item()))
    (ref_loss, ref_dh, ref_hits), (loss, dh, hits) = out
    found = {"loss": loss.item(), "ref": ref_loss.item(), "d_hidden": _rel(dh, ref_dh), "hits": hits, "ref_hits": ref_hits}
    assert abs(found["loss"] - found["ref"]) <= 1e-5 * abs(found["ref"]), found
    assert found["d_hidden"] < 1e-2, found
    # soft-capped: tanh as 2*sigmoid(2x)-1 may reorder two nearly tied logits of a row
    assert abs(hits - ref_hits) <= (0 if softcap is None else 2) and hits >= 1, found
