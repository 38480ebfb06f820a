"""benchmarks.published_gpu's figures: each published GPU memory measurement, its source, quote and conditions,
and how memplan's step is set up to estimate it."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.processes import environment_variable
from benchmarks.published_gpu_models import (
    Adam2_0,
    AdamW2022,
    VisionTransformer,
    _meta,
    torch_1_10_softmax,
    torch_2_1_flash_layout,
)

MiB, GiB, GB = 1 << 20, 1 << 30, 10**9
QUANTITIES = {"max_memory_reserved": "peak_reserved", "max_memory_allocated": "peak_allocated",
              "nvml_used": "device_total"}
"""The quantity a source measured -> the MemoryEstimate field that estimates it."""

RASBT = "https://github.com/rasbt/pytorch-memory-optim/blob/2d1ae1e747fe72c7bb74a2a464fe79baa23f174b/"
RASBT_LOGS = RASBT + "logs.md"
RASBT_TORCH = "2.1.0.dev20230623+cu118 (logs.md: 'torch : 2.1.0.dev20230623+cu118', 'lightning: 2.1.0.dev0')"
RASBT_LOOP = ("plain loop: logits = model(x); loss = F.cross_entropy(logits, y); optimizer.zero_grad(); "
              "backward; optimizer.step(); max_memory_reserved over training and validation")
RASBT_GPU = ("not named in the scripts or logs; an A100 (sm80) is assumed, as issue 22 describes these runs (an H100 "
             "would add 48 MiB of cuBLAS workspaces; A100 boards differ in nothing the estimate uses)")
HF_PAGE = ("https://github.com/huggingface/transformers/blob/0016acf7ef421c7fe8eff7945de52c71896c3b01/"
           "docs/source/en/perf_train_gpu_one.mdx")
HF_SETUP = ("transformers Trainer, google-bert/bert-large-uncased (BertForSequenceClassification, 2 labels), "
            "512 random sequences of 512 tokens, default_args (1 epoch, no eval set); 'GPU memory occupied' = NVML "
            "used // 1024**2 after trainer.train()")
HF_GPU = "Tesla V100-SXM2 16GB, driver 460.91.03, CUDA 11.2 (the page's nvidia-smi)"
HF_TORCH = "not stated (the page is dated 2022-01: torch 1.10 era)"
HF_CONTEXT_MIB = 1343
"""The page's own reading after `torch.ones((1, 1)).to("cuda")`: the CUDA context (+ one 2 MiB segment)."""


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One published GPU memory measurement, its conditions, and how memplan's step is set up for it."""

    name: str
    source: str
    quote: str
    quantity: str
    """'max_memory_reserved', 'max_memory_allocated' or 'nvml_used'."""
    published_bytes: int
    conditions: dict[str, str]
    """model, batch, input, precision, optimizer, gpu, torch, checkpointing, loop: as the source states them."""
    torch_at_least_2_1: bool
    """Measured with torch >= 2.1 (counted in the goal)."""
    estimate: Callable[[bool], Any] = field(repr=False, compare=False)
    """estimate(published_torch) -> MemoryEstimate."""
    note: str = ""


# --- the ViT-L/16 figures (rasbt/pytorch-memory-optim) -----------------------------------------------------
def _vit_batch(batch: int):
    return torch.randn(batch, 3, 224, 224), torch.randint(0, 10, (batch,))


ACCUMULATION = 4
"""05_gradient-accum.py: micro-batch 4; optimizer.step() and zero_grad() (set_to_none=True, torch 2.x) after every
4th backward. One traced step runs the cycle: three forward + backward passes inside the loss function (the first
creates the gradients, the others accumulate into them), then the loop's forward, backward, step and zero_grad."""


