"""The sampler on CUDA against transformers' ``generate`` (``trainer.generate``).

fp32: tiny random-weight Llama, Qwen3 and GPT-OSS (sinks drawn non-zero, a sliding window of 8),
each without and with a LoRA adapter on every linear layer run through the trainer's fused LoRA
layers; eight prompts of 1 to 30 tokens through 3 slots (finished slots refilled from the queue,
``max_len`` cutting the long prompts). The greedy tokens must equal ``model.generate``'s, one prompt
at a time, and the logprobs agree within ``FP32_ATOL`` (the same fp32 ops in another order; on
CUDA the matmuls may pick other kernels than the reference's, so 1e-3 instead of the CPU test's
1e-4).

bf16 (what a tuned model serves in): greedy decoding in bf16 can flip between two logits that
bf16 cannot tell apart, so tokens are not compared one to one. Instead each completion is scored
by one plain forward of transformers over prompt + completion (teacher forcing, the reference's
own attention): every token the sampler picked must be within ``BF16_ARGMAX_SLACK`` of that
forward's best logprob at its position, and its logprob within ``BF16_ATOL`` of the forward's.
A wrong cache slot, position or mask shifts the logits by far more than that.

Those tests run the default backend (``auto``: ``triton`` on CUDA). The attention backends against
each other: ``attend_cached`` with ``triton`` (the decode kernel, SDPA prefill) against ``torch``
(the reference) on Llama-3.1-8B's and GPT-OSS's attention shapes (bf16, a batch of 64 decoding
sequences of mixed lengths up to 2,000 in shuffled slots, and batch 1 at 1,000 positions, which
splits the keys; ``KERNEL_BF16_ATOL``: the two round probabilities to bf16 at different points),
and the engine's fp32 greedy tokens with ``attention_backend="triton"`` equal to ``"torch"``'s.
CUDA graphs (``cuda_graphs=True``): the same requests through graphs and eagerly give identical
tokens and logprobs (the same kernels on the same inputs; padding rows touch only the scratch slot),
in fp32 and bf16, and the decode steps did replay graphs (GPT-OSS's fp32 MoE copies from the host
mid-forward, which a capture refuses: that engine says why and runs eagerly; Llama must replay).

Shared prompts (``trainer.generate.cache.SharedPrompts``, the GRPO rollouts' layout): bf16, graphs
on, three sampled (seeded) choices of each prompt give bitwise the unshared layout's tokens and
logprobs (the decode kernel runs the same key blocks on the same values; prefill is the same SDPA);
and on Llama-3.1-8B's attention shape, 64 decoding sequences in groups of 8 sharing a 256-token
prompt, the kernel's output on the shared layout is bitwise its output on the unshared one and
within ``KERNEL_BF16_ATOL`` of the torch backend's.

Prompts admitted together (``trainer.generate.prefill``: one varlen batch of the trainer's kernel per
layer, head dims 64 and 128): on the 8B and GPT-OSS attention shapes (window, sinks) a step of 16
decoding sequences and six prompts of 1 to 512 tokens against the torch backend within
``KERNEL_BF16_ATOL``; and tiny Llama, Qwen3 and GPT-OSS with head dim 64 in bf16 through 5 slots,
scored by the teacher-forced forward as above. What a served model runs (``trainer.generate.kernels``)
under CUDA graphs while the active adapter switches: each adapter's graphs, bitwise the eager engine.
Steps run ahead (``overlap``: a graphed decode step queued with the previous step's tokens still on
the device): the tokens of the same engine stepping one at a time (bf16 bitwise; fp32 with a stop id).
Served groups with one base matmul (q/k/v, gate/up; Llama, Qwen3, GPT-OSS): fp32 tokens of the
layers computed one by one.
"""

from __future__ import annotations

import pytest
import torch

from trainer.features.lora_kernel import fused as lora_fused
from trainer.generate.attention import StepState, attend_cached
from trainer.generate.cache import KVCache, SharedPrompts
from trainer.generate.engine import Engine
from trainer.generate.params import Request, SamplingParams

from tests.fixtures.sampler_models import TEXTS, sampler_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

SLOTS, MAX_LEN, MAX_TOKENS = 3, 36, 12
FP32_ATOL = 1e-3
BF16_ATOL = 0.1
BF16_ARGMAX_SLACK = 0.1
KERNEL_BF16_ATOL = 2e-2


