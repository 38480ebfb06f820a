"""The benchmark zoo: models, batches and training settings that memplan's accuracy is measured on.

Every case is small enough that one real CPU run (build + 2 training steps, under the profiler) takes
well under 20 s on 2 cores, and built from code or config classes only (no downloaded weights).
Batches are real CPU tensors drawn from a fixed-seed generator, so every run sees the same data.

transformers models set `attn_implementation="sdpa"` explicitly; none of them needs "eager".
`use_cache=False`: a training step keeps no KV cache (what `Trainer` users set, and what
transformers forces under gradient checkpointing).

The models and batches are in benchmarks.zoo_models; this module holds the training settings and the cases.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.zoo_models import (
    BART,
    SEED,  # noqa: F401 (benchmarks import the zoo's seed from here)
    T5,
    bart,
    bert,
    bert_batch,
    captcha_cnn,
    classification_loss,
    gpt2,
    gpt2_batch,
    hf_loss,
    images_and_labels,
    linear,
    llama,
    llama_batch,
    mixer,
    mixtral,
    mixtral_batch,
    mlp,
    next_token_loss,
    resnet18,
    rnn_lm,
    seq2seq_batch,
    t5,
    token_sequences,
    vectors_and_labels,
    vit,
    vit_batch,
)

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2),
}
"""What memplan's optimizer strings mean; the truth harness builds exactly these (foreach: torch's default)."""


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {name!r}")
    return OPTIMIZERS[name](params)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One model + batch + training setting to estimate and to measure."""

    name: str
    """Key in CASES; also the CLI name (`python -m benchmarks.cpu_truth NAME`)."""
    build: Callable[[], nn.Module]
    """Zero-argument callable returning the model in train mode (fp32, on CPU)."""
    make_batch: Callable[[int], Any]
    """batch_size -> batch of real CPU tensors, the same on every call."""
    loss: Callable[[nn.Module, Any], torch.Tensor]
    """(model, batch) -> scalar loss, the `loss=` argument of memplan.estimate."""
    batch_size: int
    """Samples per step."""
    precision: str = "32-true"
    """Lightning precision string."""
    checkpointing: bool = False
    """Activation checkpointing on every repeated block (memplan.estimator.checkpointing)."""
    optimizer: str = "adamw"
    """A key of OPTIMIZERS."""
    family: str = ""
    """Model family, for grouping in the report."""
    loop: str = "lightning"
    """Step order, as memplan.estimate's `loop=`: "lightning" or "torch" (zero_grad after the step)."""


# --------------------------------------------------------------------------------------------------
# The cases


