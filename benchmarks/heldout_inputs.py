"""The held-out sweep's batches and shared config settings (benchmarks/heldout_sweep.py)."""
from __future__ import annotations

import torch

from benchmarks.realmodels_cases import _DEC
from benchmarks.realmodels_models import SEQ, VOCAB, _gen, image_batch


def pixels_only(batch_size: int) -> dict:
    return {"pixel_values": image_batch(batch_size)["pixel_values"]}


def ids_labels(batch_size: int, *, seq_len: int = SEQ, vocab: int = VOCAB) -> dict:
    """Unpadded ids and class labels (models that take no attention mask)."""
    g = _gen()
    return {"input_ids": torch.randint(1, vocab, (batch_size, seq_len), generator=g),
            "labels": torch.randint(0, 4, (batch_size,), generator=g)}


def speech_features_batch(batch_size: int) -> dict:
    g = _gen()
    return {"input_features": torch.randn(batch_size, 120, 16, generator=g),
            "labels": torch.randint(3, VOCAB, (batch_size, 16), generator=g)}


def patchtst_batch(batch_size: int) -> dict:
    g = _gen()
    return {"past_values": torch.randn(batch_size, 64, 3, generator=g),
            "future_values": torch.randn(batch_size, 16, 3, generator=g)}


def time_series_batch(batch_size: int) -> dict:
    """context 16 + the largest lag 3; one time feature; StudentT likelihood (the config's default)."""
    g = _gen()
    past = 19
    return {"past_values": torch.randn(batch_size, past, generator=g),
            "past_time_features": torch.randn(batch_size, past, 1, generator=g),
            "past_observed_mask": torch.ones(batch_size, past),
            "future_values": torch.randn(batch_size, 8, generator=g),
            "future_time_features": torch.randn(batch_size, 8, 1, generator=g)}


def _image_tuple(batch_size: int):
    b = image_batch(batch_size)
    return b["pixel_values"], b["labels"]


def llava_batch(batch_size: int) -> dict:
    """Each row: a token, the image's 64 patch tokens (the image token, where the vision tower's features are
    scattered into the embeddings: `masked_scatter` under a mask from the ids), then SEQ text tokens."""
    g = _gen()
    ids = torch.randint(1, VOCAB - 1, (batch_size, SEQ + 65), generator=g)
    ids[:, 1:65] = VOCAB - 1
    return {"input_ids": ids, "pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g), "labels": ids}


_LLAVA = {"vision_config": {"model_type": "clip_vision_model", "image_size": 32, "patch_size": 4, "hidden_size": 64,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128},
          "text_config": {"model_type": "llama", **_DEC}, "image_token_index": VOCAB - 1, "vision_feature_layer": -1,
          "vision_feature_select_strategy": "default"}


def wave_batch(batch_size: int):
    g = _gen()
    return torch.randn(batch_size, 4000, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


_SPEECH = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256,
           "conv_dim": (64, 64, 64), "conv_stride": (5, 2, 2), "conv_kernel": (10, 3, 3),
           "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4, "ctc_loss_reduction": "mean",
           "pad_token_id": 0, "mask_time_prob": 0.0, "layerdrop": 0.0, "vocab_size": 32}
_S2S = {"vocab_size": VOCAB, "d_model": 128, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 256, "decoder_ffn_dim": 256, "use_cache": False,
        "decoder_start_token_id": 2, "pad_token_id": 1}
_IMG = {"num_labels": 10}