def _model(arch: str, lora: bool, dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
    return sampler_model(arch, lora, dtype, "cuda")

def _sample(model: torch.nn.Module, tokenizer: object, prompts: list[list[int]], lora: bool,
            backend: str = "auto", graphs: bool = False, engines: list | None = None) -> list:
    installed = lora_fused.install(model) if lora else None
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True, top_logprobs=1)
        engine = Engine(model, tokenizer, slots=SLOTS, max_len=MAX_LEN, attention_backend=backend,
                        cuda_graphs=graphs)
        results = engine.generate([Request(tuple(p), params) for p in prompts])
    finally:
        if installed is not None:
            installed.uninstall()
    assert engine.device.type == "cuda" and engine.stats.caches_allocated == 1
    if engines is not None:
        engines.append(engine)
    return [r.completions[0] for r in results]


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_fp32_greedy_decoding_on_cuda_matches_transformers_generate(arch: str, lora: bool) -> None:
    model, tokenizer = _model(arch, lora, torch.float32)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    completions = _sample(model, tokenizer, prompts, lora)
    eos = tokenizer.eos_token_id
    for prompt, completion in zip(prompts, completions):
        new = min(MAX_TOKENS, MAX_LEN - len(prompt))
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt], device="cuda"), do_sample=False,
                                 max_new_tokens=new, return_dict_in_generate=True, output_logits=True)
        want = out.sequences[0, len(prompt):].tolist()
        if want[-1:] == [eos]:
            want = want[:-1]
        assert completion.token_ids == want, prompt
        for step, logprob in enumerate(completion.logprobs):
            ref = torch.log_softmax(out.logits[step][0].float(), dim=-1)[logprob.token_id].item()
            assert logprob.logprob == pytest.approx(ref, abs=FP32_ATOL)


def _assert_the_teacher_forced_forwards_best(model: torch.nn.Module, prompts: list[list[int]],
                                             completions: list) -> None:
    """Each picked token within ``BF16_ARGMAX_SLACK`` of one plain forward's best logprob at its
    position (prompt + completion, teacher forcing), its logprob within ``BF16_ATOL`` of that forward's."""
    for prompt, completion in zip(prompts, completions):
        if not completion.token_ids:
            continue
        ids = torch.tensor([prompt + completion.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1: ids.shape[1] - 1]
        for step, (token, picked) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert logprobs[step, token].item() >= logprobs[step].max().item() - BF16_ARGMAX_SLACK, (prompt, step)
            assert picked.logprob == pytest.approx(logprobs[step, token].item(), abs=BF16_ATOL), (prompt, step)


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_greedy_tokens_are_the_teacher_forced_forwards_best(arch: str, lora: bool) -> None:
    model, tokenizer = _model(arch, lora, torch.bfloat16)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    completions = _sample(model, tokenizer, prompts, lora)
    assert sum(len(c.token_ids) for c in completions) > 40
    _assert_the_teacher_forced_forwards_best(model, prompts, completions)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_bf16_prompts_admitted_together_score_as_the_teacher_forced_forward(arch: str, monkeypatch) -> None:
    """Head dim 64 and 5 slots: the prompts a step admits run as one batch of the trainer's varlen
    kernel (GPT-OSS: its window and sinks in it); each token is the teacher-forced forward's best
    within the slack, its logprob within ``BF16_ATOL``."""
    from trainer.kernels import attention as varlen

    model, tokenizer = sampler_model(arch, True, torch.bfloat16, "cuda", head_dim=64)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    batches, original = [], varlen.flash_varlen_attention
    monkeypatch.setattr(varlen, "flash_varlen_attention",
                        lambda *a, **k: batches.append(a[3].numel() - 1) or original(*a, **k))
    installed = lora_fused.install(model)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True)
        engine = Engine(model, tokenizer, slots=5, max_len=MAX_LEN, cuda_graphs=arch != "gpt_oss")
        completions = [r.completions[0] for r in engine.generate([Request(tuple(p), params) for p in prompts])]
    finally:
        installed.uninstall()
    assert max(batches) >= 3 and sum(len(c.token_ids) for c in completions) > 40
    _assert_the_teacher_forced_forwards_best(model, prompts, completions)


