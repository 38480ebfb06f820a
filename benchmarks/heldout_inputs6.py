"""Batches and losses for the sixth held-out sweep (benchmarks/heldout_cases6.py): transformers models whose batch
or loss the earlier sweeps have no maker for, and the batch structures the sweep covers (a list, a dict carrying
strings and ints, a nested tuple, rows padded to the batch's longest, a PackedSequence)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from benchmarks.realmodels_models import SEQ, VOCAB, _gen, cls_batch

# --------------------------------------------------------------------------------------------------
# transformers batches and losses


def layoutlm_batch(batch_size: int) -> dict:
    """cls_batch plus a word box (x0, y0, x1, y1 in 0..1000, x0 <= x1) per token."""
    batch = cls_batch(batch_size)
    g = _gen()
    lo = torch.randint(0, 500, (batch_size, SEQ, 2), generator=g)
    batch["bbox"] = torch.cat([lo, lo + torch.randint(0, 500, (batch_size, SEQ, 2), generator=g)], -1)
    return batch


def xmod_batch(batch_size: int) -> dict:
    """cls_batch with a language id per row (two languages: both adapters are used)."""
    return {**cls_batch(batch_size), "lang_ids": torch.arange(batch_size) % 2}


def contrastive_batch(batch_size: int, *, size: int = 32, text: int = 16) -> dict:
    g = _gen()
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, text), generator=g),
            "pixel_values": torch.randn(batch_size, 3, size, size, generator=g), "return_loss": True}


def depth_batch(batch_size: int, *, size: int = 64) -> dict:
    g = _gen()
    return {"pixel_values": torch.randn(batch_size, 3, size, size, generator=g),
            "labels": torch.rand(batch_size, size, size, generator=g) * 9 + 1}


def depth_l1_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """DPT's transformers head has no training loss: L1 on the predicted depth, resized to the labels."""
    pred = model(pixel_values=batch["pixel_values"]).predicted_depth
    pred = F.interpolate(pred[:, None], size=batch["labels"].shape[-2:], mode="bilinear", align_corners=False)
    return F.l1_loss(pred[:, 0], batch["labels"])


def imagegpt_batch(batch_size: int) -> dict:
    """16 x 16 images as 256 colour-cluster tokens (vocabulary 64 + start token)."""
    ids = torch.randint(0, 64, (batch_size, 256), generator=_gen())
    return {"input_ids": ids, "labels": ids}


def yolos_batch(batch_size: int) -> dict:
    g = _gen()
    labels = [{"class_labels": torch.randint(0, 5, (n,), generator=g),
               "boxes": torch.rand(n, 4, generator=g) * 0.4 + 0.3} for n in (3 + i % 3 for i in range(batch_size))]
    return {"pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g), "labels": labels}


def wave_text_batch(batch_size: int, *, samples: int = 8000, target: int = 16) -> dict:
    g = _gen()
    return {"input_values": torch.randn(batch_size, samples, generator=g),
            "labels": torch.randint(3, VOCAB, (batch_size, target), generator=g)}


def codec_batch(batch_size: int, *, samples: int = 4096) -> dict:
    return {"input_values": torch.randn(batch_size, 1, samples, generator=_gen()) * 0.1}


def codec_recon_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """A neural codec's reconstruction L1 (and its VQ losses where the model returns them)."""
    out = model(input_values=batch["input_values"])
    recon = F.l1_loss(out.audio_values[..., :batch["input_values"].shape[-1]], batch["input_values"])
    return recon + out.loss.mean() if getattr(out, "loss", None) is not None else recon


def musicgen_batch(batch_size: int, *, codebooks: int = 4, seq: int = 32) -> dict:
    ids = torch.randint(0, 128, (batch_size * codebooks, seq), generator=_gen())
    return {"input_ids": ids, "labels": ids.reshape(batch_size, codebooks, seq).transpose(1, 2).contiguous()}


def vilt_batch(batch_size: int) -> dict:
    g = _gen()
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, 16), generator=g),
            "pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g),
            "pixel_mask": torch.ones(batch_size, 32, 32, dtype=torch.long),
            "labels": torch.rand(batch_size, 8, generator=g)}


