"""What one traced training step computes and moves: each op's FLOPs and bytes, for the step-time model.

The trace that measures memory (tracker.py) sees every ATen op of the steady-state step on fake
tensors; `CostCounter.record` turns each into an `OpCost`:

- FLOPs: torch.utils.flop_counter's formulas (matmuls, convolutions and their backward, the SDPA /
  flash / memory-efficient attention kernels and their backward: 2 FLOPs per multiply-add), which
  need shapes only and so work on fake tensors; a causal attention kernel counts half (it skips the
  masked tiles), the CPU's fused SDPA kernels take the same formulas. Any other op counts one FLOP per output element
  (elementwise) or per input element (reductions): small next to the matmuls, and its time is set
  by its bytes anyway.
- Bytes moved: the sizes of the op's tensor inputs plus its outputs (an in-place foreach op reads and
  writes its first list). Views, aliases and allocations move nothing and are not recorded; a gather
  (embedding, index_select) reads as many table bytes as it writes, not the whole table.
- Class: matmul (mm, addmm, bmm, convolutions), attention (the fused SDPA kernels), reduction
  (sums, norms, softmax, losses) or elementwise (the rest, copies and the optimizer's foreach ops).
- Phase: forward, backward, recompute (a checkpointed block's forward run again in backward) or
  optimizer. Ops inside a repeated block (what memplan checkpoints) are marked `in_block`, with the
  block's index among the repeated blocks (`block`: partial checkpointing recomputes some blocks) and
  whether the per-op policy would keep the op's output (`op_kept`: selective checkpointing recomputes
  the others; estimator/checkpointing.OpPolicy, counted from each block's start as torch calls it).
- dtype: the op's first floating input ('fp32', 'bf16', 'fp16'); fp32 convolutions are 'tf32'
  (cuDNN allows TF32 by default, cuBLAS matmuls do not).
- Alignment (matmuls other than convolutions): the largest power of two, up to 16, that divides every
  operand's and the output's contiguous extent and leading dimension, in elements (`align`). cuBLAS's
  tensor-core kernels load 16 bytes at a time along those; a GEMM whose dimensions do not allow it (GPT-2's
  LM head, vocabulary 50257) falls back to alignment-1 kernels (the step-time model's rule: planner/costs.py).

No op is run for its cost and nothing here allocates: a counter adds a few dict look-ups per op.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from memplan.compat.torch import op_packet, op_schema

OP_CLASSES = ("matmul", "attention", "elementwise", "reduction")
"""The op classes the step-time model gives their own efficiency."""
PHASES = ("forward", "backward", "recompute", "optimizer")
"""Where in the step an op runs."""
MAX_ALIGN = 16
"""The largest alignment OpCost.align records, in elements (16 bytes is 8 half-precision elements: 16 covers
every dtype's need)."""


@dataclass(frozen=True, kw_only=True)
class OpCost:
    """One op of a traced step (or `count` identical ones)."""

    op_class: str
    """One of OP_CLASSES."""
    dtype: str
    """'fp32', 'tf32' (an fp32 convolution), 'bf16' or 'fp16': which peak the op runs at."""
    phase: str
    """One of PHASES."""
    flops: int
    """Floating-point operations (a multiply-add is 2)."""
    bytes: int
    """Bytes read and written: tensor inputs plus outputs."""
    cast: bool = False
    """A dtype conversion copy (autocast's casts of weights and activations)."""
    in_block: bool = False
    """Run inside a repeated block (a transformer layer): what checkpointing recomputes."""
    convolution: bool = False
    """A convolution (or its backward): in fp32 it runs at the TF32 peak, as cuDNN allows TF32 by default."""
    block: int = -1
    """Index of the outermost repeated block the op ran in (-1: none, or a checkpointed module outside them)."""
    op_kept: bool = False
    """A forward op in a block whose output torchtitan's per-op policy keeps (not recomputed under 'op')."""
    align: int = MAX_ALIGN
    """A matmul's alignment in elements: the largest power of two (at most MAX_ALIGN) dividing each operand's
    and the output's contiguous extent and leading dimension; MAX_ALIGN for other ops and convolutions."""
    count: int = 1
    """How many identical ops this record stands for."""


@dataclass(frozen=True, kw_only=True)
class StepCosts:
    """The ops of one steady-state training step, in the order they ran."""

    ops: tuple[OpCost, ...]
    """Every op that computes or moves data."""

    def flops(self, *phases: str, classes: tuple[str, ...] = OP_CLASSES) -> int:
        """FLOPs of the given phases (all when none are given) and op classes."""
        return sum(o.flops * o.count for o in self.ops
                   if (not phases or o.phase in phases) and o.op_class in classes)

    def bytes(self, *phases: str) -> int:
        """Bytes moved in the given phases (all when none are given)."""
        return sum(o.bytes * o.count for o in self.ops if not phases or o.phase in phases)

    def summary(self) -> dict[str, dict[str, int]]:
        """{phase: {'flops': ..., 'bytes': ..., 'ops': ...}}, JSON-ready."""
        return {p: {"flops": self.flops(p), "bytes": self.bytes(p),
                    "ops": sum(o.count for o in self.ops if o.phase == p)} for p in PHASES}


# --- counting ------------------------------------------------------------------------------------
_REDUCTION_WORDS = ("sum", "mean", "norm", "softmax", "amax", "amin", "max", "min", "var", "std", "nll_loss",
                    "cross_entropy", "argmax", "argmin", "cumsum", "prod", "logsumexp", "any", "all", "topk", "sort")
_FREE_OPS = {"detach", "alias", "lift_fresh", "lift_fresh_copy", "empty", "empty_like", "empty_strided", "new_empty",
             "new_empty_strided", "_local_scalar_dense", "set_", "resize_", "_unsafe_view", "view", "t",
             "_has_compatible_shallow_copy_type", "is_same_size", "size", "stride", "sym_size", "sym_stride",
             "sym_numel", "sym_storage_offset", "_to_copy_meta", "record_stream", "_version", "device"}
_GATHERS = {"embedding", "index_select", "index", "gather"}
_CONVOLUTIONS = ("conv", "convolution")
_CPU_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
"""The CPU's fused SDPA kernels, which torch.utils.flop_counter has no formula for (its SDPA formulas serve)."""
_PHASE_NAMES = {"forward": "forward", "backward": "backward", "optimizer": "optimizer"}


@functools.lru_cache(maxsize=None)
def _classify(packet: Any) -> str | None:
    """The op class of an ATen overload packet; None for ops that move nothing."""
    from torch.utils.flop_counter import flop_registry

    name = packet.__name__.split(".")[-1]
    if name in _FREE_OPS:
        return None
    if packet in flop_registry or name in _CPU_ATTENTION:
        return "attention" if "attention" in name else "matmul"
    base = name.lstrip("_").removeprefix("foreach_")
    return "reduction" if any(w in base for w in _REDUCTION_WORDS) else "elementwise"


def _dtype_name(dtype: Any, *, convolution: bool) -> str:
    import torch

    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return "tf32" if convolution else "fp32"


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


class CostCounter:
    """Counts the FLOPs and bytes of each op the tracker sees (see the module docstring)."""

    def __init__(self) -> None:
        self._ops: list[OpCost] = []
        self._block_depth = 0
        self._block = -1
        self._policy = None
        self._counting = False

    def reset(self) -> None:
        """Start counting afresh: the steady-state step (ops before the first reset are not counted)."""
        self._ops.clear()
        self._counting = True

    def watch_blocks(self, blocks: list[Any], repeated: list[Any] = ()) -> None:
        """Mark ops run inside `blocks` (each block's forward wrapped) and inside a checkpointed block's recompute
        (memplan's checkpoint wrapper calls the block's own forward again in backward); `repeated`, the
        model's repeated blocks in order, numbers them (OpCost.block). Not by forward hooks: nn.TransformerEncoderLayer
        takes its native fast path (eval mode, no gradient) only when no module in it has one, as in a real run."""
        from memplan.estimator.checkpointing import _checkpointed_forward

        index = {id(b): i for i, b in enumerate(repeated)}
        for block in blocks:
            forward = block.forward
            if isinstance(forward, functools.partial) and forward.func is _checkpointed_forward:
                forward = functools.partial(forward.func, self._inside(forward.args[0]), *forward.args[1:],
                                            **forward.keywords)
            block.forward = self._watched(index.get(id(block), -1), forward)

    def _watched(self, index: int, forward):
        """`forward`, counting its ops inside block `index`; its signature is the original's (inspect follows
        __wrapped__: model code that reads a forward's parameters sees the same)."""
        def watched(*args: Any, **kwargs: Any) -> Any:
            self._enter(index)
            try:
                return forward(*args, **kwargs)
            finally:
                self._leave()
        return functools.update_wrapper(watched, forward)

    def _enter(self, index: int, *_: Any) -> None:
        from memplan.estimator.checkpointing import OpPolicy

        if self._block_depth == 0:
            self._block, self._policy = index, OpPolicy()
        self._block_depth += 1

    def _leave(self, *_: Any) -> None:
        self._block_depth -= 1

    def _inside(self, forward):
        @functools.wraps(forward)
        def inside(*args, **kwargs):
            self._block_depth += 1
            try:
                return forward(*args, **kwargs)
            finally:
                self._block_depth -= 1
        return inside

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any, inputs: list, outputs: list, phase: str) -> None:
        """Count one op: `out` is what it returned, `inputs` / `outputs` its tensor arguments and results,
        `phase` the tracker's phase name ('setup' ops are not part of a step and are skipped)."""
        if not self._counting or phase not in _PHASE_NAMES or getattr(func, "is_view", False):
            return
        packet = op_packet(func)
        op_class = _classify(packet)
        if op_class is None:
            return
        name = packet.__name__.split(".")[-1]
        out_bytes = sum(_nbytes(t) for t in outputs)
        if name in _GATHERS and inputs:
            in_bytes = min(_nbytes(inputs[0]), out_bytes) + sum(_nbytes(t) for t in inputs[1:])
        else:
            in_bytes = sum(_nbytes(t) for t in inputs)
        if name.endswith("_") and not outputs and args and isinstance(args[0], (list, tuple)):
            in_bytes += sum(_nbytes(t) for t in args[0] if hasattr(t, "element_size"))  # foreach in place: written back
        if op_class in ("matmul", "attention"):
            flops = _matmul_flops(func, packet, name, args, kwargs, out)
        elif op_class == "reduction":
            flops = sum(t.numel() for t in inputs)
        else:
            flops = sum(t.numel() for t in outputs) or sum(t.numel() for t in inputs)
        floating = [t for t in inputs if t.is_floating_point()] or [t for t in outputs if t.is_floating_point()]
        convolution = op_class == "matmul" and any(w in name for w in _CONVOLUTIONS)
        dtype = _dtype_name(floating[0].dtype if floating else None, convolution=convolution)
        cast = name in ("_to_copy", "copy_") and bool(inputs) and bool(outputs) and inputs[-1].dtype != outputs[0].dtype
        in_block = self._block_depth > 0
        step_phase = "recompute" if phase == "backward" and in_block else _PHASE_NAMES[phase]
        kept = in_block and step_phase == "forward" and self._policy is not None and self._policy.keeps(name)
        align = matmul_align(inputs + outputs) if op_class == "matmul" and not convolution else MAX_ALIGN
        self._ops.append(OpCost(op_class=op_class, dtype=dtype, phase=step_phase, flops=flops,
                                bytes=in_bytes + out_bytes, cast=cast, in_block=in_block,
                                convolution=convolution, block=self._block if in_block else -1, op_kept=kept,
                                align=align))

    def result(self) -> StepCosts:
        """The counted step, op by op in the order they ran."""
        return StepCosts(ops=tuple(self._ops))


