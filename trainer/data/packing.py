"""Pack tokenized samples into padding-free micro-batches, and the order they are trained in.

A packed micro-batch is one row of concatenated samples, shape [1, T] with T <= batch_tokens
real tokens and no padding. Three samples of lengths 3, 2 and 4 give::

    input_ids     a0 a1 a2 b0 b1 c0 c1 c2 c3
    position_ids   0  1  2  0  1  0  1  2  3      (restart per sample)
    targets       a1 a2  -  b1  -  c1 c2 c3  -    (next token of the same sample; - = -100)
    lengths       [3, 2, 4]                        (host-side Python list)

``targets`` are already shifted, so the loss is ``cross_entropy(logits[t], targets[t])`` at every
position t, and the last token of a sample never predicts the first token of the next one.
Attention must not cross samples either: with no attention mask and no KV cache, transformers
(``masking_utils.find_packed_sequence_indices``) derives the sample boundaries from these
position ids and builds a block-diagonal causal mask; ``trainer.model.packed_forward`` makes sure
both conditions hold. ``lengths`` stays on the host so boundary metadata (``cu_seqlens``, max
length) can be built without reading anything back from the device.

The order: each epoch shuffles the sample indices with a generator seeded by (seed, epoch) and
packs them greedily in that order, so the whole schedule, and its number of steps, is a pure
function of the sample lengths and the config, known before training and replayable on resume.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from trainer.data.dataset import IGNORE_INDEX, Sample


@dataclass(frozen=True)
class PackedBatch:
    """One packed micro-batch. Tensors are [1, T] int64; ``lengths`` sum to T."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    lengths: list[int]
    num_targets: int
    """Positions with a target (!= -100), or DPO pairs: the loss denominator, known on the host."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-position tensors an objective packs beside the targets ([1, T]; ``Objective.pack``),
    moved with the batch; empty for SFT and DPO."""
    prefixes: list[int] | None = None
    """Per sequence, the earlier sequence it continues (a shared prefix: GRPO's prompt, trained once
    for its group) or -1; None: none does (``trainer.data.packed_metadata``'s module docstring)."""

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        def move(t: torch.Tensor) -> torch.Tensor:
            if non_blocking and torch.device(device).type == "cuda":
                t = t.pin_memory()
            return t.to(device, non_blocking=non_blocking)

        return PackedBatch(
            move(self.input_ids),
            move(self.position_ids),
            move(self.targets),
            self.lengths,
            self.num_targets,
            {name: move(t) for name, t in self.extras.items()},
            self.prefixes,
        )


def pack_batch(samples: Sequence[Sample]) -> PackedBatch:
    """Concatenate ``samples`` into one padding-free row (see the module docstring).

    A DPO pair (``trainer.objectives.preference.PreferencePair``, one schedule item) packs as its chosen then
    its rejected sequence, side by side in the row: a pair is never split across micro-batches.
    ``num_targets`` sums the samples' ``num_loss_tokens``: label tokens, or one per pair.
    """
    if not samples:
        raise ValueError("pack_batch: needs at least one sample")
    sequences = [seq for sample in samples for seq in getattr(sample, "sequences", (sample,))]
    input_ids: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    for sample in sequences:
        input_ids.extend(sample.input_ids)
        positions.extend(range(len(sample)))
        targets.extend(sample.labels[1:])
        targets.append(IGNORE_INDEX)
    row = lambda values: torch.tensor(values, dtype=torch.long).unsqueeze(0)
    return PackedBatch(
        row(input_ids),
        row(positions),
        row(targets),
        [len(s) for s in sequences],
        sum(s.num_loss_tokens for s in samples),
    )