def _vit(precision: str, batch: int, *, accumulate: bool = False, device: str | None = "A100-80GB"):
    """The scripts' step on an A100. 32-true: model, loss, zero_grad, backward, step. 16-mixed: Fabric's
    autocast (weight cache on) and GradScaler. bf16-true: Fabric converts the module to bf16 and each float32
    batch (moved to the GPU by setup_dataloaders, and alive through the step) to a bf16 copy in the forward,
    and the logits back to float32. accumulate: the cycle of 4 micro-batches (ACCUMULATION)."""
    from memplan.estimator import estimate

    def run(published_torch: bool):
        adam = {"lr": 5e-5}
        Adam = Adam2_0 if published_torch else torch.optim.Adam  # noqa: N806
        common = {"device": device, "batch": _vit_batch(batch)}
        layout = torch_2_1_flash_layout() if published_torch else contextlib.nullcontext()
        with layout:
            if precision == "16-mixed":
                return estimate(VisionTransformer, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                                optimizer=lambda p: Adam(p, **adam), precision="16-mixed",
                                loop="torch-zero-after-forward", **common)
            if precision == "bf16-true":
                model = _meta(lambda: VisionTransformer().to(torch.bfloat16))

                def micro(m, b):
                    return F.cross_entropy(m(b[0].to(torch.bfloat16)).float(), b[1])

                if accumulate:  # one traced step = the scripts' cycle of 4 micro-batches (see ACCUMULATION)
                    def cycle(m, b):
                        for _ in range(ACCUMULATION - 1):
                            (micro(m, b) / ACCUMULATION).backward()
                        return micro(m, b) / ACCUMULATION

                    return estimate(model, loss=cycle, optimizer=lambda p: Adam(p, **adam),
                                    precision="32-true", loop="torch", **common)
                return estimate(model, loss=micro, optimizer=lambda p: Adam(p, **adam),
                                precision="32-true", loop="torch-zero-after-forward", **common)
            return estimate(VisionTransformer, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                            optimizer=lambda p: Adam(p, **adam), precision="32-true",
                            loop="torch-zero-after-forward", **common)

    return run


def _vit_conditions(precision: str, batch: int, script: str, **extra: str) -> dict[str, str]:
    return {"model": "torchvision vit_l_16, head Linear(1024, 10) (303.3M parameters)", "batch": str(batch),
            "input": "3 x 224 x 224 (CIFAR-10 resized)", "precision": precision,
            "optimizer": "torch.optim.Adam(lr=5e-5)",
            "gpu": RASBT_GPU, "torch": RASBT_TORCH, "checkpointing": "none", "loop": RASBT_LOOP,
            "script": RASBT + script, **extra}


_LOG = "logs.md, section "
VIT_FIGURES = [
    Figure(name="vit-l16-fp32-b64-plain", source=RASBT_LOGS,
           quote=_LOG + "'01_pytorch-vit.py': 'Memory used: 26.79 GB'",
           quantity="max_memory_reserved", published_bytes=int(26.79 * GB), torch_at_least_2_1=True,
           conditions=_vit_conditions("32-true", 64, "01_pytorch-vit.py"), estimate=_vit("32-true", 64),
           note="the logs' bullet says 'batch size 32'; the script loads batch_size=64 (703 batches of 45,000 images)"),
    Figure(name="vit-l16-fp32-b64-fabric", source=RASBT_LOGS,
           quote=_LOG + "'01-2_pytorch-fabric.py': 'Memory used: 26.84 GB'", quantity="max_memory_reserved",
           published_bytes=int(26.84 * GB), torch_at_least_2_1=True,
           conditions=_vit_conditions("32-true", 64, "01-2_pytorch-fabric.py", loop=RASBT_LOOP + ", through Fabric"),
           estimate=_vit("32-true", 64)),
    Figure(name="vit-l16-16mixed-b64", source=RASBT_LOGS,
           quote=_LOG + "'02_mixed-precision.py': 'Memory used: 18.21 GB'",
           quantity="max_memory_reserved", published_bytes=int(18.21 * GB), torch_at_least_2_1=True,
           conditions=_vit_conditions("16-mixed (Fabric)", 64, "02_mixed-precision.py"), estimate=_vit("16-mixed", 64)),
    Figure(name="vit-l16-bf16true-b64", source=RASBT_LOGS, quote=_LOG + "'03_bfloat16.py': 'Memory used: 13.82 GB'",
           quantity="max_memory_reserved", published_bytes=int(13.82 * GB), torch_at_least_2_1=True,
           conditions=_vit_conditions("bf16-true (Fabric)", 64, "03-bfloat16.py"), estimate=_vit("bf16-true", 64)),
    Figure(name="vit-l16-bf16true-b16", source=RASBT_LOGS,
           quote=_LOG + "'04_lower-batchsize.py': '- batch size 16' ... 'Memory used: 5.69 GB'",
           quantity="max_memory_reserved", published_bytes=int(5.69 * GB), torch_at_least_2_1=True,
           conditions=_vit_conditions("bf16-true (Fabric)", 16, "04_lower-batchsize.py"),
           estimate=_vit("bf16-true", 16)),
    Figure(name="vit-l16-bf16true-b4-accum4", source=RASBT_LOGS,
           quote=_LOG + "'05_gradient-accum.py': 'Memory used: 3.91 GB'",
           quantity="max_memory_reserved", published_bytes=int(3.91 * GB), torch_at_least_2_1=True,
           conditions=_vit_conditions("bf16-true (Fabric)", 4, "05_gradient-accum.py",
                                      loop="loss / 4; backward; every 4th micro-batch: step, zero_grad"),
           estimate=_vit("bf16-true", 4, accumulate=True),
           note="micro-batch 4, 4 accumulation steps: one traced step is the whole cycle of 4 micro-batches "
                "(ACCUMULATION)"),
]


