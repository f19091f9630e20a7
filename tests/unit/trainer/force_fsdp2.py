"""``python -m trainer`` with the ``parallelism`` decision forced to FSDP2 on several ranks: what a
LoRA base too big for one GPU gets (``trainer.parallel.strategy.FEATURE.decide``), which a CPU never does (it has
no GPU memory to exceed). Run as a script by torchrun (``distributed_helpers.command``)."""

from __future__ import annotations

import sys

from trainer.__main__ import main
from trainer.parallel import strategy as parallel
from trainer.plan.feature import Context
from trainer.plan.types import Decision

_decide = parallel.FEATURE.decide


def _sharded(ctx: Context) -> Decision:
    decision = _decide(ctx)
    if ctx.world_size == 1:
        return decision
    return Decision(decision.name, decision.requested, True, "fsdp2", f"{decision.reason}; forced to fsdp2 by the test")


if __name__ == "__main__":
    parallel.FEATURE.decide = _sharded  # type: ignore[method-assign]
    sys.exit(main(sys.argv[1:]))