def _cases() -> list[Case]:
    mlp_batch = vectors_and_labels
    cnn_batch = functools.partial(images_and_labels, shape=(1, 50, 180), classes=36)
    resnet_batch = functools.partial(images_and_labels, shape=(3, 64, 64), classes=100)
    rnn_batch = functools.partial(token_sequences, seq_len=65, vocab=5000)
    t5_batch = functools.partial(seq2seq_batch, vocab=T5["vocab_size"])
    bart_batch = functools.partial(seq2seq_batch, vocab=BART["vocab_size"])

    def family(name, build, make_batch, loss, variants):
        return [
            Case(name=f"{name}-{suffix}", family=name, build=build, make_batch=make_batch, loss=loss, **kw)
            for suffix, kw in variants
        ]

    return [
        *family("linear", linear, functools.partial(vectors_and_labels, classes=1000), classification_loss, [
            ("b64-sgd", dict(batch_size=64, optimizer="sgd")),
        ]),
        *family("mlp", mlp, mlp_batch, classification_loss, [
            ("b64", dict(batch_size=64)),
            ("b1024", dict(batch_size=1024)),
            ("b256-sgd", dict(batch_size=256, optimizer="sgd")),
            ("b256-sgd-momentum-16true", dict(batch_size=256, optimizer="sgd-momentum", precision="16-true")),
            ("b256-bf16mixed", dict(batch_size=256, precision="bf16-mixed")),
            # 16-mixed in a plain loop: Lightning runs bf16-mixed on a CPU (as memplan now estimates it),
            # so float16 autocast on CPU is what a plain loop with its own autocast and GradScaler runs
            ("b256-16mixed", dict(batch_size=256, precision="16-mixed", loop="torch")),
        ]),
        *family("cnn", captcha_cnn, cnn_batch, classification_loss, [
            ("b32", dict(batch_size=32)),
            ("b64-bf16mixed", dict(batch_size=64, precision="bf16-mixed")),
            ("b32-rmsprop", dict(batch_size=32, optimizer="rmsprop")),
        ]),
        *family("resnet18", resnet18, resnet_batch, classification_loss, [
            ("b8", dict(batch_size=8)),
            ("b16-sgd-momentum", dict(batch_size=16, optimizer="sgd-momentum")),
            ("b16-ckpt", dict(batch_size=16, checkpointing=True)),
            ("b16-bf16mixed", dict(batch_size=16, precision="bf16-mixed")),
        ]),
        *family("lstm", functools.partial(rnn_lm, "lstm"), rnn_batch, next_token_loss, [
            ("b32", dict(batch_size=32)),
            ("b32-adagrad", dict(batch_size=32, optimizer="adagrad")),
        ]),
        *family("gru", functools.partial(rnn_lm, "gru"), rnn_batch, next_token_loss, [
            ("b32", dict(batch_size=32)),
            ("b32-bf16mixed", dict(batch_size=32, precision="bf16-mixed")),
        ]),
        *family("gpt2", gpt2, gpt2_batch, hf_loss, [
            ("b4", dict(batch_size=4)),
            ("b8", dict(batch_size=8)),
            ("b8-ckpt", dict(batch_size=8, checkpointing=True)),
            ("b8-bf16mixed", dict(batch_size=8, precision="bf16-mixed")),
            ("b8-bf16mixed-ckpt", dict(batch_size=8, precision="bf16-mixed", checkpointing=True)),
        ]),
        *family("bert", bert, bert_batch, hf_loss, [
            ("b8", dict(batch_size=8)),
            ("b16-ckpt", dict(batch_size=16, checkpointing=True)),
            ("b16-adam", dict(batch_size=16, optimizer="adam")),
        ]),
        *family("llama-gqa", llama, llama_batch, hf_loss, [
            ("b2", dict(batch_size=2)),
            ("b4-bf16mixed", dict(batch_size=4, precision="bf16-mixed")),
            ("b4-ckpt", dict(batch_size=4, checkpointing=True)),
            ("b2-bf16true", dict(batch_size=2, precision="bf16-true")),
        ]),
        *family("mixtral-moe", mixtral, mixtral_batch, hf_loss, [
            ("b4", dict(batch_size=4)),
        ]),
        *family("mixer", mixer, resnet_batch, classification_loss, [
            ("b16", dict(batch_size=16)),
            ("b16-bf16mixed", dict(batch_size=16, precision="bf16-mixed")),
            ("b16-bf16mixed-ckpt", dict(batch_size=16, precision="bf16-mixed", checkpointing=True)),
        ]),
        *family("vit", vit, vit_batch, hf_loss, [
            ("b16", dict(batch_size=16)),
            ("b8-16mixed", dict(batch_size=8, precision="16-mixed", loop="torch")),  # as mlp-b256-16mixed
            ("b32-bf16mixed-ckpt", dict(batch_size=32, precision="bf16-mixed", checkpointing=True)),
        ]),
        *family("t5", t5, t5_batch, hf_loss, [
            ("b4", dict(batch_size=4)),
            ("b8-ckpt", dict(batch_size=8, checkpointing=True)),
        ]),
        *family("bart", bart, bart_batch, hf_loss, [
            ("b4", dict(batch_size=4)),
            ("b4-bf16mixed", dict(batch_size=4, precision="bf16-mixed")),
        ]),
    ]


CASES: dict[str, Case] = {case.name: case for case in _cases()}
