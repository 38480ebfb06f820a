"""A model's step costs at any micro-batch, precision and checkpointing, from the traces of one setting.

The planner traces one group (AMP where allowed, no checkpointing) at micro-batch 1 and PROBE_MICRO for
its memory line anyway; the same traces count each op's FLOPs and bytes (estimator/flops.py). The ops
run in the same order at both micro-batches, so each op's FLOPs and bytes are a line in the
micro-batch (a weight is read once per op whatever the batch; activations grow with it). The other
settings are derived without another trace:

- checkpointing: each forward op inside a checkpointed repeated block runs again in backward (phase
  'recompute'): every block under full, the first k under 'blocks:k', every k-th under 'every:k'
  (OpCost.block), and under torchtitan's per-op policy only the ops whose outputs it does not keep
  (OpCost.op_kept);
- 32-true from an AMP trace: autocast's dtype casts go, and half-precision ops run in fp32 on twice
  the bytes (and a matmul's alignment in bytes doubles with its elements: ScaledOp.align_bytes);
- traces that differ in a few ops (a model or loss that copies a strided view only when the batch has
  more than one sample: transformers' causal-LM loss, a linear on a [1, ...] input run as one addmm):
  the two op sequences are lined up by difflib's longest matching runs; an op found in one trace only
  belongs to that trace's micro-batch layout: the first trace's at its own micro-batch, the second
  trace's above it (scaled in proportion to the micro-batch from the second trace);
- a single trace (micro-batch 1 only, or traces of which fewer than MIN_LINED_UP of the ops line up): the
  forward and backward ops grow in proportion to the micro-batch, the optimizer's stay.

Without counted costs (an estimator that does not count them, as the tests' simulated ones),
`CostProfile.from_parameters` stands in: 2 FLOPs per parameter per token forward and 4 backward as
matmuls reading the weights once per pass, and an Adam step over the parameters.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from memplan.checkpoint_setting import Checkpointing
from memplan.estimator.flops import OpCost, StepCosts

STEP_PHASES = ("forward", "backward")
"""Phases whose costs grow with the micro-batch."""
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "tf32": 4, "fp32": 4}
"""Bytes per element of each dtype an op runs in."""
MIN_LINED_UP = 0.8
"""Fraction of each trace's ops that must line up for the two traces to make lines (else one trace scales)."""


@dataclass(frozen=True, kw_only=True)
class ScaledOp:
    """One op (or `count` identical ones) at a given micro-batch and setting."""

    op_class: str
    """matmul, attention, elementwise or reduction."""
    dtype: str
    """fp32, tf32, bf16 or fp16."""
    phase: str
    """forward, backward, recompute or optimizer."""
    flops: float
    """FLOPs of one op."""
    bytes: float
    """Bytes one op reads and writes."""
    align_bytes: int = 64
    """A matmul's alignment in bytes (OpCost.align x the element size; planner/costs.py's MISALIGNED rule)."""
    count: int = 1
    """How many identical ops."""

    def sharded(self, shard: int) -> ScaledOp:
        """The op over 1/shard of its tensors (an optimizer op under FSDP)."""
        if shard == 1:
            return self
        return ScaledOp(op_class=self.op_class, dtype=self.dtype, phase=self.phase, flops=self.flops / shard,
                        bytes=self.bytes / shard, align_bytes=self.align_bytes, count=self.count)


