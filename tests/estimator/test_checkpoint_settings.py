"""Partial, every-k-th and per-op (selective) checkpointing: estimates against real CPU steps.

The models are small transformers-config models (GPT-2, Llama, ViT) that no other test or the
estimator's code is tuned on; use_cache=False as transformers sets it under its own checkpointing.
"""
from __future__ import annotations

import functools

import pytest
import torch

from memplan.checkpoint_setting import Checkpointing
from memplan.estimator import estimate
from memplan.estimator.checkpointing import OpPolicy, apply_checkpointing, find_repeated_blocks
from memplan.truth.measure import measure_cpu_peak

transformers = pytest.importorskip("transformers")


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_positions=24, n_embd=48, n_layer=4, n_head=4, attn_implementation="sdpa", use_cache=False))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=80, hidden_size=40, intermediate_size=72, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False))


def _vit():
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=64, num_labels=5))


def _tokens(vocab):
    def make():
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (3, 20), generator=g)
        return {"input_ids": ids, "labels": ids}
    return make


def _images():
    g = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(3, 3, 16, 16, generator=g), "labels": torch.randint(0, 5, (3,), generator=g)}


MODELS = {"gpt2": (_gpt2, _tokens(96)), "llama": (_llama, _tokens(80)), "vit": (_vit, _images)}


@functools.cache
def traced(name: str, setting: str, precision: str):
    """The estimate of MODELS[name] with AdamW under a checkpointing setting and precision, traced once per
    process: both tests below read blocks:1 in 32-true (tests/conftest.py keeps this module on one xdist worker)."""
    build, make_batch = MODELS[name]
    return estimate(build, make_batch(), checkpointing=setting, device="cpu", precision=precision, optimizer="adamw")


@pytest.mark.parametrize("setting", ["blocks:1", "every:2", "op"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_partial_and_selective_estimates_match_real_cpu_steps(name, setting):
    build, make_batch = MODELS[name]
    precision = "bf16-mixed" if setting == "op" else "32-true"
    est = traced(name, setting, precision)
    truth = measure_cpu_peak(build, make_batch, checkpointing=setting, precision=precision, optimizer="adamw")
    assert abs(est.peak_allocated / truth - 1) < 0.001, (est.peak_allocated, truth)
    assert est.checkpoint_mode == setting


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_settings_order_memory_as_they_recompute(name):
    """none > blocks:1 > blocks:3 > full, and op between none and full: each setting changes what is kept."""
    peak = {s: traced(name, s, "32-true").peak_allocated for s in ("none", "blocks:1", "blocks:3", "full", "op")}
    assert peak["none"] > peak["blocks:1"] > peak["blocks:3"] > peak["full"]
    assert peak["none"] > peak["op"] > peak["full"]


def test_partial_settings_wrap_the_blocks_they_name():
    model = _llama()
    names = [n for n, _ in find_repeated_blocks(model)]
    assert apply_checkpointing(model, Checkpointing.parse("blocks:3")) == names[:3]
    model = _llama()
    assert apply_checkpointing(model, "every:2") == [names[1], names[3]]
    model = _llama()
    assert apply_checkpointing(model, "op") == names


def test_the_op_policy_keeps_every_other_mm_and_the_attention_outputs():
    policy = OpPolicy()
    assert [policy.keeps("mm") for _ in range(4)] == [True, False, True, False]
    assert [policy.keeps("mm", recompute=True) for _ in range(2)] == [True, False]  # counted apart
    assert policy.keeps("_scaled_dot_product_flash_attention_for_cpu") and policy.keeps("addmm")
    assert not policy.keeps("gelu") and not policy.keeps("add")