# --- the 2022 Trainer figures (transformers' single-GPU performance page) -----------------------------------
def _bert(precision: str, batch: int, *, optimizer: str = "adamw", checkpointing: bool = False):
    """The 2022 Trainer's step: BertForSequenceClassification from bert-large-uncased's config, eager attention
    (2022's BERT had no SDPA), dropout 0.1; autocast with its weight cache (fp16) and a GradScaler; the gradients
    zeroed in place and kept (model.zero_grad(), set_to_none=False in torch 1.x); transformers' 2022 AdamW
    (AdamW2022, no weight decay: Trainer's default), or transformers' Adafactor with
    the Trainer's arguments; gradient checkpointing as model.gradient_checkpointing_enable() ran it
    (torch.utils.checkpoint, reentrant)."""
    from memplan.estimator import estimate

    def build():
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096, max_position_embeddings=512, num_labels=2)
        config._attn_implementation = "eager"
        model = BertForSequenceClassification(config)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        return model

    def run(published_torch: bool):
        if optimizer == "adafactor":
            from transformers.optimization import Adafactor

            make = lambda p: Adafactor(p, lr=5e-5, scale_parameter=False, relative_step=False)  # noqa: E731
        else:
            make = lambda p: AdamW2022(p, lr=5e-5, weight_decay=0.0)  # noqa: E731
        batch_ = {"input_ids": torch.randint(100, 30000, (batch, 512)), "labels": torch.randint(0, 2, (batch,))}
        with environment_variable("CUDA_MODULE_LOADING", "EAGER"):  # CUDA 11.2: no lazy loading
            with torch_1_10_softmax() if published_torch else contextlib.nullcontext():
                return estimate(build, batch_, loss=lambda m, b: m(**b).loss, optimizer=make, precision=precision,
                                device="V100-16GB", loop="torch-keep-grads")

    return run


def _hf(name: str, args: str, mib: int, precision: str, batch: int, accumulation: int, *, optimizer: str = "adamw",
        checkpointing: bool = False) -> Figure:
    return Figure(
        name=name, source=HF_PAGE,
        quote=f"TrainingArguments({args}, **default_args) ... 'GPU memory occupied: {mib} MB.'",
        quantity="nvml_used", published_bytes=mib * MiB, torch_at_least_2_1=False,
        conditions={"model": "bert-large-uncased (BertForSequenceClassification, 335.1M parameters)",
                    "batch": f"{batch} x {accumulation} accumulation" if accumulation > 1 else str(batch),
                    "input": "512 tokens",
                    "precision": "16-mixed (fp16=True, torch.cuda.amp)" if precision == "16-mixed"
                    else "32-true", "optimizer": "Adafactor (optim='adafactor')" if optimizer == "adafactor"
                    else "AdamW (Trainer default, weight_decay 0)", "gpu": HF_GPU, "torch": HF_TORCH,
                    "checkpointing": "gradient_checkpointing=True" if checkpointing else "none",
                    "loop": HF_SETUP},
        estimate=_bert(precision, batch, optimizer=optimizer, checkpointing=checkpointing),
        note=f"NVML 'used' = the CUDA context (the page measured {HF_CONTEXT_MIB} MiB with a 1x1 tensor: memplan "
             "assumes 1536 MiB under EAGER loading) + the cache; Trainer clips gradients (max_grad_norm 1.0, not "
             "traced: scalars per parameter)")


