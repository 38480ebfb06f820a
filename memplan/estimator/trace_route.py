"""Where a CUDA target's step is traced: on fake CPU tensors with CUDA's semantics emulated (memplan.estimator.cuda),
the default on every machine, or, asked for with MEMPLAN_TRACE_ON_CPU=0 on a machine with a GPU, on fake CUDA
tensors (native; memplan.estimator.target says why the emulated trace is the default). Two cases leave the native
trace for the emulated one, each with a note:

- strategy='fsdp': memplan.estimator.fsdp shards the fake model over a fake CPU device mesh, and fully_shard
  refuses fake CUDA parameters on it ("Expects the parameter to already be moved to device cpu but got
  cuda:0", seen on an H200). The emulated FSDP2 trace is the one measured against a GPU (GPT-2 small on one
  H200: allocated +0.007 %, reserved +0.2 %, benchmarks/results/gpu_campaign_raw/part3.json).
- an op with no fake kernel on CUDA stops the native trace (cuDNN's RNN ops: `_cudnn_init_dropout_state`,
  whose sizes come from cuDNN at run time): the step is traced again, emulated, where the CPU path of the
  same module runs (nn.LSTM / nn.GRU: zoo lstm-b32 +16.6 %, gru-b32 -1.2 % against the H200's
  max_memory_allocated, part1.json).
"""
from __future__ import annotations

from dataclasses import replace

from memplan.estimator.diagnose import op_without_fake_kernel
from memplan.estimator.notes import Note, fsdp_emulated_note, native_fallback_note
from memplan.estimator.target import Target


def emulated(target: Target) -> Target:
    """`target` traced on fake CPU tensors with CUDA's semantics emulated."""
    return replace(target, trace_device="cpu")


def trace_target(target: Target, strategy: str | None) -> tuple[Target, Note | None]:
    """The target as the trace of `strategy` runs it, and the note saying so where it is not the native one."""
    if strategy == "fsdp" and target.is_cuda and target.trace_device == "cuda":
        return emulated(target), fsdp_emulated_note()
    return target, None


def fallback_after(err: BaseException, target: Target) -> tuple[Target, Note] | None:
    """Where the native trace of `target` failed with `err` for an op without a fake kernel: the emulated target
    to trace again, and the note naming the op; None where `err` stands (another failure, or not native)."""
    if not (target.is_cuda and target.trace_device == "cuda"):
        return None
    op = op_without_fake_kernel(err)
    return (emulated(target), native_fallback_note(op)) if op is not None else None
