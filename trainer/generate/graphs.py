"""CUDA graphs of the sampler's decode step (``Engine(cuda_graphs=...)``).

A decode-only step (one token per sequence, logits for each, no fork) of a given batch size runs
the same kernels every time, only on other values: capturing it once per batch-size bucket and
replaying it removes the host's ~1,300 kernel launches a step (a small model's step is
launch-bound without). See ``DecodeGraphs``.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.generate.attention import Group, StepState, Writes
from trainer.generate.cache import KVCache
from trainer.generate.scheduler import StepPlan


GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
"""Decode batch sizes a graph is captured for (then multiples of 64): a step pads to the next one."""


class DecodeGraphs:
    """CUDA graphs of the decode-only forward, one per batch-size bucket, captured on first use.

    A graph's inputs are static tensors (token ids, slots, positions, lengths of ``bucket``
    sequences; with ``shared`` prompts also their prompt slots, prompt lengths and positions in
    their own slots); a step copies its values in with one host-to-device copy and replays. Padding
    rows decode at position 0 of the scratch slot ``slots`` (the cache's last), whose contents
    nobody reads (with no prompt: prompt length 0). The decode kernel's split count is sized for
    the cache's ``max_len`` so the captured launch fits every step. All graphs share one memory
    pool; a reallocated cache drops them (``reset``). A model whose forward cannot be captured (it copies from the host
    mid-forward, as GPT-OSS's fp32 MoE path does) runs eagerly from then on; ``disabled`` says why.
    """

    def __init__(self, slots: int, shared: bool = False) -> None:
        self.slots, self.shared = slots, shared
        larger = range(GRAPH_BUCKETS[-1] + 64, slots, 64)
        self.buckets = sorted({b for b in (*GRAPH_BUCKETS, *larger) if b < slots} | {slots})
        self._graphs: dict[tuple[int, str | None], tuple[Any, torch.Tensor, torch.Tensor, StepState]] = {}
        self._pool: Any = None
        self.disabled: str | None = None

    def reset(self) -> None:
        self._graphs.clear()

    def takes(self, plan: StepPlan) -> bool:
        """Whether ``plan`` is a decode-only step (one token per sequence, logits for each, no fork;
        shared prompts: no prompt token either, i.e. no one-token prompt's prefill)."""
        in_prompt = any(p < length for (_, p, _), (_, length) in zip(plan.segments, plan.prompts))
        return (self.disabled is None and not plan.forks and all(count == 1 for _, _, count in plan.segments)
                and plan.keep == list(range(len(plan.segments))) and not in_prompt)

    def run(self, model: torch.nn.Module, cache: KVCache, plan: StepPlan,
            adapter: str | None = None, ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's logits [B, V] from the graph of the bucket and the model's active ``adapter``
        (captured first if new: a graph replays the adapter it was captured with); None when the
        capture failed (the step is then the caller's to run eagerly).

        ``ids``: the rows' token ids already on the device (``trainer.generate.overlap``: the
        previous step's draws, not yet read back), in place of ``plan.input_ids``. The inputs go
        from pinned host memory without blocking, so the host never waits for the GPU here."""
        count = len(plan.segments)
        bucket = next(b for b in self.buckets if b >= count)
        pad = bucket - count
        slots = [s for s, _, _ in plan.segments] + [self.slots] * pad
        positions = [p for _, p, _ in plan.segments] + [0] * pad
        lengths = [p + 1 for p in positions]
        rows = [list(plan.input_ids) + [0] * pad, slots, positions, lengths]
        if self.shared:
            prompts = plan.prompts + [(0, 0)] * pad
            rows += [[s for s, _ in prompts], [n for _, n in prompts], [p - n for p, (_, n) in zip(positions, prompts)]]
        host = torch.tensor(rows, dtype=torch.long, pin_memory=True)
        entry = self._graphs.get((bucket, adapter))
        if entry is None:
            try:
                entry = self._capture(model, cache, (bucket, adapter), host)
            except RuntimeError as error:
                self.disabled = f"the decode forward cannot be captured in a CUDA graph: {error}"
                return None
        graph, inputs_IB, logits_BV, _ = entry
        inputs_IB.copy_(host, non_blocking=True)
        if ids is not None:
            inputs_IB[0, :count].copy_(ids)
        graph.replay()
        return logits_BV[:count]

    def _capture(self, model: torch.nn.Module, cache: KVCache, key: tuple[int, str | None], host: torch.Tensor) -> tuple:
        """Warm the forward up on a side stream, then capture it on ``host``'s values (ids, slots,
        positions, lengths of ``bucket`` rows; shared: prompt slots, prompt lengths, own positions)
        copied to static device tensors."""
        bucket = key[0]
        device = cache.keys_SHLD[0].device
        inputs_IB = host.to(device)
        ids_B, slots_B, positions_B, lengths_B, *shared_3B = inputs_IB.unbind(0)
        prompt_slots_B, prompt_lens_B, own_B = shared_3B or (None, None, None)
        group = Group(torch.arange(bucket, device=device), slots_B, positions_B.view(bucket, 1),
                      (bucket, 1), cache.max_len, lengths_B, prompt_slots_B, prompt_lens_B)
        own = Writes(None, slots_B, own_B) if self.shared else None
        state = StepState(cache, slots_B, positions_B, (group,), "triton", own)

        def forward() -> torch.Tensor:
            return model(input_ids=ids_B.unsqueeze(0), position_ids=positions_B.unsqueeze(0),
                         use_cache=False, logits_to_keep=0, sampler_state=state).logits[0]

        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            forward()  # warm-up: Triton compiles, cuBLAS picks; writes the same keys the replay will
        torch.cuda.current_stream(device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits_BV = forward()
        # The state is kept with the graph: the replay reads its tensors (rows) at their addresses.
        self._graphs[key] = (graph, inputs_IB, logits_BV, state)
        return self._graphs[key]
