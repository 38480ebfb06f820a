"""benchmarks.gpu_extra's models and batches: torchvision's ViT-L/16 (memplan's copy where torchvision is missing),
transformers' GPT-2 small, the zoo's cases for the autocast gaps; tiny versions of each for the dry run on CPU."""
from __future__ import annotations


# --- models and batches ---------------------------------------------------------------------------
def _autocast_batch(case, cpu: bool) -> int:
    """The zoo case's batch; 2 in a dry run (tiny sizes, as the other cases')."""
    return 2 if cpu else case.batch_size


def _zoo_case(name: str):
    from benchmarks.zoo import CASES

    return CASES[name]


def vit_model(cpu: bool):
    """torchvision's vit_l_16 with a 10-class head (tiny on CPU); memplan's module-for-module copy where
    torchvision is missing (recorded)."""
    import torch.nn as nn

    size = dict(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64) if cpu else {}
    try:
        from torchvision.models import vit_l_16
        from torchvision.models.vision_transformer import VisionTransformer as TorchvisionViT
    except ImportError:
        from benchmarks.published_gpu_models import VisionTransformer

        keys = dict(image="image_size", patch="patch_size", layers="num_layers", heads="num_heads", dim="hidden_dim",
                    mlp="mlp_dim")
        return VisionTransformer(**{k: size[v] for k, v in keys.items()} if cpu else {}), "benchmarks.published_gpu"
    model = TorchvisionViT(**size) if cpu else vit_l_16()
    model.heads.head = nn.Linear(model.hidden_dim, 10)
    return model, "torchvision"


def vit_batch(batch: int, cpu: bool):
    import torch

    side = 32 if cpu else 224
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, side, side, generator=g), torch.randint(0, 10, (batch,), generator=g)


DRY_VOCAB = 1001  # the dry run's: odd like GPT-2's 50257, whose LM head was most of a tiny model's step


def gpt2_small(cpu: bool):
    import transformers

    size = dict(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=DRY_VOCAB) if cpu else {}
    config = transformers.GPT2Config(attn_implementation="sdpa", use_cache=False, **size)
    return transformers.GPT2LMHeadModel(config).train()


def gpt2_small_batch(batch: int, cpu: bool) -> dict:
    import torch

    ids = torch.randint(0, DRY_VOCAB if cpu else 50257, (batch, 32 if cpu else 1024),
                        generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _to(tree, device):
    from memplan.batching import map_tensors

    return map_tensors(tree, lambda t: t.to(device))

