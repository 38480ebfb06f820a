"""Which 16-bit ops grow the CUDA context (memory outside the caching allocator) under lazy module loading.

The H200 campaign of session 13 measured NVML's process peak less max_memory_reserved at 742 MiB for every fp32
step without cuDNN and for 16-bit MLPs, but 758 MiB for every 16-bit transformer step (GPT-2, BERT, Llama, BART, T5,
16-mixed and bf16-mixed alike); memplan's context model (memplan/estimator/cuda/overheads.py) adds 18 MiB for cuDNN
only. Each op below runs, forward and backward, in a fresh process after a warm-up that loads what every step loads
(an fp32 linear's forward and backward: cuBLAS on both threads); the context's growth is NVML's process memory less
torch's reserved bytes, after the op against before it.

    python -m benchmarks.gpu_context_ops OUT.json [OP ...]      (on a CUDA machine with NVML; about a minute)
"""
from __future__ import annotations

import json
import subprocess
import sys

OPS = ("nothing", "linear_fp16", "linear_bf16", "bmm_bf16", "softmax_bf16", "layer_norm_bf16", "gelu_bf16",
       "dropout_bf16", "sdpa_bf16", "sdpa_fp32", "sdpa_fp16", "sdpa_bf16_masked", "sdpa_fp16_masked",
       "sdpa_bf16_math", "embedding_bf16_autocast", "cross_entropy_bf16", "mul_add_bf16", "gpt2_block_bf16_autocast")


def _run(op: str, device: str = "cuda"):
    """One op, forward and backward, on `device` (CPU: the tests' smoke run of every op)."""
    import torch
    import torch.nn.functional as F

    def leaf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    if op == "nothing":
        return
    if op.startswith("linear_"):
        dtype = torch.float16 if op.endswith("fp16") else torch.bfloat16
        F.linear(leaf(64, 256, dtype=dtype), leaf(256, 256, dtype=dtype)).sum().backward()
    elif op == "bmm_bf16":
        torch.bmm(leaf(8, 64, 32), leaf(8, 32, 64)).sum().backward()
    elif op == "softmax_bf16":
        (torch.softmax(leaf(8, 64, 64), -1) * 2).sum().backward()
    elif op == "layer_norm_bf16":
        F.layer_norm(leaf(64, 256), (256,), leaf(256), leaf(256)).sum().backward()
    elif op == "gelu_bf16":
        F.gelu(leaf(64, 256)).sum().backward()
    elif op == "dropout_bf16":
        F.dropout(leaf(64, 256), 0.1).sum().backward()
    elif op.startswith("sdpa_"):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[op.split("_")[1]]
        q, k, v = (leaf(2, 4, 128, 64, dtype=dtype) for _ in range(3))
        if op.endswith("_math"):
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        elif op.endswith("_masked"):  # an additive mask: no flash kernel, memory-efficient attention
            mask = torch.randn(2, 4, 128, 128, device=device, dtype=dtype)
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
        else:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    elif op == "embedding_bf16_autocast":
        with torch.autocast(device, dtype=torch.bfloat16):
            ids = torch.randint(0, 100, (64,), device=device)
            F.embedding(ids, leaf(100, 256, dtype=torch.float32)).sum().backward()
    elif op == "cross_entropy_bf16":
        F.cross_entropy(leaf(64, 1000), torch.randint(0, 1000, (64,), device=device)).backward()
    elif op == "mul_add_bf16":
        (leaf(64, 256) * 2 + 1).sum().backward()
    elif op == "gpt2_block_bf16_autocast":
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        block = GPT2Block(GPT2Config(n_embd=256, n_head=4, attn_implementation="sdpa"), layer_idx=0).to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            out = block(torch.randn(2, 128, 256, device=device))[0]
        out.float().sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()


def child(op: str) -> dict:
    import os

    import pynvml
    import torch
    import torch.nn.functional as F

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def outside() -> int:
        torch.cuda.synchronize()
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        used = next(p.usedGpuMemory for p in procs if p.pid == os.getpid())
        return used - torch.cuda.memory_reserved()

    x = torch.randn(64, 256, device="cuda", requires_grad=True)  # warm-up: cuBLAS on both threads
    F.linear(x, torch.randn(256, 256, device="cuda", requires_grad=True)).sum().backward()
    before = outside()
    _run(op)
    return {"op": op, "before": before, "after": outside()}


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if args and args[0] == "--child":
        print(json.dumps(child(args[1])))
        return 0
    rows = []
    for op in args[1:] or OPS:
        done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_context_ops", "--child", op],
                              capture_output=True, text=True, timeout=120)
        try:
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["grew_mib"] = (row["after"] - row["before"]) / 2**20
        except (IndexError, json.JSONDecodeError):
            row = {"op": op, "error": done.stderr[-600:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args[0], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