def git_batch(batch_size: int) -> dict:
    g = _gen()
    ids = torch.randint(3, VOCAB, (batch_size, 16), generator=g)
    return {"input_ids": ids, "pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g), "labels": ids}


def decision_batch(batch_size: int, *, steps: int = 20) -> dict:
    """Trajectories of 20 steps (state 11, action 3) with the last 4 * (i % 4) steps padded out."""
    g = _gen()
    mask = (torch.arange(steps)[None, :] < (steps - 4 * (torch.arange(batch_size) % 4))[:, None]).long()
    return {"states": torch.randn(batch_size, steps, 11, generator=g),
            "actions": torch.randn(batch_size, steps, 3, generator=g).tanh(),
            "rewards": torch.randn(batch_size, steps, 1, generator=g),
            "returns_to_go": torch.randn(batch_size, steps, 1, generator=g),
            "timesteps": torch.arange(steps).expand(batch_size, -1).contiguous(), "attention_mask": mask}


def decision_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    pred = model(**batch).action_preds
    keep = batch["attention_mask"].bool()
    return F.mse_loss(pred[keep], batch["actions"][keep])


# --------------------------------------------------------------------------------------------------
# plain-torch batches and losses


def triplet_batch(batch_size: int):
    g = _gen()
    return tuple(torch.randint(0, VOCAB, (batch_size, SEQ), generator=g) for _ in range(3))


def two_views(batch_size: int):
    g = _gen()
    ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    return ids, torch.where(torch.rand(ids.shape, generator=g) < 0.15, torch.zeros_like(ids), ids)


def view_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(*batch)


def multitask_batch(batch_size: int):
    g = _gen()
    return (torch.randn(batch_size, 64, generator=g), torch.randint(0, 10, (batch_size,), generator=g),
            torch.randn(batch_size, 64, generator=g))


def clip_tower_batch(batch_size: int):
    g = _gen()
    return torch.randint(0, VOCAB, (batch_size, 16), generator=g), torch.randn(batch_size, 3, 32, 32, generator=g)


def list_batch(batch_size: int) -> list:
    g = _gen()
    return [torch.randn(batch_size, 64, generator=g), torch.randint(0, 10, (batch_size,), generator=g)]


def dict_extras_batch(batch_size: int) -> dict:
    """Tensors plus what a collate passes through: the rows' string ids, an int and a float."""
    g = _gen()
    return {"x": torch.randn(batch_size, 64, generator=g), "y": torch.randint(0, 10, (batch_size,), generator=g),
            "ids": [f"row-{i}" for i in range(batch_size)], "epoch": 3, "split": "train", "weight": 0.5}


def dict_extras_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return batch["weight"] * 2 * F.cross_entropy(model(batch["x"]), batch["y"])


def nested_batch(batch_size: int):
    """((ids, padding mask), labels): rows padded to the batch's longest (SEQ - 8 * (i % 4) real tokens)."""
    g = _gen()
    lengths = SEQ - 8 * (torch.arange(batch_size) % 4)
    width = int(lengths.max())
    mask = torch.arange(width)[None, :] < lengths[:, None]
    ids = torch.randint(1, VOCAB, (batch_size, width), generator=g) * mask
    return (ids, mask), torch.randint(0, 10, (batch_size,), generator=g)


def nested_loss(model: nn.Module, batch) -> torch.Tensor:
    (ids, mask), y = batch
    return F.cross_entropy(model(ids, mask), y)


def varlen_batch(batch_size: int) -> dict:
    """Rows of 17 to 53 real tokens (by the row), padded to the batch's longest: not to a fixed length."""
    g = _gen()
    lengths = 17 + (torch.arange(batch_size) * 29) % 37
    width = int(lengths.max())
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return {"ids": torch.randint(1, VOCAB, (batch_size, width), generator=g) * mask, "mask": mask,
            "y": torch.randint(0, 10, (batch_size,), generator=g)}


def varlen_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["ids"], batch["mask"]), batch["y"])


def packed_batch(batch_size: int):
    """(PackedSequence of rows of 48 - 6 * (i % 4) steps of 32 features, sorted by length, labels)."""
    g = _gen()
    lengths = 48 - 6 * (torch.arange(batch_size) % 4)
    lengths, _ = lengths.sort(descending=True)
    x = torch.randn(batch_size, 48, 32, generator=g)
    return pack_padded_sequence(x, lengths, batch_first=True), torch.randint(0, 10, (batch_size,), generator=g)


def padded_ids_batch(batch_size: int):
    """Token ids with trailing padding 0 (rows of SEQ - 8 * (i % 4)) and 10-way labels."""
    g = _gen()
    lengths = SEQ - 8 * (torch.arange(batch_size) % 4)
    ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g) * (torch.arange(SEQ)[None, :] < lengths[:, None])
    return ids, torch.randint(0, 10, (batch_size,), generator=g)
