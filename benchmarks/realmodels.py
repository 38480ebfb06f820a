"""memplan on real architectures: transformers config classes and plain torch, against real CPU runs.

    python -m benchmarks.realmodels                 # every case; writes results/realmodels.{md,json}
    python -m benchmarks.realmodels --only NAME ... # some cases (add --write to write the results)

None of these models is in memplan's own zoo (benchmarks/zoo.py): they are what users bring. Each is
built from a config class at a small size (no weights, no hub access) by a zero-argument callable,
trained by a real `Trainer.fit` (benchmarks/zoo.Case + benchmarks/cpu_truth.measure: profiler
"Total Allocated" peak over build + 2 steps, in a fresh process, seeds fixed), and estimated with
`memplan.estimate(build, batch, device="cpu")` in another fresh process. A subset (`-torch` cases)
runs in a plain PyTorch loop instead (zero_grad(set_to_none=True) after the optimizer step), estimated
with `loop="torch"`.

The `-experts-peak` MoE cases have a small vocabulary and long sequences, so that the peak falls
inside the experts (not at the loss's logits) and routing decides it; they report the error with
data_dependent="balanced" and "sample".

Mixture-of-experts cases run both of transformers' experts paths. transformers 5.x picks the path
from `config._experts_implementation` (`experts_implementation=` in the config or `from_pretrained`):
None resolves to "grouped_mm" where `torch._grouped_mm` can dispatch (it can on CPU with torch >= 2.9,
in float32 too; modeling_utils.get_correct_experts_implementation), else "eager" (a Python loop over
the experts hit, with `nonzero` on the routing mask). Their routing in the truth is the random
router of a seeded initialisation; the estimate assumes balanced routing (data_dependent="balanced",
named in its notes).

wav2vec2 and HuBERT run with `layerdrop=0.0`: LayerDrop skips each layer when `torch.rand([])` falls
below it, so a real step's memory is a random draw. The estimate decides such draws as the worst case,
no layer dropped, whatever the seed (memplan.estimator.values), which is what the truth runs with
LayerDrop off.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.accuracy_cpu import _run_json
from benchmarks.results_io import machine, write_results
from benchmarks.zoo import SEED, Case

GOAL_MEDIAN = 0.001
GOAL_WORST = 0.03
MiB = 1 << 20
VOCAB = 1000
SEQ = 64


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


# --------------------------------------------------------------------------------------------------
# builders and batches


def _hf(model_class: str, config_class: str, attn: str | None = "sdpa", **config) -> nn.Module:
    import transformers

    if attn is not None:
        config["attn_implementation"] = attn
    cfg = getattr(transformers, config_class)(**config)
    return getattr(transformers, model_class)(cfg).train()


def hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def lm_batch(batch_size: int, *, seq_len: int = SEQ, vocab: int = VOCAB) -> dict:
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=_gen())
    return {"input_ids": ids, "labels": ids}


def cls_batch(batch_size: int, *, seq_len: int = SEQ, vocab: int = VOCAB, labels: int = 4) -> dict:
    """Padded: row i keeps seq_len - 4 * (i % 4) tokens, so the attention mask is not all ones."""
    g = _gen()
    ids = torch.randint(1, vocab, (batch_size, seq_len), generator=g)
    lengths = seq_len - 4 * (torch.arange(batch_size) % 4)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": torch.randint(0, labels, (batch_size,), generator=g)}


def electra_batch(batch_size: int) -> dict:
    """Replaced-token detection: the loss keeps only the positions the batch's attention mask keeps."""
    batch = cls_batch(batch_size)
    batch["labels"] = torch.randint(0, 2, batch["input_ids"].shape, generator=_gen())
    return batch


def seq2seq_batch(batch_size: int, *, vocab: int = VOCAB, source_len: int = SEQ, target_len: int = 32) -> dict:
    g = _gen()
    source = torch.randint(3, vocab, (batch_size, source_len), generator=g)
    return {"input_ids": source, "attention_mask": torch.ones_like(source),
            "labels": torch.randint(3, vocab, (batch_size, target_len), generator=g)}


