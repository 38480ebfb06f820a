"""Activation checkpointing applied the way memplan plans it: on each repeated block.

A repeated block is an element of an `nn.ModuleList` / `nn.Sequential` whose elements share one
class, with at least two of them (transformer layers, ResNet stages' blocks). Each is wrapped with
non-reentrant `torch.utils.checkpoint` (what transformers' `gradient_checkpointing_enable` and
torch's `checkpoint_wrapper` use), so only the block's inputs are kept and its inside is recomputed
in backward.

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
from torch.utils.checkpoint import checkpoint

_WRAPPED = "_memplan_checkpointed"


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


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def blocks_to_checkpoint(
    model: nn.Module, which: bool | Collection[type[nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """Resolve the `checkpointing=` argument to the modules to wrap."""
    if which is False:
        return []
    if which is True:
        blocks = find_repeated_blocks(model)
        if not blocks:
            raise ValueError(
                "checkpointing=True found no repeated blocks (an nn.ModuleList or nn.Sequential of >= 2 "
                "modules of one class) in the model; pass checkpointing={BlockClass} naming the module "
                "classes to checkpoint"
            )
        return blocks
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


def apply_checkpointing(model: nn.Module, which: bool | Collection[type[nn.Module]]) -> list[str]:
    """Wrap the chosen blocks' forward in non-reentrant checkpointing, in place. Returns their names."""
    wrapped = []
    for name, block in blocks_to_checkpoint(model, which):
        if getattr(block, _WRAPPED, False):
            continue
        original = block.forward
        block.forward = functools.partial(_checkpointed_forward, original)
        setattr(block, _WRAPPED, True)
        wrapped.append(name)
    return wrapped


def _checkpointed_forward(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


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
