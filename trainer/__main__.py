"""``python -m trainer``: ``run JOB.json`` | ``generate JOB.json`` | ``serve SESSION.json`` (``trainer.generate.cli``) | ``eval JOB.json`` (``trainer.evals.cli``) | ``detect [--json] [--job JOB.json] [--measure-peak]`` | ``make-tiny-model DIR``
| ``export JOB.json --format merged|gguf --out DIR`` (``trainer.export.cli``).

``run`` writes one JSON event per line to stdout (library prints are sent to stderr so the event
stream stays clean) and exits 0 when the run succeeded or was cancelled, 1 when it failed; a
failure always ends with a ``done`` event carrying an error code and message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from trainer.export import cli as export_cli
from trainer.evals import cli as eval_cli
from trainer.generate import cli as generate_cli
from trainer.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from trainer.events import Emitter


CLIS = {"export": export_cli, "generate": generate_cli, "eval": eval_cli}
"""Subcommands whose parser and ``main`` live in their package (``generate_cli`` adds ``serve`` too)."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        return _run(args.job)
    if args.command == "serve":
        return generate_cli.serve_main(args)
    if args.command in CLIS:
        return CLIS[args.command].main(args)
    if args.command == "detect":
        from trainer.errors import TrainerError

        try:
            if args.measure_peak:
                from trainer.plan.hardware import remeasure_peak

                peak, source = remeasure_peak()
                rate = f"{peak / 1e12:.0f} TFLOP/s bf16 ({source})" if peak else "could not be measured"
                print(f"peak: {rate}", file=sys.stderr)
            return _detect(args.json, args.job, args.device)
        except (TrainerError, ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    from trainer.model.tiny import make_tiny_model

    print(
        make_tiny_model(args.dir, args.arch, seed=args.seed, vocab_size=args.vocab_size)
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="train as a job.json says, emitting JSON-lines events")
    p_run.add_argument("job", help="path to job.json (trainer.config.TrainConfig)")
    p_detect = sub.add_parser(
        "detect", help="print the detected hardware and the optimization plan"
    )
    p_detect.add_argument(
        "--json", action="store_true", help="one JSON object instead of text"
    )
    p_detect.add_argument(
        "--job", help="plan for this job.json instead of default settings"
    )
    p_detect.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p_detect.add_argument(
        "--measure-peak",
        action="store_true",
        help="measure the GPU's bf16 matmul peak (MFU's denominator) again and overwrite its cache file",
    )
    p_tiny = sub.add_parser(
        "make-tiny-model", help="write a tiny random-weight model + tokenizer to DIR"
    )
    p_tiny.add_argument("dir")
    p_tiny.add_argument(
        "--arch",
        default="llama",
        choices=("llama", "qwen3", "mistral", "gemma", "gpt_oss", "qwen3_moe"),
    )
    p_tiny.add_argument("--seed", type=int, default=0)
    p_tiny.add_argument("--vocab-size", type=int, default=512)
    for cli in CLIS.values():
        cli.add_parser(sub)
    return parser


def _run(job_path: str) -> int:
    # Packed batches change shape every step; expandable segments keep the CUDA caching allocator
    # from fragmenting (reserved memory grew to ~3x the peak without it on a 0.6B model, H200).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    emit = Emitter(sys.stdout)
    sys.stdout = sys.stderr  # anything a library prints must not interleave with events
    try:
        config = TrainConfig.load(job_path)
    except (OSError, ValueError, TypeError) as exc:
        emit(
            "done",
            status="failed",
            error_code="config_error",
            message=f"{job_path}: {exc}",
            adapter_path=None,
            steps=0,
        )
        return 1
    from trainer.model.imports import skip_bitsandbytes

    skip_bitsandbytes(quantized=config.method == "qlora")  # before anything imports peft
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    import trainer

    result = trainer.run(config, emit)
    return 1 if result.status == "failed" else 0


def _detect(as_json: bool, job_path: str | None, device: str) -> int:
    from trainer.plan import hardware, planner as planning

    if job_path:
        from trainer.model.load import model_facts

        config = TrainConfig.load(job_path)
        facts = model_facts(config)
    else:
        config = TrainConfig(
            model=ModelConfig("(any)"),
            data=DataConfig("(any)"),
            optim=OptimConfig(max_steps=1),
            output_dir=".",
            device=device,
        )
        facts = None
    hw = hardware.detect(config.device)
    plan = planning.plan(hw, config, facts)
    # Per switch: None when `on` can be honoured on this machine, else why not (the API reads it).
    capabilities = planning.capabilities(hw, config)
    if as_json:
        report = {
            "hardware": hw.to_dict(),
            "plan": plan.to_dict(),
            "capabilities": capabilities,
        }
        print(json.dumps(report, indent=2))
        return 0
    print(f"device     {hw.describe()}")
    gpu_mem = f"{hw.gpu_memory / 2**30:.1f} GiB" if hw.gpu_memory else "-"
    print(
        f"memory     gpu {gpu_mem}, host {hw.host_memory / 2**30:.1f} GiB, pinned {'yes' if hw.pinned_memory else 'no'}"
    )
    print(
        f"kernels    {', '.join(hw.attention_kernels)}; triton {'yes' if hw.triton else 'no'}; "
        f"bitsandbytes {'yes' if hw.bitsandbytes else 'no'}; bf16 {'yes' if hw.bf16 else 'no'}"
    )
    print(
        f"peak       {hw.peak_flops / 1e12:.0f} TFLOP/s bf16 ({hw.peak_source})"
        if hw.peak_flops
        else "peak       unknown (no MFU)"
    )
    print(f"dtype      {plan.dtype}")
    for d in plan.decisions:
        backend = f" [{d.backend}]" if d.backend else ""
        print(f"{d.name:<24} {d.requested:<4} -> {'on ' if d.enabled else 'off'}{backend}  {d.reason}")
    for name, why_not in capabilities.items():
        print(
            f"{'can be on' if why_not is None else 'cannot be on':<12} {name}"
            + (f": {why_not}" if why_not else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
