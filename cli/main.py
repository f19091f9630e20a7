"""``ftq``: start the service, or its parts.

    ftq up                 API + one local worker on the embedded default (or the FTQ_* URLs)
    ftq api                the REST API (uvicorn)
    ftq worker [--gpus all | --gpus 0,1,3 | --gpu N | --slots K]
                           this host's worker: its GPUs (or K CPU slots) as one pool
    ftq slurm-bridge --partition P --shared-dir DIR [--gpus-per-node N --account A --qos Q ...]
                           a worker whose pool is a Slurm partition: jobs with pool: slurm (docs/slurm.md)
    ftq db upgrade         apply the store's migrations

    ftq submit JOB.yaml    client commands, against FTQ_API_URL (default the local API):
    ftq jobs [--search TEXT] | show ID | logs ID [--follow] | cancel ID | download ID [--step N]
    ftq rerun ID [--set key=value ...] | resume ID [--step N] | metrics ID [-o FILE]
    ftq export ID --format merged|gguf [--quantization q8_0] [-o FILE] | exports ID
    ftq generate MODEL PROMPTS.jsonl [--max-tokens N ...] [--gpus N] [-o FILE] | completions ID [--head N]
    ftq chat MODEL [-m MESSAGE] [--system TEXT] [--max-tokens N ...]
                           talk to a base or a tuned model (a REPL, or one turn with -m)
    ftq sessions [--all] | sessions end ID
    ftq eval create EVAL.json | list | show EVAL | run EVAL MODEL ITEMS.jsonl --template 'user:{{item.q}}'
             | results EVAL RUN [--items] | cancel EVAL RUN | delete EVAL [RUN]
    ftq machines           the machines running workers: live or lost, their GPUs and the jobs on them
    ftq models [pull ORG/NAME [--revision REV]]
                           the box's models and whether they fit its GPUs; pull one from the hub
    ftq login --key KEY    save the key (and --url) to ~/.config/ftq/config.toml (mode 0600)

    ftq users create NAME [--admin] [--max-running N] | list | key NAME | revoke PREFIX | set NAME ...
                           on the box, straight to the store; prints new keys once
    ftq projects list | create NAME | set NAME | members NAME | add-member NAME USER [--role admin]
               | remove-member NAME USER | default NAME [--local]
                           the teams work belongs to (through the API); --project NAME on submit,
                           jobs and rerun, else the config file's project
    ftq workers key create NAME | list | revoke NAME
                           worker keys for workers on other machines (admin, through the API)

Configuration comes from the environment (``FTQ_*``, see core/settings.py); flags override it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

from cli import chat, db, evals, exports, generate, jobs, machines, models, projects, runs, serve, slurm, up, users, worker_keys
from cli.errors import CliError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftq", description="Fine-tuning jobs on a shared GPU box.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up.add_parser(commands)
    serve.add_api_parser(commands)
    serve.add_worker_parser(commands)
    slurm.add_parsers(commands)
    db.add_parser(commands)
    jobs.add_parsers(commands)
    exports.add_parsers(commands)
    generate.add_parsers(commands)
    chat.add_parsers(commands)
    evals.add_parsers(commands)
    runs.add_parsers(commands)
    machines.add_parsers(commands)
    models.add_parsers(commands)
    users.add_parsers(commands)
    projects.add_parsers(commands)
    worker_keys.add_parsers(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # httpx logs every request at INFO: noise in the client commands' output, not a diagnostic.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ftq logs JOB | head`: the reader stopped; no traceback, no error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not raise again
        return 0
    except CliError as exc:
        print(f"ftq: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
