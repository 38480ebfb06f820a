"""Batches and configs for the sweep4 held-out cases (benchmarks/heldout_sweep.py)."""
from __future__ import annotations

import torch

from benchmarks.realmodels_cases import _DEC
from benchmarks.realmodels_models import SEQ, VOCAB, _gen

IMG_TOK = VOCAB - 1


def qwen2vl_batch(batch_size: int) -> dict:
    """One 16x16 image a row: a (1, 4, 4) grid of 4x4 patches (temporal 2), merged 2x2 into 4 image tokens, then
    SEQ text tokens; mrope positions come from the ids and the grid."""
    g = _gen()
    ids = torch.randint(1, VOCAB - 3, (batch_size, SEQ + 5), generator=g)
    ids[:, 1:5] = IMG_TOK
    patches = torch.randn(batch_size * 16, 3 * 2 * 4 * 4, generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": patches,
            "mm_token_type_ids": (ids == IMG_TOK).long(), "image_grid_thw": torch.tensor([[1, 4, 4]] * batch_size),
            "labels": ids}


_QWEN2VL = {"text_config": {**_DEC, "num_key_value_heads": 2, "vocab_size": VOCAB,
                            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}},
            "vision_config": {"depth": 2, "embed_dim": 64, "hidden_size": 128, "num_heads": 4, "patch_size": 4,
                              "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "mlp_ratio": 2},
            "image_token_id": IMG_TOK, "video_token_id": VOCAB - 2, "vision_start_token_id": VOCAB - 3}


def paligemma_batch(batch_size: int) -> dict:
    """64 image tokens (32x32 at patch 4), then SEQ text tokens: token_type_ids mark the prefix (image + 8 prompt
    tokens) that attends bidirectionally, the suffix causally; labels -100 on the prefix."""
    g = _gen()
    ids = torch.randint(1, VOCAB - 1, (batch_size, SEQ + 64), generator=g)
    ids[:, :64] = IMG_TOK
    types = torch.zeros_like(ids)
    types[:, 72:] = 1
    labels = ids.masked_fill(types == 0, -100)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": types,
            "pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g), "labels": labels}


_PALIGEMMA = {"vision_config": {"model_type": "siglip_vision_model", "image_size": 32, "patch_size": 4,
                                "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "intermediate_size": 128, "projection_dim": 128},
              "text_config": {"model_type": "gemma", **_DEC, "num_key_value_heads": 1, "head_dim": 32},
              "image_token_index": IMG_TOK, "projection_dim": 128, "hidden_size": 128}


def blip2_batch(batch_size: int) -> dict:
    """8 query-token slots (image tokens) then SEQ text tokens."""
    g = _gen()
    ids = torch.randint(3, VOCAB - 1, (batch_size, SEQ + 8), generator=g)
    ids[:, :8] = IMG_TOK
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g), "labels": ids}


_BLIP2 = {"vision_config": {"image_size": 32, "patch_size": 4, "hidden_size": 64, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "intermediate_size": 128},
          "qformer_config": {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                             "intermediate_size": 128, "encoder_hidden_size": 64, "cross_attention_frequency": 1},
          "text_config": {"model_type": "opt", "vocab_size": VOCAB, "hidden_size": 128, "ffn_dim": 256,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256,
                          "word_embed_proj_dim": 128, "use_cache": False},
          "num_query_tokens": 8, "image_token_index": IMG_TOK}


def wav2vec2bert_batch(batch_size: int) -> dict:
    """Log-mel style input features (80 frames x 160 = 2 x 80 stacked), CTC labels padded with -100."""
    g = _gen()
    labels = torch.randint(1, 32, (batch_size, 16), generator=g)
    for i in range(batch_size):
        labels[i, 16 - 3 * (i % 4):] = -100
    return {"input_features": torch.randn(batch_size, 80, 160, generator=g), "labels": labels}


def patchtsmixer_batch(batch_size: int) -> dict:
    g = _gen()
    return {"past_values": torch.randn(batch_size, 64, 3, generator=g),
            "future_values": torch.randn(batch_size, 16, 3, generator=g)}


def informer_batch(batch_size: int) -> dict:
    g = _gen()
    past = 35  # context 32 + the largest lag 3
    return {"past_values": torch.randn(batch_size, past, generator=g),
            "past_time_features": torch.randn(batch_size, past, 1, generator=g),
            "past_observed_mask": torch.ones(batch_size, past),
            "future_values": torch.randn(batch_size, 16, generator=g),
            "future_time_features": torch.randn(batch_size, 16, 1, generator=g)}


def deformable_detr_batch(batch_size: int) -> dict:
    g = _gen()
    labels = [{"class_labels": torch.randint(0, 5, (n,), generator=g),
               "boxes": torch.rand(n, 4, generator=g) * 0.4 + 0.3} for n in (3 + i % 3 for i in range(batch_size))]
    return {"pixel_values": torch.randn(batch_size, 3, 64, 64, generator=g), "labels": labels}


def char_cls_batch(batch_size: int) -> dict:
    """Canine: unicode code points, padded rows."""
    g = _gen()
    seq = 128
    ids = torch.randint(32, 1000, (batch_size, seq), generator=g)
    lengths = seq - 8 * (torch.arange(batch_size) % 4)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": torch.randint(0, 4, (batch_size,), generator=g)}


def reformer_batch(batch_size: int) -> dict:
    ids = torch.randint(0, VOCAB, (batch_size, 128), generator=_gen())
    return {"input_ids": ids, "labels": ids}


def modernbert_batch(batch_size: int) -> dict:
    """Padded rows: ModernBERT unpads them (index_select to the kept tokens) and repads after."""
    g = _gen()
    ids = torch.randint(5, VOCAB, (batch_size, SEQ), generator=g)
    lengths = SEQ - 8 * (torch.arange(batch_size) % 4)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": torch.randint(0, 4, (batch_size,), generator=g)}