def speech_ctc_batch(batch_size: int, *, samples: int = 8000, vocab: int = 32) -> dict:
    """Labels padded with -100: the CTC target lengths come from the batch."""
    g = _gen()
    labels = torch.randint(1, vocab, (batch_size, 24), generator=g)
    for i in range(batch_size):
        labels[i, 24 - 4 * (i % 4):] = -100
    return {"input_values": torch.randn(batch_size, samples, generator=g), "labels": labels}


def whisper_batch(batch_size: int) -> dict:
    g = _gen()
    return {"input_features": torch.randn(batch_size, 16, 200, generator=g),
            "labels": torch.randint(3, VOCAB, (batch_size, 16), generator=g)}


def image_batch(batch_size: int, *, size: int = 32, labels: int = 10) -> dict:
    g = _gen()
    return {"pixel_values": torch.randn(batch_size, 3, size, size, generator=g),
            "labels": torch.randint(0, labels, (batch_size,), generator=g)}


def clip_batch(batch_size: int) -> dict:
    g = _gen()
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, 16), generator=g),
            "pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g), "return_loss": True}


def detr_batch(batch_size: int) -> dict:
    g = _gen()
    labels = [{"class_labels": torch.randint(0, 5, (n,), generator=g),
               "boxes": torch.rand(n, 4, generator=g) * 0.4 + 0.3} for n in (3 + i % 3 for i in range(batch_size))]
    return {"pixel_values": torch.randn(batch_size, 3, 64, 64, generator=g), "labels": labels}


def plain_batch(batch_size: int, *, features: int = 64, classes: int = 10):
    g = _gen()
    return torch.randn(batch_size, features, generator=g), torch.randint(0, classes, (batch_size,), generator=g)


def plain_loss(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def token_batch(batch_size: int):
    g = _gen()
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g), torch.randint(0, 10, (batch_size,), generator=g)


# --------------------------------------------------------------------------------------------------
# plain torch models


class RNNClassifier(nn.Module):
    def __init__(self, cell: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell](64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return self.head(out[:, -1])


class TransformerClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, 10)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(1))


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channel_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class MlpMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 128, 4, stride=4)
        self.blocks = nn.Sequential(*(MixerBlock(64, 128) for _ in range(3)))
        self.head = nn.Linear(128, 10)

    def forward(self, pixel_values, labels):
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)
        return F.cross_entropy(self.head(self.blocks(x).mean(1)), labels)


class TopKMoE(nn.Module):
    """A plain-torch mixture of experts (Switch/GShard style top-2 router, eager loop over experts)."""

    def __init__(self, dim: int = 128, experts: int = 8, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.embed = nn.Embedding(VOCAB, dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(experts))
        self.head = nn.Linear(dim, 10)

    def forward(self, ids):
        x = self.embed(ids).flatten(0, 1)
        weights, chosen = self.router(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return self.head(out.view(*ids.shape, -1).mean(1))


def plain_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def plain_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10))


def image_tuple(batch_size: int):
    b = image_batch(batch_size)
    return b["pixel_values"], b["labels"]


def mixer_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch)


# --------------------------------------------------------------------------------------------------
# the cases

_DEC = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, use_cache=False)
_ENC = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, num_labels=4)
_MOE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, use_cache=False, num_experts_per_tok=2)
_MOE_PEAK = dict(_MOE, vocab_size=64, max_position_embeddings=512)
"""A vocabulary small enough that the logits are not the peak."""
_VIT = dict(image_size=32, patch_size=4, num_channels=3, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=256, num_labels=10)


def _moe_peak_batch(batch_size: int) -> dict:
    return lm_batch(batch_size, seq_len=256, vocab=64)


TORCH_ORDER = ("gpt2", "llama-gqa", "bert", "t5", "vit", "resnet-hf", "convnext", "plain-lstm", "mixtral-eager",
               "mixtral-grouped_mm", "mixtral-experts-peak-grouped_mm", "plain-topk-moe")
"""Cases also run in plain PyTorch order (`-torch`)."""


