"""``python -m trainer eval JOB.json``: an eval run (``trainer.evals.run``) as a process, with the
generation job's events, exit codes and ``done`` event (``trainer.generate.cli``)."""

from __future__ import annotations

import argparse
from typing import Any

from trainer.evals.config import EvalConfig
from trainer.generate.cli import run_job


def add_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="generate and grade an eval run as a job.json says (JSON-lines events)")
    p.add_argument("job", help="path to job.json (trainer.evals.config.EvalConfig)")


def main(args: argparse.Namespace) -> int:
    return run_job(args.job, EvalConfig, "trainer.evals.run:run_eval")
