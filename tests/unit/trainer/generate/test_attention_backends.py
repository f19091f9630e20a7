"""The sampler's attention backends (``trainer.generate.attention``): which one runs, and the
engine's greedy tokens on ``triton`` equal to ``torch``'s.

The engine test runs the ``triton`` backend on CPU under Triton's interpreter (``TRITON_INTERPRET=1``
in a child process: the interpreter is chosen when kernels are decorated, at import): tiny
random-weight Llama (GQA) and GPT-OSS (a window of 8 on one layer, sinks drawn non-zero), with a
LoRA adapter, eight prompts through 3 slots. The prompts from position 0 run SDPA (Llama) or the
torch path (GPT-OSS's sinks), the decoding steps the kernel. With head dim 64 and 5 slots, the
prompts a step admits together run as one batch of the trainer's varlen kernel (window and sinks
included) and must give the torch backend's tokens. fp32: the tokens must be equal and
the logprobs within ``LOGPROB_ATOL`` (the same fp32 values summed in another order). With shared
prompts (``trainer.generate.cache.SharedPrompts``; two sampled, seeded choices of four prompts) the kernel's
tokens and logprobs are bitwise those of the unshared layout (it runs the same key blocks). CUDA graphs
(``trainer.generate.graphs.DecodeGraphs``) need a GPU to run (tests/gpu/test_sampler_gpu.py); here only their
buckets, the steps they take and the refusal without the triton backend.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.fixtures.interpreter import interpreter_results as run_in_interpreter
import torch

from trainer.generate.attention import choose_backend
from trainer.generate.engine import BACKEND_ENV, Engine
from trainer.generate.graphs import DecodeGraphs
from trainer.generate.scheduler import StepPlan

HAS_TRITON = importlib.util.find_spec("triton") is not None
LOGPROB_ATOL = 1e-4
ARCHS = ("llama", "gpt_oss")


class TestChooseBackend:
    def test_auto_is_torch_on_the_cpu(self, monkeypatch) -> None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert choose_backend("auto", torch.device("cpu")) == "torch"
        assert choose_backend("torch", torch.device("cpu")) == "torch"

    def test_triton_where_it_cannot_run_says_why(self, monkeypatch) -> None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="triton cannot run"):
            choose_backend("triton", torch.device("cpu"))

    def test_an_unknown_name_is_refused(self) -> None:
        with pytest.raises(ValueError, match="not one of auto, torch, triton"):
            choose_backend("flash", torch.device("cpu"))

    def test_the_environment_variable_names_the_engines_backend(self, monkeypatch) -> None:
        from tests.fixtures.sampler_models import sampler_model

        model, tokenizer = sampler_model("llama", False)
        monkeypatch.setenv(BACKEND_ENV, "torch")
        assert Engine(model, tokenizer).backend == "torch"
        monkeypatch.setenv(BACKEND_ENV, "flash")
        with pytest.raises(ValueError, match="flash"):
            Engine(model, tokenizer)
        assert Engine(model, tokenizer, attention_backend="auto").backend == "torch"


class TestDecodeGraphs:
    def test_cuda_graphs_need_the_triton_backend(self) -> None:
        from tests.fixtures.sampler_models import sampler_model

        model, tokenizer = sampler_model("llama", False)
        with pytest.raises(ValueError, match="cuda_graphs needs the triton attention backend"):
            Engine(model, tokenizer, cuda_graphs=True)

    def test_buckets_cover_every_batch_up_to_the_slots(self) -> None:
        assert DecodeGraphs(3).buckets == [1, 2, 3]
        assert DecodeGraphs(100).buckets == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
        assert DecodeGraphs(400).buckets[-4:] == [256, 320, 384, 400]

    def test_only_decode_only_steps_replay(self) -> None:
        graphs = DecodeGraphs(4)
        decode = StepPlan(input_ids=[5, 6], segments=[(0, 3, 1), (2, 7, 1)], keep=[0, 1], pick=[0, 1])
        assert graphs.takes(decode)
        assert not graphs.takes(StepPlan(input_ids=[5, 6, 7], segments=[(0, 3, 1), (1, 0, 2)], keep=[0, 2]))
        assert not graphs.takes(StepPlan(input_ids=[5], segments=[(0, 3, 1)], keep=[0], forks=[(0, [1], 3)]))


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict]:
    return run_in_interpreter(__file__, unset=(BACKEND_ENV,))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.slow  # the Triton interpreter in a child process
class TestTritonBackendUnderTheInterpreter:
    @pytest.mark.parametrize("arch", ARCHS)
    def test_greedy_tokens_equal_the_torch_backends(self, interpreter_results, arch: str) -> None:
        found = interpreter_results[arch]
        assert found["backends"] == ["torch", "triton"]
        assert found["kernel_calls"] > 0
        assert found["tokens"][0] == found["tokens"][1]
        assert sum(map(len, found["tokens"][0])) > 40
        assert found["logprob_diff"] < LOGPROB_ATOL

    @pytest.mark.parametrize("arch", ARCHS)
    def test_prompts_admitted_together_run_as_one_varlen_batch_and_give_the_torch_backends_tokens(
            self, interpreter_results, arch: str) -> None:
        found = interpreter_results[arch]["prefill"]
        # the first step admits the first 5 prompts in one batch ("A", one token, a sample of one)
        assert found["prompts_per_call"][:2] == [5, 5]
        assert found["tokens"][0] == found["tokens"][1]
        assert found["logprob_diff"] < LOGPROB_ATOL

    @pytest.mark.parametrize("arch", ARCHS)
    def test_shared_prompts_give_the_unshared_tokens_and_logprobs_exactly(self, interpreter_results, arch) -> None:
        found = interpreter_results[arch]["shared"]
        assert found["kernel_read_prompts"] > 0 and sum(map(len, found["tokens"][0])) > 40
        assert found["tokens"][0] == found["tokens"][1] and found["logprobs"][0] == found["logprobs"][1]


def _run_prefill(arch: str) -> dict:
    """Child-process body: eight prompts through 5 slots (steps admitting several prompts at once),
    the triton backend (its prompts in one varlen call per layer) beside the torch backend."""
    from tests.fixtures.sampler_models import TEXTS, sampler_model
    from trainer.generate.params import Request, SamplingParams
    from trainer.kernels import attention as varlen

    torch.set_num_threads(1)
    model, tokenizer = sampler_model(arch, True, head_dim=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True)
    requests = [Request(tuple(tokenizer(text)["input_ids"]), params) for text in TEXTS]
    calls, original = [], varlen.flash_varlen_attention
    varlen.flash_varlen_attention = lambda *a, **k: calls.append(len(a[3]) - 1) or original(*a, **k)
    runs = []
    for backend in ("torch", "triton"):
        engine = Engine(model, tokenizer, slots=5, max_len=40, attention_backend=backend)
        runs.append([r.completions[0] for r in engine.generate(requests)])
    varlen.flash_varlen_attention = original
    diff = max(abs(a.logprob - b.logprob) for x, y in zip(*runs) for a, b in zip(x.logprobs, y.logprobs))
    return {"prompts_per_call": calls, "logprob_diff": diff, "tokens": [[c.token_ids for c in run] for run in runs]}


def _run_arch(arch: str) -> dict:
    """Child-process body for one model: the same requests through both backends."""
    from tests.fixtures.sampler_models import TEXTS, sampler_model
    from trainer.generate.params import Request, SamplingParams
    from trainer.kernels import decode_attention

    torch.set_num_threads(1)
    model, tokenizer = sampler_model(arch, True)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True)
    requests = [Request(tuple(tokenizer(text)["input_ids"]), params) for text in TEXTS]
    calls, original = [], decode_attention.decode_attention
    decode_attention.decode_attention = lambda *a, **k: calls.append(1) or original(*a, **k)
    runs, backends = [], []
    for backend in ("torch", "triton"):
        engine = Engine(model, tokenizer, slots=3, max_len=36, attention_backend=backend)
        backends.append(engine.backend)
        runs.append([r.completions[0] for r in engine.generate(requests)])
    decode_attention.decode_attention = original
    diff = max(abs(a.logprob - b.logprob) for x, y in zip(*runs) for a, b in zip(x.logprobs, y.logprobs))
    return {"backends": backends, "kernel_calls": len(calls), "logprob_diff": diff,
            "tokens": [[c.token_ids for c in run] for run in runs]}


def _run_shared(arch: str) -> dict:
    """Child-process body: two seeded choices a prompt through the triton backend, unshared and shared."""
    from tests.fixtures.sampler_models import TEXTS, sampler_model
    from trainer.generate.cache import SharedPrompts
    from trainer.generate.params import Request, SamplingParams
    from trainer.kernels import decode_attention

    model, tokenizer = sampler_model(arch, True)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=2, logprobs=True)
    requests = [Request(tuple(tokenizer(text)["input_ids"]), params) for text in TEXTS[:4]]
    calls, original = [], decode_attention.decode_attention
    decode_attention.decode_attention = lambda *a, **k: calls.append(k["prompt"] is not None) or original(*a, **k)
    runs = []
    for shared in (None, SharedPrompts(4, 30, 36)):
        engine = Engine(model, tokenizer, slots=4, max_len=36, attention_backend="triton", shared_prompts=shared)
        runs.append([c for r in engine.generate(requests) for c in r.completions])
    decode_attention.decode_attention = original
    return {"kernel_read_prompts": sum(calls), "tokens": [[c.token_ids for c in run] for run in runs],
            "logprobs": [[[t.logprob for t in c.logprobs] for c in run] for run in runs]}


if __name__ == "__main__":
    print(json.dumps({arch: _run_arch(arch) | {"shared": _run_shared(arch), "prefill": _run_prefill(arch)}
                      for arch in ARCHS}))