class SegmentRow:
    """A packed row built one sample (segment) at a time, each free to continue an earlier one as
    its shared prefix (``trainer.data.packed_metadata``): GRPO's groups and DPO's pairs with their
    prompt packed once. ``add`` appends a segment with its per-token extras; ``batch`` makes the
    ``PackedBatch`` (extras as [1, T] rows, ``prefixes`` per segment)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.targets: list[int] = []
        self.lengths: list[int] = []
        self.prefixes: list[int] = []
        self.extras: dict[str, list[float]] = {}

    def add(self, tokens: list[int], targets: list[int], first: int = 0, prefix: int = -1,
            **per_token: float) -> int:
        """Append a segment: ``tokens`` at positions from ``first``, each position's target, the
        segment it continues (-1: none) and one value per extra for all its tokens; its index."""
        self.ids += tokens
        self.positions += range(first, first + len(tokens))
        self.targets += targets
        for name, value in per_token.items():
            self.extras.setdefault(name, []).extend([value] * len(tokens))
        self.lengths.append(len(tokens))
        self.prefixes.append(prefix)
        return len(self.lengths) - 1

    def batch(self, num_targets: int, dtypes: dict[str, torch.dtype] | None = None,
              shared: bool = True) -> PackedBatch:
        """The row as a ``PackedBatch``; extras are int64 unless ``dtypes`` says otherwise;
        ``shared`` False: no ``prefixes`` (every segment whole)."""
        def row(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).unsqueeze(0)

        extras = {name: row(values, (dtypes or {}).get(name, torch.long)) for name, values in self.extras.items()}
        return PackedBatch(row(self.ids), row(self.positions), row(self.targets), self.lengths, num_targets,
                           extras=extras, prefixes=self.prefixes if shared else None)


def pack_indices(
    lengths: Sequence[int], order: Sequence[int], batch_tokens: int
) -> list[list[int]]:
    """Greedily group sample indices, in ``order``, into batches of at most ``batch_tokens`` tokens."""
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        n = lengths[i]
        if n > batch_tokens:
            raise ValueError(
                f"sample {i} has {n} tokens, more than batch_tokens={batch_tokens}; truncate it first"
            )
        if current and used + n > batch_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(current)
    return batches


@dataclass(frozen=True)
class MicroBatchRef:
    """Where one micro-batch sits in the schedule, and which samples it holds."""

    index: int
    """Global micro-batch index (the data position saved in checkpoints)."""
    epoch: float
    """Epochs completed once this micro-batch is done (e.g. 1.5)."""
    sample_indices: list[int]


class BatchSchedule:
    """The deterministic order of packed micro-batches over (possibly fractional) epochs.

    Args:
        lengths: token count of each sample.
        batch_tokens: packing budget per micro-batch.
        seed: shuffles each epoch with ``random.Random((seed, epoch))``.
        grad_accum: micro-batches per optimizer step.
        max_steps: optimizer steps to run (epochs repeat as needed), or
        epochs: passes over the data; exactly one of the two.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_tokens: int,
        seed: int,
        grad_accum: int = 1,
        max_steps: int | None = None,
        epochs: float | None = None,
    ) -> None:
        if (max_steps is None) == (epochs is None):
            raise ValueError("BatchSchedule: set exactly one of max_steps and epochs")
        if not lengths:
            raise ValueError("BatchSchedule: no samples to schedule")
        self.lengths = list(lengths)
        self.batch_tokens = batch_tokens
        self.seed = seed
        self.grad_accum = grad_accum
        self._epochs: dict[int, list[list[int]]] = {}
        if max_steps is not None:
            self.total_micro_batches = max_steps * grad_accum
        else:
            assert epochs is not None
            whole, fraction = int(epochs), epochs - int(epochs)
            total = sum(len(self.epoch_batches(e)) for e in range(whole))
            if fraction > 0:
                total += math.ceil(fraction * len(self.epoch_batches(whole)))
            self.total_micro_batches = total
        self.total_steps = math.ceil(self.total_micro_batches / grad_accum)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The packed sample indices of ``epoch`` (cached)."""
        if epoch not in self._epochs:
            order = list(range(len(self.lengths)))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._epochs[epoch] = pack_indices(self.lengths, order, self.batch_tokens)
        return self._epochs[epoch]

    def micro_batches(self, start: int = 0) -> Iterator[MicroBatchRef]:
        """Yield micro-batches from global index ``start`` to the end of the schedule."""
        index, epoch = 0, 0
        while index < self.total_micro_batches:
            batches = self.epoch_batches(epoch)
            for j, sample_indices in enumerate(batches):
                if index >= self.total_micro_batches:
                    return
                if index >= start:
                    yield MicroBatchRef(
                        index, epoch + (j + 1) / len(batches), sample_indices
                    )
                index += 1
            epoch += 1

    def steps(self, start_step: int = 0) -> Iterator[tuple[int, list[MicroBatchRef]]]:
        """Yield ``(step, micro_batches)`` for optimizer steps ``start_step + 1 ..`` (1-based steps).

        A step's micro-batches hold the samples the greedy packing gave them, re-dealt so that
        their token counts are as equal as the budget allows (``balance``): the step trains the
        same samples, and ranks that each take one micro-batch wait less for the fullest.
        """
        group: list[MicroBatchRef] = []
        step = start_step
        for ref in self.micro_batches(start_step * self.grad_accum):
            group.append(ref)
            if len(group) == self.grad_accum:
                step += 1
                yield step, self._balanced(group)
                group = []
        if group:
            yield step + 1, self._balanced(group)

    def _balanced(self, group: list[MicroBatchRef]) -> list[MicroBatchRef]:
        dealt = balance([ref.sample_indices for ref in group], self.lengths, self.batch_tokens)
        return [MicroBatchRef(ref.index, ref.epoch, indices) for ref, indices in zip(group, dealt)]


def balance(batches: list[list[int]], lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """The samples of ``batches`` re-dealt over as many batches with near-equal token counts.

    Longest sample first, each to the batch with the fewest tokens that still has room (ties: the
    lower batch); each batch keeps its samples in the order they had in ``batches``. Greedy
    packing fills a batch until the next sample does not fit, so one micro-batch of a step may
    hold 10% fewer tokens than another (16,384-token budget, ~250-token samples: 14.7k to 16.3k);
    on several ranks each step then waits for the fullest one. Deterministic: a function of the
    lengths only. ``batches`` is returned as it is when the deal would leave a batch empty or a
    sample without room (which longest-first into the emptiest batch makes rare).
    """
    if len(batches) < 2:
        return batches
    position = {i: k for k, i in enumerate(i for batch in batches for i in batch)}
    load = [0] * len(batches)
    dealt: list[list[int]] = [[] for _ in batches]
    for i in sorted(position, key=lambda i: (-lengths[i], position[i])):
        room = [b for b in range(len(batches)) if load[b] + lengths[i] <= batch_tokens]
        if not room:
            return batches
        b = min(room, key=lambda b: (load[b], b))
        dealt[b].append(i)
        load[b] += lengths[i]
    if not all(dealt):
        return batches
    return [sorted(batch, key=position.__getitem__) for batch in dealt]