@pytest.mark.parametrize(
    ("heads_q", "heads_kv", "head_dim", "window", "sinks", "lengths"),
    [
        (32, 8, 128, None, False, "batch64"),
        (32, 8, 128, None, False, "single1000"),
        (64, 8, 64, 128, True, "batch64"),
        (64, 8, 64, None, True, "single1000"),
        (32, 8, 128, None, False, "prompts"),
        (64, 8, 64, 128, True, "prompts"),
    ],
    ids=["llama8b-batch64", "llama8b-batch1-split", "gpt_oss-window-sinks", "gpt_oss-batch1-split",
         "llama8b-prompts-batched", "gpt_oss-prompts-batched-window-sinks"],
)
def test_triton_backend_matches_torch_backend_on_realistic_shapes(heads_q, heads_kv, head_dim, window, sinks,
                                                                  lengths) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    slots = 72
    cache = KVCache(layers=1, slots=slots, kv_heads=heads_kv, max_len=2048, head_dim=head_dim,
                    dtype=torch.bfloat16, device="cuda")
    cache.keys_SHLD[0].normal_(generator=g)
    cache.values_SHLD[0].normal_(generator=g)
    if lengths == "batch64":
        order = torch.randperm(slots, generator=g, device="cuda").tolist()
        starts = torch.randint(0, 2000, (64,), generator=g, device="cuda").tolist()
        segments = [(slot, start, 1) for slot, start in zip(order, starts)] + [(order[64], 0, 300)]
    elif lengths == "prompts":  # 16 decoding, then prompts admitted together: one varlen batch
        order = torch.randperm(slots, generator=g, device="cuda").tolist()
        starts = torch.randint(0, 2000, (16,), generator=g, device="cuda").tolist()
        segments = [(slot, start, 1) for slot, start in zip(order, starts)]
        segments += [(slot, 0, count) for slot, count in zip(order[16:], (300, 1, 77, 512, 2, 129))]
    else:
        segments = [(5, 999, 1)]
    tokens = sum(count for _, _, count in segments)
    query, key, value = (torch.randn(tokens, h, head_dim, generator=g, device="cuda").to(torch.bfloat16)
                         for h in (heads_q, heads_kv, heads_kv))
    sink = torch.randn(heads_q, generator=g, device="cuda").to(torch.bfloat16) * 2 if sinks else None
    outs = []
    for backend in ("torch", "triton"):
        state = StepState.build(cache, segments, torch.device("cuda"), backend)
        assert (state.prefill is not None) == (backend == "triton" and lengths == "prompts")
        cache.write(0, state.slot_T, state.position_T, key, value)
        outs.append(attend_cached(state, 0, query, key, value, head_dim**-0.5, window, sink, None).float())
    assert (outs[0] - outs[1]).abs().max().item() < KERNEL_BF16_ATOL


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_fp32_greedy_tokens_of_the_triton_backend_equal_the_torch_backends(arch: str) -> None:
    model, tokenizer = _model(arch, True, torch.float32)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    reference = _sample(model, tokenizer, prompts, True, backend="torch")
    found = _sample(model, tokenizer, prompts, True, backend="triton")
    for want, got in zip(reference, found):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=FP32_ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_cuda_graph_decoding_gives_the_eager_tokens(arch: str, dtype: torch.dtype) -> None:
    model, tokenizer = _model(arch, True, dtype)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    eager = _sample(model, tokenizer, prompts, True, backend="triton")
    engines: list = []
    graphed = _sample(model, tokenizer, prompts, True, backend="triton", graphs=True, engines=engines)
    stats, disabled = engines[0].stats, engines[0].graphs.disabled
    assert (stats.graph_replays > 0 and disabled is None) or (arch == "gpt_oss" and "captured" in disabled)
    for want, got in zip(eager, graphed):
        assert got.token_ids == want.token_ids
        assert [a.logprob for a in got.logprobs] == [b.logprob for b in want.logprobs]


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_bf16_shared_prompts_with_cuda_graphs_give_the_unshared_tokens(arch: str) -> None:
    model, tokenizer = _model(arch, True, torch.bfloat16)
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, n=3, logprobs=True)
    installed = lora_fused.install(model)
    runs, engines = [], []
    try:
        for shared in (None, SharedPrompts(slots=8, prompt_len=max(map(len, prompts)), new_len=MAX_LEN)):
            engine = Engine(model, tokenizer, slots=8, max_len=MAX_LEN, attention_backend="triton", cuda_graphs=True,
                            shared_prompts=shared)
            results = engine.generate([Request(tuple(p), params) for p in prompts])
            runs.append([(c.token_ids, [t.logprob for t in c.logprobs]) for r in results for c in r.completions])
            engines.append(engine)
    finally:
        installed.uninstall()
    shared_engine = engines[1]
    assert shared_engine.cache.prompt_keys_PHLD and sum(len(t) for t, _ in runs[1]) > 100
    graphs = shared_engine.graphs
    assert (shared_engine.stats.graph_replays > 0 and graphs.disabled is None) or (
        arch == "gpt_oss" and "captured" in graphs.disabled)
    assert runs[1] == runs[0]


