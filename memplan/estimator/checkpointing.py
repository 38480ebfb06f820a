"""Activation checkpointing applied the way memplan plans it: on the repeated blocks.

A repeated block is an element of an `nn.ModuleList` / `nn.Sequential` whose elements share one
class, with at least two of them (transformer layers, ResNet stages' blocks). The blocks a
`memplan.checkpoint_setting.Checkpointing` selects (all, the first k, every k-th) are wrapped with
non-reentrant `torch.utils.checkpoint` (what transformers' `gradient_checkpointing_enable` and
torch's `checkpoint_wrapper` use), so only the block's inputs are kept and its inside is recomputed
in backward. Mode 'op' adds torchtitan's per-op policy (`OpPolicy`, through
`create_selective_checkpoint_contexts`): matmul and attention outputs are kept, the rest recomputed.

Each checkpointed call also keeps a copy of the CPU generator's state (`torch.get_rng_state()`, 5 KiB)
until its backward, to replay dropout. It is made outside the dispatcher, so no traced op shows it;
`saved_rng_states` hands each copy to the tracker.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memplan.checkpoint_setting import Checkpointing
from memplan.compat.torch import op_packet
from memplan.estimator.errors import NoRepeatedBlocks

_WRAPPED = "_memplan_checkpointed"

_KEPT_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
             "_efficient_attention_forward", "abs", "max")
"""Ops whose outputs the per-op policy keeps: torchtitan's `_save_list` (mm, the SDPA kernels, abs and
max for float8 scales; torchtitan/parallelisms/parallelize_llama.py, Dec 2024) widened, as torchtitan's
later `_get_default_save_ops` is, to the other compute-intensive ops (addmm, bmm, baddbmm, convolutions)
and to the SDPA kernels of other backends (CPU's fused flash kernel, cuDNN)."""


class OpPolicy:
    """torchtitan's selective *op* checkpointing policy for one checkpointed call: keep the outputs of
    `_KEPT_OPS`, except every second `aten.mm` (counted separately in the forward and in the recompute,
    from the call's start), and recompute the rest. `keeps(name)` is the decision without torch's
    context, for the step-time model (estimator/flops.py), which follows a block's ops in order."""

    def __init__(self) -> None:
        self._mm = {"forward": 0, "recompute": 0}

    def keeps(self, name: str, *, recompute: bool = False) -> bool:
        """Whether an op named `name` (an ATen overload packet's name) has its output kept."""
        if name == "mm":
            key = "recompute" if recompute else "forward"
            self._mm[key] += 1
            return self._mm[key] % 2 == 1
        return name in _KEPT_OPS

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        name = op_packet(func).__name__.split(".")[-1]
        kept = self.keeps(name, recompute=ctx.is_recompute)
        return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def op_policy_contexts():
    """A fresh (forward, recompute) context pair for one checkpointed call under the per-op policy."""
    return create_selective_checkpoint_contexts(OpPolicy())


def find_repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost repeated blocks: elements of containers whose >= 2 elements share one class."""
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            classes = {type(child) for _, child in children}
            if len(children) >= 2 and len(classes) == 1 and _has_parameters(children[0][1]):
                found.extend((f"{prefix}{name}", child) for name, child in children)
                return
        for name, child in module.named_children():
            visit(f"{prefix}{name}.", child)

    visit("", model)
    return found


def own_checkpointing(model: nn.Module) -> str | None:
    """What the model checkpoints itself, in words, or None: transformers' switch
    (`gradient_checkpointing_enable()` sets `gradient_checkpointing = True` on the layers it wraps),
    torch's `checkpoint_wrapper` modules (FSDPStrategy's activation_checkpointing_policy, torchtitan), or
    memplan's own wrapper applied earlier. A `torch.utils.checkpoint` call inside a forward leaves no
    mark on the modules and is not found here: the trace counts it (`OwnCheckpointCalls`,
    MemoryEstimate.own_checkpoint_calls) and the planner then keeps it (planner/search.py)."""
    found = []
    switched = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True
                and not hasattr(m, "is_gradient_checkpointing")]  # the layers, not the PreTrainedModel property
    if switched:
        found.append(f"transformers' gradient_checkpointing on {len(switched)} module{'s' * (len(switched) > 1)}")
    wrappers = [n for n, m in model.named_modules() if type(m).__name__ == "CheckpointWrapper"]
    if wrappers:
        found.append(f"torch's checkpoint_wrapper on {len(wrappers)} module{'s' * (len(wrappers) > 1)}")
    ours = [n for n, m in model.named_modules() if getattr(m, _WRAPPED, False)]
    if ours:
        found.append(f"torch.utils.checkpoint on {len(ours)} block{'s' * (len(ours) > 1)} (memplan's wrapper)")
    return "; ".join(found) or None


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


CheckpointArg = bool | str | Checkpointing | Collection[type[nn.Module]]
"""What `checkpointing=` accepts: False / True (each repeated block), a Checkpointing or its text form
('blocks:4', 'op'), or a set of module classes to checkpoint in full."""


def blocks_to_checkpoint(model: nn.Module, which: CheckpointArg) -> list[tuple[str, nn.Module]]:
    """Resolve the `checkpointing=` argument to the modules to wrap."""
    if which is False:
        return []
    if isinstance(which, (bool, str, Checkpointing)):
        setting = Checkpointing.parse(which)
        if not setting:
            return []
        blocks = find_repeated_blocks(model)
        if not blocks:
            raise NoRepeatedBlocks(
                f"checkpointing={'True' if which is True else repr(str(setting))} found no repeated blocks (an "
                "nn.ModuleList or nn.Sequential of >= 2 modules of one class) in the model; pass "
                "checkpointing={BlockClass} naming the module classes to checkpoint",
                argument="checkpointing", detail="found no repeated blocks (an nn.ModuleList or nn.Sequential of "
                ">= 2 modules of one class) in the model"
            )
        return [blocks[i] for i in setting.selected(len(blocks))]
    classes = tuple(which)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise ValueError(
            f"checkpointing must be True, False or a set of nn.Module classes; got {which!r}"
        )
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, classes) and m is not model]
    if not blocks:
        names = ", ".join(c.__name__ for c in classes)
        raise ValueError(f"checkpointing={{{names}}} matched no module of the model; check the class names")
    return blocks


def apply_checkpointing(model: nn.Module, which: CheckpointArg) -> list[str]:
    """Wrap the chosen blocks' forward in non-reentrant checkpointing (with the per-op policy for mode
    'op'), in place. Returns their names."""
    per_op = isinstance(which, (str, Checkpointing)) and Checkpointing.parse(which).per_op
    wrapped = []
    for name, block in blocks_to_checkpoint(model, which):
        if getattr(block, _WRAPPED, False):
            continue
        original = block.forward
        if per_op:
            block.forward = functools.partial(_checkpointed_forward, original, _memplan_context=op_policy_contexts)
        else:
            block.forward = functools.partial(_checkpointed_forward, original)
        setattr(block, _WRAPPED, True)
        wrapped.append(name)
    return wrapped


def _checkpointed_forward(forward, *args, _memplan_context=None, **kwargs):
    if _counting is not None:
        _counting.ours += 1  # the checkpoint call below is memplan's own
    if _memplan_context is not None:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_memplan_context, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def as_setting(which: CheckpointArg) -> Checkpointing | None:
    """The Checkpointing a `checkpointing=` argument stands for; None for a set of classes (full
    checkpointing of those classes, which no setting names)."""
    if isinstance(which, (bool, str, Checkpointing)):
        return Checkpointing.parse(which)
    return None


class OwnCheckpointCalls:
    """Counts the model's own `torch.utils.checkpoint` calls while open (`calls`); the calls memplan's
    wrapper makes (`apply_checkpointing`) are told apart and not counted."""

    def __init__(self) -> None:
        self.calls = 0
        self.ours = 0
        self._inner = None

    def _count(self) -> None:
        if self.ours:
            self.ours -= 1
        else:
            self.calls += 1

    def __enter__(self) -> OwnCheckpointCalls:
        global _counting
        from memplan.compat.torch import counting_checkpoint_calls

        self._inner = counting_checkpoint_calls(self._count)
        self._inner.__enter__()
        _counting = self
        return self

    def __exit__(self, *exc) -> None:
        global _counting
        _counting = None
        self._inner.__exit__(*exc)


_counting: OwnCheckpointCalls | None = None


@contextlib.contextmanager
def saved_rng_states(track: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """While open, every `torch.get_rng_state()` (what torch.utils.checkpoint calls per checkpointed
    block, with preserve_rng_state=True) passes its tensor to `track`, which follows it until it dies."""
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        track(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original
