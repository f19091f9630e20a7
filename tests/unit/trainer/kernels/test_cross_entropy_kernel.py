"""The cross-entropy rows kernel (``trainer.kernels.cross_entropy``) against the torch path.

The kernel runs on CPU under ``TRITON_INTERPRET=1`` in a child process (the interpreter is chosen
when kernels are decorated, at import): the whole fused loss with ``kernel=True`` against
``kernel=False`` on the same inputs, fp32 and bf16, a vocabulary that is not a multiple of the
kernel's block (and a block smaller than the vocabulary, so the online max/sum runs several
iterations), ignored rows, soft-capping, a trainable head, and the token-accuracy count.
Tolerance: relative L2 1e-5 for fp32 (the online log-sum-exp sums in another order than
``torch.logsumexp``); bf16 gradients are rounded once to bf16 on both paths, so they may
differ by one bf16 ulp where the fp32 values straddle a rounding boundary: 1e-2.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from tests.fixtures.interpreter import interpreter_results as run_in_interpreter

HAS_TRITON = importlib.util.find_spec("triton") is not None
CASES = [
    # (tokens, hidden, vocab, dtype, softcap, trainable head, scale as a device tensor)
    (37, 16, 300, "float32", None, False, False),
    (37, 16, 300, "float32", 5.0, True, True),
    (64, 32, 1000, "bfloat16", None, False, False),
    (9, 8, 77, "float32", None, True, False),
]
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


@pytest.fixture(scope="module")
def interpreter_results() -> list[dict[str, float]]:
    return run_in_interpreter(__file__, timeout=300)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.slow  # the Triton interpreter in a child process
class TestKernelAgainstTorchPath:
    @pytest.mark.parametrize("index", range(len(CASES)))
    def test_loss_gradients_and_accuracy_match(self, interpreter_results, index) -> None:
        found = interpreter_results[index]
        tolerance = TOLERANCE[CASES[index][3]]
        assert found["loss"] < tolerance, found  # soft-capping: tanh as 2*sigmoid(2x)-1, ~4e-6
        for name in ("d_hidden", "d_weight"):
            assert math.isfinite(found[name]) and found[name] < tolerance, (name, found)
        assert found["hits"] == found["hits_ref"], found

    def test_cpu_tensors_keep_the_torch_path_by_default(self) -> None:
        import torch

        from trainer.kernels import cross_entropy

        assert not cross_entropy.available(torch.device("cpu"))


def _rel(a, b) -> float:
    import torch

    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp(min=1e-30))


def _run_cases() -> list[dict[str, float]]:
    """Child-process body: each case through both paths; relative errors and accuracy counts."""
    import torch

    from trainer.objectives import token_accuracy
    from trainer.features.loss.fused import fused_linear_cross_entropy
    from trainer.kernels import cross_entropy

    cross_entropy.BLOCK = 64  # several iterations per row even on these small vocabularies
    results = []
    for tokens, hidden, vocab, dtype_name, softcap, trainable, tensor_scale in CASES:
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(len(results))
        h = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
        w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype)
        labels = torch.randint(0, vocab, (tokens,), generator=g)
        labels[::5] = -100
        labels[1] = int((h[1].float() @ w.float().T).argmax())  # one sure hit
        num_items = torch.tensor(float((labels != -100).sum() + 3)) if tensor_scale else float((labels != -100).sum() + 3)
        runs = []
        for kernel in (False, True):
            hh = h.clone().requires_grad_()
            ww = w.clone().requires_grad_(trainable)
            count = token_accuracy.new_count(torch.device("cpu"))
            with token_accuracy.counting(count):
                loss = fused_linear_cross_entropy(
                    hh, ww, labels, num_items=num_items, chunk_size=16, softcap=softcap, kernel=kernel
                )
            loss.backward()
            runs.append((loss.detach(), hh.grad, ww.grad if trainable else torch.zeros(1), float(count)))
        (ref_loss, ref_dh, ref_dw, ref_hits), (loss, dh, dw, hits) = runs
        results.append({
            "loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
            "d_hidden": _rel(dh, ref_dh),
            "d_weight": _rel(dw, ref_dw) if trainable else 0.0,
            "hits": hits,
            "hits_ref": ref_hits,
        })
    return results


if __name__ == "__main__":
    print(json.dumps(_run_cases()))
