"""The benchmark zoo's models and batches (benchmarks.zoo puts them together into cases).

Hand-written models and transformers models built from config classes (no downloaded weights); batches are
real CPU tensors drawn from a generator seeded with SEED, so every run sees the same data.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

SEED = 0
"""The seed of every batch the zoo draws, and of the truth and estimate runs."""


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


# --------------------------------------------------------------------------------------------------
# Hand-written models


def linear() -> nn.Module:
    """One Linear(1000, 1000): the case whose peak is worked out by hand (tests/benchmarks)."""
    return nn.Linear(1000, 1000).train()


def mlp() -> nn.Module:
    """1000 -> 4 x 100 -> 10."""
    layers: list[nn.Module] = [nn.Linear(1000, 100), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Linear(100, 100), nn.ReLU()]
    layers.append(nn.Linear(100, 10))
    return nn.Sequential(*layers).train()


class MixerBlock(nn.Module):
    """MLP-Mixer's block: token mixing runs Linear layers over the tokens of a transposed activation
    (a non-contiguous input: ATen's linear adds the bias in place, CPU's gelu_backward copies the
    transposed gradient, CUDA's layer_norm and softmax copy non-contiguous inputs), then channel mixing."""

    def __init__(self, tokens: int, channels: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(channels)
        self.token_mix = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.norm2 = nn.LayerNorm(channels)
        self.channel_mix = nn.Sequential(nn.Linear(channels, 4 * channels), nn.GELU(),
                                         nn.Linear(4 * channels, channels))

    def forward(self, x):  # (batch, tokens, channels)
        x = x + self.token_mix(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mix(self.norm2(x))


class Mixer(nn.Module):
    """MLP-Mixer on 3x64x64 images: 8x8 patches (64 tokens), 256 channels, 4 blocks, 100 classes."""

    def __init__(self, depth: int = 4, channels: int = 256, patch: int = 8, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, patch, stride=patch)
        self.blocks = nn.Sequential(*(MixerBlock((64 // patch) ** 2, channels) for _ in range(depth)))
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, images):
        x = self.stem(images).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(1))


def mixer() -> nn.Module:
    return Mixer().train()


def vectors_and_labels(batch_size: int, *, features: int = 1000, classes: int = 10):
    g = _generator()
    return torch.randn(batch_size, features, generator=g), torch.randint(0, classes, (batch_size,), generator=g)


def classification_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


class CaptchaCNN(nn.Module):
    """Conv-BN-ReLU-pool x 4 on 1x50x180 images, then a linear classifier."""

    def __init__(self, classes: int = 36) -> None:
        super().__init__()
        channels = [1, 32, 64, 128, 128]
        blocks = []
        for c_in, c_out in zip(channels, channels[1:]):
            blocks.append(
                nn.Sequential(
                    nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                    nn.BatchNorm2d(c_out),
                    nn.ReLU(inplace=True),
                    nn.MaxPool2d(2),
                )
            )
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(128 * 3 * 11, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def captcha_cnn() -> nn.Module:
    return CaptchaCNN().train()


def images_and_labels(batch_size: int, *, shape: tuple[int, ...], classes: int):
    g = _generator()
    return torch.randn(batch_size, *shape, generator=g), torch.randint(0, classes, (batch_size,), generator=g)


class BasicBlock(nn.Module):
    """ResNet's two-conv residual block (He et al. 2016), as in torchvision."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18 for small images: 3x3 stem without max-pool, stages layer1..layer4 of 2 BasicBlocks."""

    def __init__(self, classes: int = 100, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        widths = [width, 2 * width, 4 * width, 8 * width]
        c_in = width
        for i, (c_out, stride) in enumerate(zip(widths, [1, 2, 2, 2]), start=1):
            setattr(self, f"layer{i}", nn.Sequential(BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)))
            c_in = c_out
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18() -> nn.Module:
    return ResNet18().train()


class RNNLanguageModel(nn.Module):
    """Embedding -> 2-layer LSTM/GRU -> vocabulary head (next-token prediction)."""

    def __init__(self, cell: str, vocab: int = 5000, embed: int = 128, hidden: int = 256) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.rnn = rnn(embed, hidden, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embedding(tokens))
        return self.head(out)


def rnn_lm(cell: str) -> nn.Module:
    return RNNLanguageModel(cell).train()


def token_sequences(batch_size: int, *, seq_len: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch_size, seq_len), generator=_generator())


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# --------------------------------------------------------------------------------------------------
# transformers models, from config classes


def _hf(model_class: str, config_class: str, **config) -> nn.Module:
    import transformers

    cfg = getattr(transformers, config_class)(attn_implementation="sdpa", **config)
    return getattr(transformers, model_class)(cfg).train()


def hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def causal_lm_batch(batch_size: int, *, seq_len: int, vocab: int) -> dict:
    ids = token_sequences(batch_size, seq_len=seq_len, vocab=vocab)
    return {"input_ids": ids, "labels": ids}


GPT2 = dict(vocab_size=50257, n_positions=1024, n_embd=256, n_layer=4, n_head=4, use_cache=False)
gpt2 = functools.partial(_hf, "GPT2LMHeadModel", "GPT2Config", **GPT2)
gpt2_batch = functools.partial(causal_lm_batch, seq_len=128, vocab=GPT2["vocab_size"])

BERT = dict(
    vocab_size=30522, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
    num_labels=4,
)
bert = functools.partial(_hf, "BertForSequenceClassification", "BertConfig", **BERT)


def bert_batch(batch_size: int, *, seq_len: int = 128) -> dict:
    """Padded batch: row i has seq_len - 8 * (i % 4) real tokens, so the attention mask is not all ones."""
    g = _generator()
    ids = torch.randint(0, BERT["vocab_size"], (batch_size, seq_len), generator=g)
    lengths = seq_len - 8 * (torch.arange(batch_size) % 4)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    labels = torch.randint(0, BERT["num_labels"], (batch_size,), generator=g)
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


LLAMA = dict(
    vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=512, use_cache=False,
)
llama = functools.partial(_hf, "LlamaForCausalLM", "LlamaConfig", **LLAMA)
llama_batch = functools.partial(causal_lm_batch, seq_len=256, vocab=LLAMA["vocab_size"])

MIXTRAL = dict(  # mixture of experts: 4 experts, 2 per token, transformers' default grouped_mm experts path
    vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512, use_cache=False,
)
mixtral = functools.partial(_hf, "MixtralForCausalLM", "MixtralConfig", **MIXTRAL)
mixtral_batch = functools.partial(causal_lm_batch, seq_len=256, vocab=MIXTRAL["vocab_size"])

VIT = dict(
    image_size=64, patch_size=8, num_channels=3, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
    intermediate_size=1024, num_labels=100,
)
vit = functools.partial(_hf, "ViTForImageClassification", "ViTConfig", **VIT)


def vit_batch(batch_size: int) -> dict:
    pixels, labels = images_and_labels(batch_size, shape=(3, 64, 64), classes=VIT["num_labels"])
    return {"pixel_values": pixels, "labels": labels}


T5 = dict(
    vocab_size=32128, d_model=256, d_kv=64, d_ff=1024, num_layers=3, num_decoder_layers=3, num_heads=4,
    decoder_start_token_id=0, pad_token_id=0, use_cache=False,
)
t5 = functools.partial(_hf, "T5ForConditionalGeneration", "T5Config", **T5)

BART = dict(
    vocab_size=50265, d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024, max_position_embeddings=512,
    use_cache=False,
)
bart = functools.partial(_hf, "BartForConditionalGeneration", "BartConfig", **BART)


def seq2seq_batch(batch_size: int, *, vocab: int, source_len: int = 128, target_len: int = 64) -> dict:
    """Source ids + target labels; the model shifts labels right into decoder_input_ids itself."""
    g = _generator()
    source = torch.randint(3, vocab, (batch_size, source_len), generator=g)
    target = torch.randint(3, vocab, (batch_size, target_len), generator=g)
    return {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": target}