def matmul_align(tensors: list) -> int:
    """OpCost.align of a matmul over `tensors` (its operands and output): per matrix (a tensor's last two
    dimensions), the extent of its contiguous dimension and its leading dimension (the other one's stride, where
    that dimension has more than one row); vectors, scalars, tensors without strides (sparse) and matrices with no
    contiguous dimension (cuBLAS copies those) do not count."""
    values = []
    for t in tensors:
        if t.dim() < 2:
            continue
        try:
            (rows, cols), (row_stride, col_stride) = t.shape[-2:], t.stride()[-2:]
        except (RuntimeError, NotImplementedError):  # a sparse or nested tensor has no strides: no GEMM layout to read
            continue
        if col_stride == 1 or cols == 1:
            values += [cols] + ([row_stride] if rows > 1 else [])
        elif row_stride == 1 or rows == 1:
            values += [rows] + ([col_stride] if cols > 1 else [])
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    if g == 0:
        return MAX_ALIGN
    return min(g & -g, MAX_ALIGN)


def _matmul_flops(func: Any, packet: Any, name: str, args: tuple, kwargs: dict, out: Any) -> int:
    """torch.utils.flop_counter's count of a matmul, convolution or attention op; a causal attention
    kernel skips the masked half of the scores, so it counts half."""
    from torch.utils import flop_counter

    try:
        if name in _CPU_ATTENTION:
            backward = name.endswith("backward")
            shapes = [tuple(t.shape) for t in args[:4 if backward else 3]]
            flops = (flop_counter.sdpa_backward_flop_count(*shapes) if backward else flop_counter.sdpa_flop_count(*shapes))
        else:
            flops = flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)
    except (AssertionError, TypeError, ValueError, IndexError, AttributeError):
        # a formula that does not know this call's arguments: the op still counts by its bytes. The memory
        # estimate around it must not fail for the step-time model's sake.
        return 0
    return int(flops) // 2 if "attention" in name and _is_causal(func, args, kwargs) else int(flops)


def _is_causal(func: Any, args: tuple, kwargs: dict) -> bool:
    """The op's `is_causal` argument, found by name in its schema."""
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    names = [a.name for a in op_schema(func).arguments]
    if "is_causal" in names:
        i = names.index("is_causal")
        return bool(args[i]) if i < len(args) else False
    return False
