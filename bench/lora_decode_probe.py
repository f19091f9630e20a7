"""What the unmerged LoRA costs a decode step, and what fusing the projections that share an input would save.

Run on a GPU: ``python -m bench.lora_decode_probe [--rows 1 64 256]``. Nothing here is the product:
it times the matmuls of the Llama-3.1-8B shape's 32 decoder layers (bf16, LoRA r16 on q, k, v, o,
gate, up, down; distinct random weights per layer, so nothing stays in L2) captured in one CUDA
graph and replayed, at decode row counts, in three forms:

- ``base``: the seven base matmuls only (the floor: what a merged adapter would cost);
- ``served``: what a served model ran before session 18's groups (``trainer.features.lora_kernel.siblings``):
  one ``x @ A^T`` for q/k/v and one for gate/up, each projection's update written first
  (``xa @ sB^T``) and its base matmul accumulated onto it (the order then tried; the two orders
  measured the same on the whole sampler, and the product keeps the base matmul first);
- ``fused``: q/k/v as one ``[6144, 4096]`` base matmul and gate/up as one ``[28672, 4096]``, each
  with one block-diagonal ``sB`` expand over the stacked ``xa``.

Attention, norms and the rest of the layer are left out: only the matmuls differ between forms.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.sampler_profile import replay_time_ms

HIDDEN, INTER, HEADS_KV_DIM, RANK, LAYERS = 4096, 14336, 1024, 16, 32


def _layer(device: torch.device, g: torch.Generator) -> dict[str, torch.Tensor]:
    def w(out: int, inp: int) -> torch.Tensor:
        return (torch.randn(out, inp, generator=g, device=device) * inp**-0.5).to(torch.bfloat16)

    shapes = {"q": (HIDDEN, HIDDEN), "k": (HEADS_KV_DIM, HIDDEN), "v": (HEADS_KV_DIM, HIDDEN),
              "o": (HIDDEN, HIDDEN), "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
    layer = {}
    for name, (out, inp) in shapes.items():
        layer[name] = w(out, inp)
        layer[f"{name}.A"] = w(RANK, inp)
        layer[f"{name}.sB"] = w(out, RANK)
    layer["qkv.A"] = torch.cat([layer["q.A"], layer["k.A"], layer["v.A"]])
    layer["gu.A"] = torch.cat([layer["gate.A"], layer["up.A"]])
    layer["qkv"] = torch.cat([layer["q"], layer["k"], layer["v"]])
    layer["gu"] = torch.cat([layer["gate"], layer["up"]])
    layer["qkv.sB"] = torch.block_diag(layer["q.sB"], layer["k.sB"], layer["v.sB"])
    layer["gu.sB"] = torch.block_diag(layer["gate.sB"], layer["up.sB"])
    return layer


def _update_first(x: torch.Tensor, xa: torch.Tensor, w: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    return (xa @ sb.t()).addmm_(x, w.t())


def forms(layers: list[dict[str, torch.Tensor]], x: torch.Tensor, h: torch.Tensor, m: torch.Tensor) -> dict:
    """``form -> step()`` (x feeds q/k/v and gate/up, h feeds o, m feeds down)."""

    def base() -> None:
        for L in layers:
            for name, inp in (("q", x), ("k", x), ("v", x), ("o", h), ("gate", x), ("up", x), ("down", m)):
                inp @ L[name].t()

    def served() -> None:
        for L in layers:
            xa = (x @ L["qkv.A"].t()).split(RANK, dim=1)
            for i, name in enumerate(("q", "k", "v")):
                _update_first(x, xa[i], L[name], L[f"{name}.sB"])
            _update_first(h, h @ L["o.A"].t(), L["o"], L["o.sB"])
            xa = (x @ L["gu.A"].t()).split(RANK, dim=1)
            for i, name in enumerate(("gate", "up")):
                _update_first(x, xa[i], L[name], L[f"{name}.sB"])
            _update_first(m, m @ L["down.A"].t(), L["down"], L["down.sB"])

    def fused() -> None:
        for L in layers:
            _update_first(x, x @ L["qkv.A"].t(), L["qkv"], L["qkv.sB"])
            _update_first(h, h @ L["o.A"].t(), L["o"], L["o.sB"])
            _update_first(x, x @ L["gu.A"].t(), L["gu"], L["gu.sB"])
            _update_first(m, m @ L["down.A"].t(), L["down"], L["down.sB"])

    return {"base": base, "served": served, "fused": fused}


def time_graph(step, replays: int = 20) -> float:
    """ms per replay of ``step`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    return replay_time_ms(graph, replays)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 64, 256])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    layers = [_layer(device, g) for _ in range(LAYERS)]
    out = []
    for rows in args.rows:
        x, h = (torch.randn(rows, HIDDEN, generator=g, device=device).to(torch.bfloat16) for _ in range(2))
        m = torch.randn(rows, INTER, generator=g, device=device).to(torch.bfloat16)
        times = {name: time_graph(step) for name, step in forms(layers, x, h, m).items()}
        out.append({"rows": rows, **times})
        print(f"rows {rows:4d}: base {times['base']:.3f} ms, served {times['served']:.3f} ms "
              f"(LoRA +{times['served'] - times['base']:.3f}), fused {times['fused']:.3f} ms "
              f"(LoRA +{times['fused'] - times['base']:.3f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