class CostProfile:
    """Step costs of one model as a function of (micro-batch, AMP, checkpointing); see the module docstring."""

    def __init__(self, low: StepCosts, *, low_micro: int = 1, high: StepCosts | None = None, high_micro: int = 0,
                 traced_amp: bool, parameter_count: int, tokens_per_sample: int = 1) -> None:
        self.traced_amp = traced_amp
        """Whether the traces ran under AMP (a 32-true setting is then derived from them)."""
        self.parameter_count = parameter_count
        """Parameters of the model (communication and offload volumes)."""
        self.tokens_per_sample = tokens_per_sample
        """Sequence positions per sample (1: the batch has no sequence dimension)."""
        self._low, self._low_micro = low.ops, low_micro
        pairs = _line_up(low.ops, high.ops) if high is not None and high_micro > low_micro else None
        self._pairs = pairs if pairs is not None else [(op, None) for op in low.ops]
        """(first trace's op or None, second trace's op or None) in step order."""
        self._high_micro = high_micro
        self.two_points = pairs is not None
        """Whether the costs are lines through two traced micro-batches (else proportional to one)."""
        self._cache: dict[tuple, list[ScaledOp]] = {}
        self.repeated_blocks = 1 + max((op.block for op in low.ops), default=-1)
        """Repeated blocks the traced ops ran in (OpCost.block): what 'blocks:k' and 'every:k' select from."""

    @classmethod
    def from_parameters(cls, parameter_count: int, *, tokens_per_sample: int = 1, amp: bool = True) -> CostProfile:
        """A stand-in from the parameter count alone (module docstring), for estimates without costs."""
        n, t = parameter_count, tokens_per_sample
        dtype, size = ("bf16", 2) if amp else ("fp32", 4)

        def costs(micro: int) -> StepCosts:
            tokens = t * micro
            return StepCosts(ops=(
                OpCost(op_class="matmul", dtype=dtype, phase="forward", flops=2 * n * tokens, bytes=size * n,
                       in_block=True),
                OpCost(op_class="matmul", dtype=dtype, phase="backward", flops=4 * n * tokens, bytes=2 * size * n),
                OpCost(op_class="elementwise", dtype="fp32", phase="optimizer", flops=12 * n, bytes=28 * n),
            ))
        return cls(costs(1), high=costs(2), high_micro=2, traced_amp=amp, parameter_count=n,
                   tokens_per_sample=tokens_per_sample)

    def ops(self, micro: int, *, amp: bool, checkpointing: bool | Checkpointing) -> list[ScaledOp]:
        """The step's ops at micro-batch `micro` under AMP or 32-true and a checkpointing setting (True:
        full), identical ops merged."""
        setting = Checkpointing.parse(checkpointing)
        key = (micro, amp, setting)
        if key not in self._cache:
            self._cache[key] = self._derive(micro, amp, setting)
        return self._cache[key]

    def _recomputed(self, op: OpCost, setting: Checkpointing, selected: frozenset[int]) -> bool:
        """Whether a traced op of the step runs again in backward under `setting`."""
        if not setting or op.phase != "forward" or not op.in_block:
            return False
        if setting.mode == "full":
            return True
        if setting.per_op:
            return not op.op_kept
        return op.block in selected

    def _derive(self, micro: int, amp: bool, checkpointing: Checkpointing) -> list[ScaledOp]:
        selected = frozenset(checkpointing.selected(self.repeated_blocks))
        merged: dict[tuple, int] = {}
        for pair in self._pairs:
            at = self._at(pair, micro)
            if at is None:
                continue
            op, flops, nbytes = at
            dtype = op.dtype
            if self.traced_amp and not amp:
                if op.cast:
                    continue
                if dtype in ("bf16", "fp16"):
                    dtype, nbytes = ("tf32" if op.convolution else "fp32"), 2 * nbytes
            align_bytes = op.align * ELEMENT_BYTES.get(dtype, 4)
            phases = [op.phase] + (["recompute"] if self._recomputed(op, checkpointing, selected) else [])
            for phase in phases:
                k = (op.op_class, dtype, phase, flops, nbytes, align_bytes)
                merged[k] = merged.get(k, 0) + op.count
        return [ScaledOp(op_class=c, dtype=d, phase=p, flops=f, bytes=b, align_bytes=a, count=n)
                for (c, d, p, f, b, a), n in merged.items()]

    def _at(self, pair: tuple[OpCost | None, OpCost | None], micro: int) -> tuple[OpCost, float, float] | None:
        """(op, FLOPs, bytes) of a traced op at micro-batch `micro`; None where that micro-batch's layout has no
        such op (an op of one trace only: module docstring)."""
        low, high = pair
        one = low if low is not None else high
        if one.phase == "optimizer":  # the same whatever the micro-batch
            return one, float(one.flops), float(one.bytes)
        if low is not None and high is not None:
            span = (micro - self._low_micro) / (self._high_micro - self._low_micro)
            return (high if micro > self._low_micro else low, max(0.0, low.flops + (high.flops - low.flops) * span),
                    max(0.0, low.bytes + (high.bytes - low.bytes) * span))
        if self.two_points and (micro > self._low_micro) != (high is not None):
            return None  # another micro-batch's layout
        ratio = micro / (self._low_micro if high is None else self._high_micro)
        return one, one.flops * ratio, one.bytes * ratio


def _key(op: OpCost) -> tuple:
    return (op.op_class, op.phase, op.dtype, op.cast, op.in_block, op.block, op.convolution)


def _line_up(low: tuple[OpCost, ...], high: tuple[OpCost, ...]) -> list[tuple[OpCost | None, OpCost | None]] | None:
    """The two traces' ops paired in step order (an op of one trace only paired with None), or None where
    fewer than MIN_LINED_UP of either trace's ops line up."""
    a, b = [_key(o) for o in low], [_key(o) for o in high]
    if a == b:
        return list(zip(low, high))
    pairs: list[tuple[OpCost | None, OpCost | None]] = []
    i = j = 0
    for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        pairs += [(o, None) for o in low[i:block.a]] + [(None, o) for o in high[j:block.b]]
        pairs += list(zip(low[block.a:block.a + block.size], high[block.b:block.b + block.size]))
        i, j = block.a + block.size, block.b + block.size
    matched = sum(1 for x, y in pairs if x is not None and y is not None)
    if matched < MIN_LINED_UP * max(len(a), len(b)):
        return None
    return pairs