def test_the_kernel_on_shared_prompts_at_the_8b_shape_is_bitwise_its_unshared_output() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    heads_q, heads_kv, head_dim, prompt_len = 32, 8, 128, 256
    cache = KVCache(layers=1, slots=64, kv_heads=heads_kv, max_len=768, head_dim=head_dim, dtype=torch.bfloat16,
                    device="cuda")
    cache.keys_SHLD[0].normal_(generator=g)
    cache.values_SHLD[0].normal_(generator=g)
    shared = KVCache(1, 64, heads_kv, 512, head_dim, torch.bfloat16, "cuda", SharedPrompts(8, prompt_len, 512))
    for own, prompt, source in ((shared.keys_SHLD[0], shared.prompt_keys_PHLD[0], cache.keys_SHLD[0]),
                                (shared.values_SHLD[0], shared.prompt_values_PHLD[0], cache.values_SHLD[0])):
        source.view(8, 8, heads_kv, 768, head_dim)[:, 1:, :, :prompt_len] = source.view(
            8, 8, heads_kv, 768, head_dim)[:, :1, :, :prompt_len]  # each group of 8 continues one prompt
        prompt.copy_(source[::8, :, :prompt_len])
        own.copy_(source[:, :, prompt_len:])
    positions = torch.randint(prompt_len, 767, (64,), generator=g, device="cuda").tolist()
    segments = [(slot, position, 1) for slot, position in enumerate(positions)]
    query, key, value = (torch.randn(64, h, head_dim, generator=g, device="cuda").to(torch.bfloat16)
                         for h in (heads_q, heads_kv, heads_kv))
    outs = []
    for source, prompts, backend in ((cache, None, "triton"), (shared, [(s // 8, prompt_len) for s in range(64)],
                                                                "triton"), (cache, None, "torch")):
        state = StepState.build(source, segments, torch.device("cuda"), backend, prompts)
        state.write(0, key, value)
        outs.append(attend_cached(state, 0, query, key, value, head_dim**-0.5, None, None, None).float())
    assert torch.equal(outs[0], outs[1])
    assert (outs[1] - outs[2]).abs().max().item() < KERNEL_BF16_ATOL


def test_served_kernels_with_graphs_replay_each_active_adapters_own_graph() -> None:
    """``trainer.generate.kernels`` (fused LoRA with kept bf16 adapter copies, fused RMSNorm, SwiGLU,
    RoPE) under CUDA graphs, head dim 64: switching the active adapter and back replays each
    adapter's own graphs (keyed by adapter) over its own kept copies, bitwise the eager engine's
    tokens and logprobs on the same kernels, and the two adapters' completions differ."""
    import peft

    from trainer.generate import kernels

    model, tokenizer = sampler_model("llama", True, torch.bfloat16, "cuda", head_dim=64)
    torch.manual_seed(2)
    model.add_adapter("second", peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                init_lora_weights=False))
    model.to(device="cuda", dtype=torch.bfloat16)
    prompts = [tuple(tokenizer(text)["input_ids"]) for text in TEXTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True)
    installed = kernels.install(model)
    runs: dict[tuple[str, bool], list] = {}
    try:
        graphed = Engine(model, tokenizer, slots=2, max_len=MAX_LEN, cuda_graphs=True)  # buckets 1, 2: no padding
        eager = Engine(model, tokenizer, slots=2, max_len=MAX_LEN, cuda_graphs=False)
        for adapter in ("default", "second", "default"):
            model.set_adapter(adapter)
            for engine in (graphed, eager):
                got = [(c.token_ids, [t.logprob for t in c.logprobs]) for r in
                       engine.generate([Request(p, params, adapter=adapter) for p in prompts]) for c in r.completions]
                key = (adapter, engine is graphed)
                assert runs.setdefault(key, got) == got, key  # the second "default" pass replays the first's graphs
    finally:
        installed.uninstall()
    assert graphed.stats.graph_replays > 0 and graphed.graphs.disabled is None
    assert {a for _, a in graphed.graphs._graphs} == {"default", "second"}
    for adapter in ("default", "second"):
        assert runs[adapter, True] == runs[adapter, False]
    assert runs["default", True] != runs["second", True]


@pytest.mark.parametrize("dtype,stop,slots", [(torch.bfloat16, False, 8), (torch.float32, True, SLOTS)],
                         ids=["bf16-lengths", "fp32-stop-id-backlog"])
def test_graphed_steps_run_ahead_give_the_tokens_of_steps_run_one_at_a_time(dtype: torch.dtype, stop: bool,
                                                                            slots: int) -> None:
    """``overlap`` (``trainer.generate.overlap``) on graphs: each decode step's forward is queued with
    the previous step's tokens still on the device. Greedy and seeded sampled requests with lengths
    ending at different steps. bf16, every request in a slot at once: bitwise the tokens of the
    same engine without overlap (the same graphs on the same inputs: a sequence ending on its
    length leaves the step queued ahead). fp32, more requests than slots (run ahead while prompts
    wait for a slot; a freed slot is refilled a step later, so the batches differ) and a stop id
    that ends one completion mid-run (the step queued ahead carries its row for nothing): the
    same tokens."""
    model, tokenizer = _model("llama", True, dtype)
    prompts = [tuple(tokenizer(text)["input_ids"]) for text in TEXTS]
    params = [SamplingParams(max_tokens=MAX_TOKENS - i % 4, temperature=0.0 if i % 2 else 0.9, top_p=0.95,
                             seed=i, ignore_eos=True) for i in range(len(prompts))]
    installed = lora_fused.install(model)
    runs, engines = [], []
    try:
        if stop:  # a token of the first completion, from its third on, not drawn before, becomes its stop id
            free = Engine(model, tokenizer, slots=slots, max_len=MAX_LEN, cuda_graphs=True, overlap=False)
            first = free.generate([Request(p, q) for p, q in zip(prompts, params)])[0].completions[0].token_ids
            cut = next(i for i in range(2, len(first) - 1) if first[i] not in first[:i])
            params[0] = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=0, ignore_eos=True,
                                       stop_token_ids=((first[cut],),))
        for overlap in (False, True):
            engine = Engine(model, tokenizer, slots=slots, max_len=MAX_LEN, cuda_graphs=True, overlap=overlap)
            results = engine.generate([Request(p, q) for p, q in zip(prompts, params)])
            runs.append([(c.token_ids, c.finish_reason) for r in results for c in r.completions])
            engines.append(engine)
    finally:
        installed.uninstall()
    plain, ahead = engines
    assert ahead.stats.overlapped_steps > 0 and ahead.stats.graph_replays > 0 and ahead.graphs.disabled is None
    assert plain.stats.overlapped_steps == 0
    assert runs[1] == runs[0]
    if stop:
        assert runs[0][0] == (first[:cut], "stop")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
