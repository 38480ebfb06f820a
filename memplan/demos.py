"""Bundled LightningModules and LightningDataModules for examples, configs and tests (as Lightning ships
lightning.pytorch.demos).

Pure torch, no downloads. Each module has `example_batch(batch_size)`, a deterministic batch of real
tensors shaped exactly as its `training_step` receives it. Each datamodule serves synthetic,
deterministic samples (sample i is the same in every run, process and worker) that collate into that
batch: RandomVectors for MLP, RandomImages for ImageCNN, ResNet and ViT, RandomTokens for GPTLM and LlamaLM.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class _Demo(pl.LightningModule):
    lr: float = 1e-3

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class MLP(_Demo):
    """The seeds' MLP: 1000 -> 4 x 100 -> 10, ReLU."""

    def __init__(self, in_features: int = 1000, hidden: int = 100, depth: int = 4, num_classes: int = 10):
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def example_batch(self, batch_size: int):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch_size, self.hparams.in_features, generator=g)
        return x, torch.randint(0, self.hparams.num_classes, (batch_size,), generator=g)


class ImageCNN(_Demo):
    """A CNN with BatchNorm for 1 x 50 x 180 images (captcha-like), 4 conv blocks and a classifier."""

    def __init__(self, channels: int = 32, num_classes: int = 36, height: int = 50, width: int = 180):
        super().__init__()
        self.save_hyperparameters()
        blocks, c_in = [], 1
        for i in range(4):
            c_out = channels * 2 ** min(i, 2)
            blocks += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)]
            c_in = c_out
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(c_in, num_classes))

    def forward(self, x):
        return self.head(self.features(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def example_batch(self, batch_size: int):
        g = torch.Generator().manual_seed(0)
        hp = self.hparams
        x = torch.randn(batch_size, 1, hp.height, hp.width, generator=g)
        return x, torch.randint(0, hp.num_classes, (batch_size,), generator=g)


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class _ImageClassifier(_Demo):
    """(images, labels) batches of RGB images from hparams image_size and num_classes, cross-entropy loss."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def example_batch(self, batch_size: int):
        g = torch.Generator().manual_seed(0)
        size = self.hparams.image_size
        x = torch.randn(batch_size, 3, size, size, generator=g)
        return x, torch.randint(0, self.hparams.num_classes, (batch_size,), generator=g)


class ResNet(_ImageClassifier):
    """ResNet-18 layout (BasicBlocks [2, 2, 2, 2], widths 64..512) for image classification."""

    def __init__(self, num_classes: int = 1000, image_size: int = 224, blocks: tuple[int, ...] = (2, 2, 2, 2)):
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        layers, c_in = [], 64
        for i, n in enumerate(blocks):
            c_out = 64 * 2**i
            layers += [_BasicBlock(c_in if j == 0 else c_out, c_out, 2 if (j == 0 and i > 0) else 1) for j in range(n)]
            c_in = c_out
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


class _GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"), nn.Linear(4 * d_model, d_model))
        self.dropout = dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class _TokenLM(_Demo):
    """A causal LM demo: (tokens, next tokens) batches from hparams vocab_size and context, cross-entropy loss."""

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_model(self) -> None:
        """Under Lightning's ModelParallelStrategy, shard as its FSDP2 examples do: fully_shard on each
        repeated block (the decoder layers), then on the whole model (embeddings and head, the root).
        Under any other strategy, nothing (FSDPStrategy wraps the model itself)."""
        from pytorch_lightning.strategies import ModelParallelStrategy
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from memplan.estimator.checkpointing import find_repeated_blocks

        if not isinstance(getattr(self._trainer, "strategy", None), ModelParallelStrategy) or isinstance(self, FSDPModule):
            return  # (Lightning may call configure_model again: a model is sharded once)
        mesh = self.device_mesh["data_parallel"]
        for _, block in find_repeated_blocks(self):
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def example_batch(self, batch_size: int):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.hparams.vocab_size, (batch_size, self.hparams.context + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class GPTLM(_TokenLM):
    """A GPT-2-class causal LM (defaults: GPT-2 small, 124M parameters, context 1024), tied embeddings."""

    def __init__(self, vocab_size: int = 50257, context: int = 1024, d_model: int = 768, n_layers: int = 12,
                 n_heads: int = 12, dropout: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_GPTBlock(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class _ViTBlock(nn.Module):
    """A pre-norm transformer encoder block: bidirectional attention (SDPA) and a GELU MLP."""

    def __init__(self, d_model: int, n_heads: int, mlp_dim: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model, eps=1e-6)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, d_model))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class ViT(_ImageClassifier):
    """A Vision Transformer for image classification (Dosovitskiy et al.), pure torch: a patch-embedding
    convolution, a class token and learned positions, pre-norm encoder blocks, a linear head on the class
    token. Defaults: ViT-L/16 at 224 x 224 (24 layers, width 1024, 16 heads, MLP 4096; 304M parameters
    with 1000 classes); ViT-B/16 is width 768, 12 layers, 12 heads, MLP 3072."""

    def __init__(self, num_classes: int = 1000, image_size: int = 224, patch_size: int = 16, d_model: int = 1024,
                 n_layers: int = 24, n_heads: int = 16, mlp_dim: int = 4096):
        super().__init__()
        self.save_hyperparameters()
        if image_size % patch_size:
            raise ValueError(f"model.init_args.image_size ({image_size}) must be a multiple of "
                             f"model.init_args.patch_size ({patch_size})")
        if d_model % n_heads:
            raise ValueError(f"model.init_args.d_model ({d_model}) must be a multiple of model.init_args.n_heads ({n_heads})")
        self.patch = nn.Conv2d(3, d_model, patch_size, patch_size)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.randn(1, (image_size // patch_size) ** 2 + 1, d_model) * 0.02)
        self.blocks = nn.ModuleList(_ViTBlock(d_model, n_heads, mlp_dim) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model, eps=1e-6)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x[:, 0]))


DEMOS: dict[str, type[_Demo]] = {"mlp": MLP, "cnn": ImageCNN, "resnet": ResNet, "gpt2-small": GPTLM}


# --- datamodules -------------------------------------------------------------------------------------
class _SyntheticDataset(Dataset):
    """`length` samples; sample i comes from `make(generator seeded with (seed, i))`, so it is the same
    in every run and every worker. Samples are made on demand: nothing is held in memory."""

    def __init__(self, length: int, seed: int, make: Callable[[torch.Generator], tuple[torch.Tensor, ...]]):
        self.length, self.seed, self.make = length, seed, make

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} out of range for {self.length} samples")
        return self.make(torch.Generator().manual_seed(self.seed * 1_000_003 + index))


def _vector_sample(g: torch.Generator, *, in_features: int, num_classes: int):
    return torch.randn(in_features, generator=g), torch.randint(0, num_classes, (), generator=g)


def _image_sample(g: torch.Generator, *, shape: tuple[int, ...], num_classes: int):
    return torch.randn(*shape, generator=g), torch.randint(0, num_classes, (), generator=g)


def _token_sample(g: torch.Generator, *, vocab_size: int, context: int):
    tokens = torch.randint(0, vocab_size, (context + 1,), generator=g)
    return tokens[:-1], tokens[1:]


class _RandomData(pl.LightningDataModule):
    """Shared loader settings. Subclasses set `self._make` (a picklable sample function)."""

    def __init__(self, batch_size: int, num_workers: int, pin_memory: bool, num_samples: int, seed: int):
        super().__init__()
        for name, value, least in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0),
                                   ("num_samples", num_samples, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{type(self).__name__}: {name} must be an int >= {least}; got {value!r}")
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.num_samples, self.seed = num_samples, seed
        self._make: Callable[[torch.Generator], tuple[torch.Tensor, ...]]
        self.train_set: _SyntheticDataset | None = None

    def setup(self, stage: str) -> None:
        self.train_set = _SyntheticDataset(self.num_samples, self.seed, self._make)

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            raise RuntimeError(f"{type(self).__name__}.train_dataloader() needs setup('fit') first")
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True,
            generator=torch.Generator().manual_seed(self.seed), num_workers=self.num_workers,
            pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0, drop_last=True,
        )


class RandomVectors(_RandomData):
    """(x, y) batches for MLP: x float32 (B, in_features) ~ N(0, 1), y int64 (B,) in [0, num_classes)."""

    def __init__(self, batch_size: int = 256, num_workers: int = 0, in_features: int = 1000, num_classes: int = 10,
                 pin_memory: bool = False, num_samples: int = 65_536, seed: int = 0):
        super().__init__(batch_size, num_workers, pin_memory, num_samples, seed)
        self._make = functools.partial(_vector_sample, in_features=in_features, num_classes=num_classes)


class RandomImages(_RandomData):
    """(x, y) batches for ImageCNN (shape [1, 50, 180]) and ResNet (shape [3, 224, 224]): x float32
    (B, *shape) ~ N(0, 1), y int64 (B,) in [0, num_classes)."""

    def __init__(self, batch_size: int = 32, num_workers: int = 0, shape: Sequence[int] = (3, 224, 224),
                 num_classes: int = 1000, pin_memory: bool = False, num_samples: int = 65_536, seed: int = 0):
        super().__init__(batch_size, num_workers, pin_memory, num_samples, seed)
        if len(shape) != 3 or not all(isinstance(d, int) and d > 0 for d in shape):
            raise ValueError(f"RandomImages: shape must be [channels, height, width] of positive ints; got {shape!r}")
        self._make = functools.partial(_image_sample, shape=tuple(shape), num_classes=num_classes)


class RandomTokens(_RandomData):
    """(idx, targets) batches for GPTLM: int64 (B, context) token ids in [0, vocab_size), targets the
    same sequence shifted by one."""

    def __init__(self, batch_size: int = 8, num_workers: int = 0, vocab_size: int = 50257, context: int = 1024,
                 pin_memory: bool = False, num_samples: int = 65_536, seed: int = 0):
        super().__init__(batch_size, num_workers, pin_memory, num_samples, seed)
        self._make = functools.partial(_token_sample, vocab_size=vocab_size, context=context)


class LlamaLM(_TokenLM):
    """A Llama-family causal LM from transformers' LlamaConfig (random init, nothing downloaded); the
    defaults are Llama-2-7B's shape (32 layers, hidden 4096, 32 heads, MLP 11008, vocabulary 32000,
    context 4096; 6.74B parameters). `num_key_value_heads` < `num_attention_heads` gives GQA (Llama-2-70B:
    80 layers, hidden 8192, 64 heads, 8 KV heads, MLP 28672). Takes GPTLM's (idx, targets) batches."""

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 4096, intermediate_size: int = 11008,
                 num_hidden_layers: int = 32, num_attention_heads: int = 32, num_key_value_heads: int = 32,
                 context: int = 4096):
        super().__init__()
        self.save_hyperparameters()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads, max_position_embeddings=context, use_cache=False,
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)

    def forward(self, idx):
        return self.model(input_ids=idx).logits


DATAMODULES: dict[str, type[_RandomData]] = {
    "mlp": RandomVectors, "cnn": RandomImages, "resnet": RandomImages, "gpt2-small": RandomTokens,
    "llama-7b-fsdp": RandomTokens, "vit-l16": RandomImages,
}