def _hf_case(model_class, config_class, attn="sdpa", batch=lm_batch, **config):
    """(build, make_batch, loss) of a transformers model whose output has `.loss`."""
    return functools.partial(_hf, model_class, config_class, attn, **config), batch, hf_loss


def _cases() -> list[tuple]:
    """(name, family, build, make_batch, loss, settings)."""
    d = _DEC
    cases = [
        # decoder LMs
        ("gpt2", "decoder", *_hf_case("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=128, n_layer=2,
                                      n_head=4, n_positions=256, use_cache=False), {}),
        ("llama-gqa", "decoder", *_hf_case("LlamaForCausalLM", "LlamaConfig", **d, num_key_value_heads=2), {}),
        ("llama-gqa-bf16mixed-ckpt", "decoder", *_hf_case("LlamaForCausalLM", "LlamaConfig", **d, num_key_value_heads=2),
         {"precision": "bf16-mixed", "checkpointing": True}),
        ("mistral-sliding-window", "decoder", *_hf_case("MistralForCausalLM", "MistralConfig", **d, num_key_value_heads=2,
                                                         sliding_window=16), {}),
        ("qwen2", "decoder", *_hf_case("Qwen2ForCausalLM", "Qwen2Config", **d, num_key_value_heads=2), {}),
        ("qwen3", "decoder", *_hf_case("Qwen3ForCausalLM", "Qwen3Config", **d, num_key_value_heads=2, head_dim=32), {}),
        ("gemma-mqa", "decoder", *_hf_case("GemmaForCausalLM", "GemmaConfig", **d, num_key_value_heads=1, head_dim=32), {}),
        ("gemma2-sliding-softcap", "decoder", *_hf_case("Gemma2ForCausalLM", "Gemma2Config", "eager", **d,
                                                         num_key_value_heads=2, head_dim=32, sliding_window=16), {}),
        ("phi", "decoder", *_hf_case("PhiForCausalLM", "PhiConfig", **d), {}),
        ("phi3", "decoder", *_hf_case("Phi3ForCausalLM", "Phi3Config", **d, num_key_value_heads=2, pad_token_id=0), {}),
        ("falcon-mqa", "decoder", *_hf_case("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                                            use_cache=False), {}),
        ("falcon-alibi", "decoder", *_hf_case("FalconForCausalLM", "FalconConfig", "eager", vocab_size=VOCAB,
                                              hidden_size=128, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                                              use_cache=False), {}),
        ("bloom-alibi", "decoder", *_hf_case("BloomForCausalLM", "BloomConfig", "eager", vocab_size=VOCAB,
                                             hidden_size=128, n_layer=2, n_head=4, use_cache=False), {}),
        ("mpt-alibi", "decoder", *_hf_case("MptForCausalLM", "MptConfig", "eager", vocab_size=VOCAB, d_model=128,
                                           n_layers=2, n_heads=4, max_seq_len=256, use_cache=False), {}),
        ("gpt-neox", "decoder", *_hf_case("GPTNeoXForCausalLM", "GPTNeoXConfig", **d), {}),
        ("gptj", "decoder", *_hf_case("GPTJForCausalLM", "GPTJConfig", "eager", vocab_size=VOCAB, n_embd=128, n_layer=2,
                                      n_head=4, rotary_dim=16, n_positions=256, use_cache=False), {}),
        ("opt", "decoder", *_hf_case("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=128, ffn_dim=256,
                                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                                     word_embed_proj_dim=128, use_cache=False), {}),
        ("stablelm", "decoder", *_hf_case("StableLmForCausalLM", "StableLmConfig", **d, num_key_value_heads=2), {}),
        ("starcoder2", "decoder", *_hf_case("Starcoder2ForCausalLM", "Starcoder2Config", **d, num_key_value_heads=2), {}),
        ("olmo", "decoder", *_hf_case("OlmoForCausalLM", "OlmoConfig", **d), {}),
        ("cohere", "decoder", *_hf_case("CohereForCausalLM", "CohereConfig", **d, num_key_value_heads=2), {}),
        ("codegen", "decoder", *_hf_case("CodeGenForCausalLM", "CodeGenConfig", "eager", vocab_size=VOCAB, n_embd=128,
                                         n_layer=2, n_head=4, rotary_dim=16, n_positions=256, n_ctx=256,
                                         use_cache=False), {}),
        ("gpt-bigcode-mqa", "decoder", *_hf_case("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=VOCAB,
                                                 n_embd=128, n_layer=2, n_head=4, n_positions=256, multi_query=True,
                                                 use_cache=False), {}),
        ("granite", "decoder", *_hf_case("GraniteForCausalLM", "GraniteConfig", **d, num_key_value_heads=2), {}),
        ("mamba", "state-space", *_hf_case("MambaForCausalLM", "MambaConfig", None, vocab_size=VOCAB, hidden_size=128,
                                           state_size=8, num_hidden_layers=2, use_cache=False), {}),
        ("mamba2", "state-space", *_hf_case("Mamba2ForCausalLM", "Mamba2Config", None, vocab_size=VOCAB, hidden_size=128,
                                            state_size=16, num_heads=8, head_dim=32, n_groups=1, num_hidden_layers=2,
                                            chunk_size=32, use_cache=False), {}),
    ]
    # mixture of experts, both experts paths
    for impl in ("eager", "grouped_mm"):
        cases += [
            (f"mixtral-{impl}", "moe", *_hf_case("MixtralForCausalLM", "MixtralConfig", **_MOE, num_local_experts=4,
                                                 experts_implementation=impl), {}),
            (f"qwen2-moe-{impl}", "moe", *_hf_case("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **_MOE, num_experts=4,
                                                   moe_intermediate_size=128, shared_expert_intermediate_size=256,
                                                   experts_implementation=impl), {}),
            (f"olmoe-{impl}", "moe", *_hf_case("OlmoeForCausalLM", "OlmoeConfig", **_MOE, num_experts=8,
                                               experts_implementation=impl), {}),
            (f"qwen3-moe-{impl}", "moe", *_hf_case("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **_MOE, num_experts=8,
                                                   moe_intermediate_size=128, head_dim=32,
                                                   experts_implementation=impl), {}),
        ]
    cases += [
        ("mixtral-grouped_mm-bf16mixed-ckpt", "moe", *_hf_case("MixtralForCausalLM", "MixtralConfig", **_MOE,
                                                               num_local_experts=4, experts_implementation="grouped_mm"),
         {"precision": "bf16-mixed", "checkpointing": True}),
        ("plain-topk-moe", "moe", TopKMoE, token_batch, plain_loss, {}),
    ]
    for impl in ("eager", "grouped_mm"):  # the experts, not the logits, at the peak: routing decides it
        cases += [
            (f"mixtral-experts-peak-{impl}", "moe", *_hf_case(
                "MixtralForCausalLM", "MixtralConfig", **{**_MOE_PEAK, "intermediate_size": 512}, num_local_experts=8,
                experts_implementation=impl, batch=_moe_peak_batch), {}),
            (f"qwen3-moe-experts-peak-{impl}", "moe", *_hf_case(
                "Qwen3MoeForCausalLM", "Qwen3MoeConfig", **_MOE_PEAK, num_experts=16, moe_intermediate_size=256,
                head_dim=32, experts_implementation=impl, batch=_moe_peak_batch), {}),
            (f"mixtral-experts-peak-{impl}-ckpt", "moe", *_hf_case(
                "MixtralForCausalLM", "MixtralConfig", **{**_MOE_PEAK, "intermediate_size": 2048}, num_local_experts=8,
                experts_implementation=impl, batch=_moe_peak_batch), {"checkpointing": True}),
        ]
    cases += [
        # encoders
        ("bert", "encoder", *_hf_case("BertForSequenceClassification", "BertConfig", batch=cls_batch, **_ENC), {}),
        ("roberta", "encoder", *_hf_case("RobertaForSequenceClassification", "RobertaConfig", batch=cls_batch,
                                         **{**_ENC, "pad_token_id": 0}), {}),
        ("distilbert", "encoder", *_hf_case("DistilBertForSequenceClassification", "DistilBertConfig", batch=cls_batch,
                                            vocab_size=VOCAB, dim=128, hidden_dim=256, n_layers=2, n_heads=4,
                                            num_labels=4), {}),
        ("albert", "encoder", *_hf_case("AlbertForSequenceClassification", "AlbertConfig", batch=cls_batch, **_ENC,
                                        embedding_size=64), {}),
        ("electra-rtd-masked-loss", "encoder", *_hf_case("ElectraForPreTraining", "ElectraConfig", batch=electra_batch,
                                                         **_ENC, embedding_size=64), {}),
        ("deberta-v2", "encoder", *_hf_case("DebertaV2ForSequenceClassification", "DebertaV2Config", None,
                                            batch=cls_batch, **_ENC), {}),
        ("mpnet", "encoder", *_hf_case("MPNetForSequenceClassification", "MPNetConfig", None, batch=cls_batch,
                                       **_ENC), {}),
        # encoder-decoders
        ("t5", "encoder-decoder", *_hf_case("T5ForConditionalGeneration", "T5Config", batch=seq2seq_batch,
                                            vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=256, num_layers=2,
                                            num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                            use_cache=False), {}),
        ("bart", "encoder-decoder", *_hf_case("BartForConditionalGeneration", "BartConfig", batch=seq2seq_batch,
                                              vocab_size=VOCAB, d_model=128, encoder_layers=2, decoder_layers=2,
                                              encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
                                              decoder_ffn_dim=256, max_position_embeddings=256, use_cache=False), {}),
        ("pegasus", "encoder-decoder", *_hf_case("PegasusForConditionalGeneration", "PegasusConfig",
                                                 batch=seq2seq_batch, vocab_size=VOCAB, d_model=128, encoder_layers=2,
                                                 decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                                 encoder_ffn_dim=256, decoder_ffn_dim=256, max_position_embeddings=256,
                                                 use_cache=False), {}),
        ("marian", "encoder-decoder", *_hf_case("MarianMTModel", "MarianConfig", batch=seq2seq_batch, vocab_size=VOCAB,
                                                d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                                decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256,
                                                max_position_embeddings=256, decoder_start_token_id=0, pad_token_id=0,
                                                use_cache=False), {}),
        ("switch-transformers-moe", "moe", *_hf_case("SwitchTransformersForConditionalGeneration",
                                                     "SwitchTransformersConfig", None, batch=seq2seq_batch,
                                                     vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=256, num_layers=2,
                                                     num_decoder_layers=2, num_heads=4, num_experts=4,
                                                     encoder_sparse_step=1, decoder_sparse_step=1,
                                                     decoder_start_token_id=0, pad_token_id=0, use_cache=False), {}),
        # speech
        ("wav2vec2-ctc", "speech", *_hf_case("Wav2Vec2ForCTC", "Wav2Vec2Config", None, batch=speech_ctc_batch,
                                             vocab_size=32, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=256, conv_dim=(64, 64, 64), conv_stride=(5, 2, 2),
                                             conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
                                             num_conv_pos_embedding_groups=4, ctc_loss_reduction="mean", pad_token_id=0,
                                             mask_time_prob=0.0, layerdrop=0.0), {}),
        ("hubert-ctc", "speech", *_hf_case("HubertForCTC", "HubertConfig", None, batch=speech_ctc_batch, vocab_size=32,
                                           hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=256, conv_dim=(64, 64, 64), conv_stride=(5, 2, 2),
                                           conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
                                           num_conv_pos_embedding_groups=4, ctc_loss_reduction="mean", pad_token_id=0,
                                           mask_time_prob=0.0, layerdrop=0.0), {}),
        ("whisper", "speech", *_hf_case("WhisperForConditionalGeneration", "WhisperConfig", batch=whisper_batch,
                                        vocab_size=VOCAB, num_mel_bins=16, d_model=128, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
                                        decoder_ffn_dim=256, max_source_positions=100, max_target_positions=64,
                                        decoder_start_token_id=1, pad_token_id=0, use_cache=False), {}),
        # vision
        ("vit", "vision", *_hf_case("ViTForImageClassification", "ViTConfig", batch=image_batch, **_VIT), {}),
        ("deit", "vision", *_hf_case("DeiTForImageClassification", "DeiTConfig", batch=image_batch, **_VIT), {}),
        ("dinov2", "vision", *_hf_case("Dinov2ForImageClassification", "Dinov2Config", batch=image_batch,
                                       **{**_VIT, "mlp_ratio": 2}), {}),
        ("swin", "vision", *_hf_case("SwinForImageClassification", "SwinConfig", None, batch=image_batch, image_size=32,
                                     patch_size=2, embed_dim=32, depths=[1, 1], num_heads=[2, 4], window_size=4,
                                     num_labels=10), {}),
        ("convnext", "cnn", *_hf_case("ConvNextForImageClassification", "ConvNextConfig", None, batch=image_batch,
                                      hidden_sizes=[32, 64], depths=[1, 1], num_stages=2, num_labels=10), {}),
        ("resnet-hf", "cnn", *_hf_case("ResNetForImageClassification", "ResNetConfig", None, batch=image_batch,
                                       embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10), {}),
        ("clip", "vision", functools.partial(
            _hf, "CLIPModel", "CLIPConfig", "sdpa",
            text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=32),
            vision_config=dict(image_size=32, patch_size=4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4),
            projection_dim=32), clip_batch, hf_loss, {}),
        ("detr-hungarian", "detection", functools.partial(
            _hf, "DetrForObjectDetection", "DetrConfig", None, use_timm_backbone=False, use_pretrained_backbone=False,
            backbone_config={"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [16, 32, 32, 64],
                             "depths": [1, 1, 1, 1], "out_features": ["stage4"]},
            d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128, num_queries=10, num_labels=5, auxiliary_loss=False),
         detr_batch, hf_loss, {}),
        # plain torch
        ("plain-mlp", "plain torch", plain_mlp, plain_batch, plain_loss, {}),
        ("plain-cnn-batchnorm", "plain torch", plain_cnn, image_tuple, plain_loss, {}),
        ("plain-lstm", "plain torch", functools.partial(RNNClassifier, "lstm"), token_batch, plain_loss, {}),
        ("plain-gru", "plain torch", functools.partial(RNNClassifier, "gru"), token_batch, plain_loss, {}),
        ("plain-transformer-encoder", "plain torch", TransformerClassifier, token_batch, plain_loss, {}),
        ("plain-mlp-mixer", "plain torch", MlpMixer, image_batch, mixer_loss, {}),
    ]
    by_name = {c[0]: c for c in cases}
    cases += [(f"{name}-torch", *by_name[name][1:5], {**by_name[name][5], "loop": "torch"}) for name in TORCH_ORDER]
    return cases


def _make_cases() -> dict[str, Case]:
    out = {}
    for name, family, build, make_batch, loss, settings in _cases():
        settings = {"batch_size": 4, **settings}
        out[name] = Case(name=name, family=family, build=build, make_batch=make_batch, loss=loss, **settings)
    return out


CASES: dict[str, Case] = _make_cases()


# --------------------------------------------------------------------------------------------------
# one case, in a fresh process


def truth_one(name: str) -> dict:
    from benchmarks.cpu_truth import measure

    return measure(CASES[name])


def estimate_one(name: str, data_dependent: str = "balanced") -> dict:
    from memplan.estimator import estimate

    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    case = CASES[name]
    batch = case.make_batch(case.batch_size)
    started = time.perf_counter()
    result = estimate(
        case.build, batch, loss=case.loss, optimizer=case.optimizer, precision=case.precision,
        checkpointing=case.checkpointing, device="cpu", data_dependent=data_dependent, loop=case.loop,
    )
    return {
        "estimate": result.to_dict(),
        "wall_seconds": round(time.perf_counter() - started, 3),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def run_case(name: str) -> dict:
    truth, truth_wall, truth_error = _run_json(["benchmarks.realmodels", "--truth-one", name])
    est, est_wall, est_error = _run_json(["benchmarks.realmodels", "--estimate-one", name])
    case = CASES[name]
    row: dict[str, Any] = {
        "case": name, "family": case.family, "precision": case.precision, "checkpointing": case.checkpointing,
        "loop": case.loop,
        "truth": truth, "estimate": est["estimate"] if est else None,
        "truth_process_seconds": round(truth_wall, 2), "estimate_process_seconds": round(est_wall, 2),
    }
    if not compare(row, truth_error, est_error):
        return row
    if case.family == "moe":  # the other routing assumption, for comparison
        peak = truth["peak_allocated"]
        sample, _, sample_error = _run_json(["benchmarks.realmodels", "--estimate-one", name, "--data-dependent", "sample"])
        row["error_sample"] = (sample["estimate"]["peak_allocated"] - peak) / peak if sample else None
        row["error_sample_message"] = sample_error or None
    return row


# --------------------------------------------------------------------------------------------------
# the report


def compare(row: dict, truth_error: str | None, est_error: str | None) -> bool:
    """Fill `row` (holding "truth" and "estimate") with the estimate's error against the truth's peak, or with
    which side failed and why; whether both ran."""
    if truth_error or est_error:
        row["failed"] = "truth" if truth_error else "estimate"
        row["error_message"] = truth_error or est_error
        return False
    peak = row["truth"]["peak_allocated"]
    row["error"] = (row["estimate"]["peak_allocated"] - peak) / peak
    row["error_bytes"] = row["estimate"]["peak_allocated"] - peak
    return True


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" in r]

    def stats(subset: list[dict]) -> dict:
        magnitudes = [abs(r["error"]) for r in subset]
        return {
            "measured": len(subset),
            "median_abs_error": statistics.median(magnitudes) if magnitudes else None,
            "worst_abs_error": max(magnitudes, default=None),
        }

    moe = [r for r in ok if r["family"] == "moe"]
    torch_order = [r for r in ok if r.get("loop") == "torch"]
    summary = {"cases": len(rows), "estimated": sum(1 for r in rows if r.get("estimate")), "all": stats(ok),
               "moe": stats(moe), "torch_order": stats(torch_order), "failed": [r["case"] for r in rows if "failed" in r]}
    a = summary["all"]
    summary["goal_met"] = bool(
        ok and len(ok) == len(rows) and a["median_abs_error"] <= GOAL_MEDIAN and a["worst_abs_error"] <= GOAL_WORST
        and (not moe or summary["moe"]["worst_abs_error"] <= GOAL_WORST)
    )
    return summary


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.3f}%"


def render_markdown(report: dict) -> str:
    rows, s = report["rows"], report["summary"]
    m = report["machine"]
    lines = [
        "# memplan on real architectures (CPU)",
        "",
        f"{report['date']} · torch {m['torch']} · transformers {m['transformers']} · {m['cpu']} ({m['cpu_count']} cores)",
        "",
        "Each model built from a transformers config class (small sizes, no weights) or plain torch, by a "
        "zero-argument callable. Truth: profiler \"Total Allocated\" peak over build + 2 steps in a fresh "
        "process, trained by a real Lightning `Trainer.fit` (benchmarks/cpu_truth.py, seed 0). Estimate: `memplan.estimate(build, batch, "
        "device='cpu', data_dependent='balanced')` in another fresh process. Error = (estimate - truth) / truth. "
        "Cases marked 'torch order' are trained by a plain PyTorch loop (zero_grad(set_to_none=True) after the "
        "optimizer step) and estimated with `loop='torch'`. "
        "CPU convolutions and LSTM layers: the estimate measures oneDNN's in-kernel scratch by running each op "
        "shape once on real zeros (memplan.estimator.kernels.probe; the column 'scratch at peak' is the truth's). "
        "MoE truth routes with the seeded random router; the estimate assumes balanced routing (its notes say so).",
        "",
        "| case | family | precision | params | truth MiB | memplan MiB | error | error bytes "
        "| error with data_dependent='sample' | scratch at peak MiB | truth peak in | assumptions in notes |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        t, e = r.get("truth"), r.get("estimate")
        setting = r["precision"] + (" ckpt" if r["checkpointing"] else "") + (" torch order" if r.get("loop") == "torch" else "")
        if "error" not in r:
            message = (r.get("error_message") or "").strip().splitlines()[-1:] or [""]
            lines.append(f"| {r['case']} | {r['family']} | {setting} | | | | failed ({r.get('failed')}) | "
                         f"{message[0][:160].replace('|', '/')} | | | | |")
            continue
        assumed = "; ".join(n.split(" (in ")[0] for n in e["notes"] if "data_dependent=" in n) or "-"
        lines.append(
            f"| {r['case']} | {r['family']} | {setting} | {t['num_parameters']:,} | {t['peak_allocated'] / MiB:.2f} "
            f"| {e['peak_allocated'] / MiB:.2f} | {_pct(r['error'])} | {r['error_bytes']:+,} | {_pct(r.get('error_sample'))} "
            f"| {t['scratch_at_peak'] / MiB:.2f} | {t['peak_phase']}: {(t['peak_op_stack'] or ['-'])[-1]} | {assumed} |"
        )
    a, moe = s["all"], s["moe"]
    lines += [
        "",
        f"{s['cases']} cases, {s['estimated']} estimated, {a['measured']} compared with a truth. "
        f"Goal: median |error| <= {GOAL_MEDIAN:.1%}, worst <= {GOAL_WORST:.0%}, MoE worst <= {GOAL_WORST:.0%}: "
        f"{'met' if s['goal_met'] else 'NOT met'}.",
        "",
        "| subset | compared | median abs error | worst abs error |",
        "|---|---:|---:|---:|",
        f"| all | {a['measured']} | {_pct(a['median_abs_error'])} | {_pct(a['worst_abs_error'])} |",
        f"| MoE (both experts paths) | {moe['measured']} | {_pct(moe['median_abs_error'])} | {_pct(moe['worst_abs_error'])} |",
    ]
    if s.get("torch_order", {}).get("measured"):
        o = s["torch_order"]
        lines.append(f"| torch order | {o['measured']} | {_pct(o['median_abs_error'])} | {_pct(o['worst_abs_error'])} |")
    if s["failed"]:
        lines += ["", "Failed: " + ", ".join(s["failed"])]
    return "\n".join(lines) + "\n"


def _report(rows: list[dict]) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "rows": rows,
        "summary": summarize(rows),
    }


def _previous_rows() -> dict[str, dict]:
    """The committed rows by case name (--only --write replaces just the cases it runs)."""
    from benchmarks.results_io import RESULTS

    path = RESULTS / "realmodels.json"
    if not path.exists():
        return {}
    return {r["case"]: r for r in json.loads(path.read_text())["rows"] if r["case"] in CASES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), metavar="CASE", help="run these cases only")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/ also with --only")
    parser.add_argument("--truth-one", choices=sorted(CASES), metavar="CASE", help=argparse.SUPPRESS)
    parser.add_argument("--estimate-one", choices=sorted(CASES), metavar="CASE", help=argparse.SUPPRESS)
    parser.add_argument("--data-dependent", default="balanced", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.truth_one or args.estimate_one:
        out = truth_one(args.truth_one) if args.truth_one else estimate_one(args.estimate_one, args.data_dependent)
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0

    write = args.write or not args.only
    kept = _previous_rows() if args.only and args.write else {}
    rows = []
    for name in args.only or list(CASES):
        row = run_case(name)
        rows.append(row)
        kept[name] = row
        status = _pct(row["error"]) if "error" in row else f"FAILED ({row['failed']}): {row['error_message'][-300:]}"
        print(f"{name:36s} truth {row['truth_process_seconds']:6.1f} s  estimate "
              f"{row['estimate_process_seconds']:6.1f} s  error {status}", flush=True)
        if write:  # after every case, so an interrupted run leaves what it measured
            report = _report([kept[n] for n in CASES if n in kept])
            write_results("realmodels", report, render_markdown(report), indent=1)
    report = _report(rows)
    print(render_markdown(report))
    return 0 if all("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