def test_served_groups_with_one_base_matmul_give_the_per_layer_tokens(arch: str) -> None:
    """``trainer.generate.kernels`` puts q/k/v's and gate/up's base weights into one matrix per
    group (one base matmul, one block-diagonal update; Qwen3's head norms and SwiGLU read the
    group's output in place, GPT-OSS's biases are concatenated). fp32 on CUDA with graphs: the
    greedy tokens of the fused LoRA layers computed one by one, logprobs within ``FP32_ATOL``."""
    from trainer.features.lora_kernel import siblings
    from trainer.generate import kernels

    model, tokenizer = _model(arch, True, torch.float32)
    prompts = [tuple(tokenizer(text)["input_ids"]) for text in TEXTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True)
    runs = []
    for fused in (False, True):
        installed = kernels.install(model)
        try:
            if not fused:
                siblings.ungroup(lora_fused.lora_linear_layers(model))
            else:
                assert "0 with their base weights" not in installed.describe()
            engine = Engine(model, tokenizer, slots=SLOTS, max_len=MAX_LEN, cuda_graphs=True)
            runs.append([r.completions[0] for r in engine.generate([Request(p, params) for p in prompts])])
        finally:
            installed.uninstall()
    for want, got in zip(*runs):
        assert got.token_ids == want.token_ids
        assert [t.logprob for t in got.logprobs] == pytest.approx([t.logprob for t in want.logprobs], abs=FP32_ATOL)