HF_FIGURES = [
    _hf("bert-large-fp32-b4-trainer", "per_device_train_batch_size=4", 14949, "32-true", 4, 1),
    _hf("bert-large-fp32-b1-accum4", "per_device_train_batch_size=1, gradient_accumulation_steps=4", 8681,
        "32-true", 1, 4),
    _hf("bert-large-fp32-b1-accum4-gc", "per_device_train_batch_size=1, gradient_accumulation_steps=4, "
        "gradient_checkpointing=True", 6775, "32-true", 1, 4, checkpointing=True),
    _hf("bert-large-fp16-b4", "per_device_train_batch_size=4, fp16=True", 13939, "16-mixed", 4, 1),
    _hf("bert-large-fp16-b1-accum4-gc", "per_device_train_batch_size=1, gradient_accumulation_steps=4, "
        "gradient_checkpointing=True, fp16=True", 7275, "16-mixed", 1, 4, checkpointing=True),
    _hf("bert-large-adafactor-b4", "per_device_train_batch_size=4, optim=\"adafactor\"", 12295, "32-true", 4, 1,
        optimizer="adafactor"),
    _hf("bert-large-adafactor-fp16-b1-accum4-gc", "per_device_train_batch_size=1, gradient_accumulation_steps=4, "
        "gradient_checkpointing=True, fp16=True, optim=\"adafactor\"", 4847, "16-mixed", 1, 4, optimizer="adafactor",
        checkpointing=True),
]


# --- torchtitan's Llama 3.1 8B on 8 x H100 (FSDP2) -------------------------------------------------------------
def _torchtitan(published_torch: bool):
    from benchmarks import torchtitan_memory

    return torchtitan_memory.estimate("op")


TORCHTITAN_FIGURE = Figure(
    name="torchtitan-llama3.1-8b-fsdp2-8xh100", source="https://github.com/pytorch/torchtitan/blob/"
    "31a17bfdb70bab6f62a13d21816a5339b911d6e3/benchmarks/llama3_h100_202412_torchtitan.md",
    quote="**Table 1** 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16. "
          "Selective activation checkpointing. | FSDP | 5,762 | 82.4 |", quantity="max_memory_reserved",
    published_bytes=int(82.4 * GiB), torch_at_least_2_1=True,
    conditions={"model": "torchtitan Llama 3.1 8B (benchmarks/torchtitan_memory.py)", "batch": "2 per rank, 8 ranks",
                "input": "8192 tokens", "precision": "FSDP2 bf16 parameters, fp32 reduce", "optimizer": "AdamW foreach",
                "gpu": "8 x H100 96GB (traced as H100-80GB)", "torch": "nightly, 2024-12 (torchtitan at that commit)",
                "checkpointing": "selective, per op",
                "loop": "torchtitan train.py (loss, del pred, clip_grad_norm_ foreach, AdamW step); "
                        "caching allocator with its default settings (the page does not state the launch environment; "
                        "see torchtitan_memory.py)"},
    estimate=_torchtitan,
    note="traced with the caching allocator's default settings; run_llama_train.sh's expandable_segments:True, "
         "and Table 3's figure for the same step on 128 GPUs, are compared in "
         "benchmarks/results/torchtitan_memory.md")

FIGURES: list[Figure] = [*VIT_FIGURES, *HF_FIGURES, TORCHTITAN_FIGURE]
