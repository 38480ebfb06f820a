"""CUDA overheads outside the tensors: cuBLAS workspaces (from CublasHandlePool.cpp), the CUDA
context and NCCL buffers (approximations checked against the measurements they cite)."""
import pytest

from memplan.estimator.allocator import CachingAllocatorModel
from memplan.estimator.cuda.overheads import CudaOverheads, cublas_workspace_bytes, cuda_overheads, nccl_buffer_bytes
from memplan.units import GiB, KiB, MiB

A100, H100, B200, L40S, V100 = (8, 0), (9, 0), (10, 0), (8, 9), (7, 0)


@pytest.mark.parametrize("cc, expected", [
    (V100, 8 * MiB + 128 * KiB),  # ":4096:2:16:8": 4096 KiB x 2 + 16 KiB x 8
    (A100, 8 * MiB + 128 * KiB),
    (L40S, 8 * MiB + 128 * KiB),
    (H100, 32 * MiB),  # "32MiB for Hopper and Blackwell"
    (B200, 32 * MiB),
    ((12, 0), 32 * MiB),
])
def test_default_cublas_workspace_by_generation(cc, expected):
    assert cublas_workspace_bytes(cc, env={}) == expected
    assert cuda_overheads(cc, env={}).cublas_workspace_bytes == expected


@pytest.mark.parametrize("config, expected", [
    (":4096:8", 32 * MiB),
    (":16:8", 128 * KiB),
    (":4096:2:16:8", 8 * MiB + 128 * KiB),
    ("garbage", 8 * MiB + 128 * KiB),  # torch warns and keeps the default
])
def test_cublas_workspace_config_overrides_the_default(config, expected):
    assert cublas_workspace_bytes(A100, env={"CUBLAS_WORKSPACE_CONFIG": config}) == expected


def test_cublaslt_has_its_own_workspace_unless_unified():
    """torch 2.11 (measured on an H200): a separate 1 MiB cuBLASLt workspace per thread unless
    TORCH_CUBLASLT_UNIFIED_WORKSPACE=1."""
    assert cuda_overheads(H100, env={}).allocator_workspaces == (32 * MiB, 1 * MiB, 32 * MiB, 1 * MiB)
    unified = cuda_overheads(H100, env={"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"})
    assert unified.cublaslt_workspace_bytes == 0 and unified.allocator_workspaces == (32 * MiB, 32 * MiB)
    split = cuda_overheads(A100, env={"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"})
    assert split.cublaslt_workspace_bytes == 1 * MiB  # CUBLASLT_WORKSPACE_SIZE default 1024 KiB
    assert sorted(split.allocator_workspaces) == [1 * MiB, 1 * MiB, 8519680, 8519680]
    sized = cuda_overheads(A100, env={"CUBLASLT_WORKSPACE_SIZE": "4096"})
    assert sized.cublaslt_workspace_bytes == 4 * MiB


def test_workspaces_through_the_allocator_model_show_up_as_reserved_segments():
    a100 = CachingAllocatorModel()
    for n in cuda_overheads(A100, env={"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}).allocator_workspaces:
        a100.malloc(n)  # 8.125 MiB: one 20 MiB segment, the second reuses its split-off rest
    assert (a100.allocated_bytes, a100.reserved_bytes) == (2 * 8519680, 20 * MiB)
    h100 = CachingAllocatorModel()
    for n in cuda_overheads(H100, env={"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}).allocator_workspaces:
        h100.malloc(n)  # 32 MiB each: >= 10 MiB, a segment of its own
    assert (h100.allocated_bytes, h100.reserved_bytes) == (64 * MiB, 64 * MiB)


def test_context_is_in_the_reported_range_and_grows_with_generation():
    lazy = [cuda_overheads(cc, env={}).context_bytes for cc in (V100, A100, H100, B200)]
    assert all(256 * MiB <= c <= 1 * GiB for c in lazy)  # 270-730 MiB reported or estimated
    assert lazy == sorted(lazy)
    assert cuda_overheads(A100, env={"CUDA_MODULE_LOADING": "LAZY"}).context_bytes == lazy[1]
    eager = cuda_overheads(A100, env={"CUDA_MODULE_LOADING": "EAGER"})
    assert eager.context_bytes >= 666_632_192  # pytorch/pytorch#86509 measured eager loading
    assert any("EAGER" in note for note in eager.notes)


@pytest.mark.parametrize("cc", [(9,), (9, "0"), (2, 0), "sm90"])
def test_bad_compute_capability_is_rejected(cc):
    with pytest.raises(ValueError, match="compute_capability"):
        cuda_overheads(cc, env={})


def test_overheads_reject_negative_fields():
    with pytest.raises(ValueError, match="CudaOverheads.context_bytes"):
        CudaOverheads(context_bytes=-1, cublas_workspace_bytes=0)


def test_nccl_needs_no_buffers_for_one_rank_and_rejects_zero():
    assert nccl_buffer_bytes(1, env={}) == 0
    with pytest.raises(ValueError, match="world_size"):
        nccl_buffer_bytes(0, env={})
    with pytest.raises(ValueError, match="channels"):
        nccl_buffer_bytes(2, channels=0, env={})


def test_nccl_estimate_is_at_or_above_the_a100_measurements():
    # NVIDIA/nccl#964: 4x A100 NVLink, 544 MB for a 2-rank group and 688 MB for larger ones.
    two, four = nccl_buffer_bytes(2, compute_capability=A100, env={}), nccl_buffer_bytes(4, compute_capability=A100, env={})
    assert 544e6 <= two <= 1.5 * 544e6
    assert 688e6 <= four <= 1.5 * 688e6
    assert nccl_buffer_bytes(8, compute_capability=A100, env={}) == four  # ring + tree: flat in size


def test_nccl_buffers_scale_with_channels_and_buffer_sizes():
    base = nccl_buffer_bytes(2, channels=8, env={})
    # 8 more channels x 2 connections x (Simple 4 MiB + LL 512 KiB + LL128 4,915,200 B)
    assert nccl_buffer_bytes(2, channels=16, env={}) - base == 8 * 2 * (4 * MiB + 512 * KiB + 4_915_200)
    smaller = nccl_buffer_bytes(2, channels=8, env={"NCCL_BUFFSIZE": str(2 * MiB)})
    assert base - smaller == 8 * 2 * 2 * MiB
    capped = nccl_buffer_bytes(4, compute_capability=H100, env={"NCCL_MAX_NCHANNELS": "4"})
    assert capped == nccl_buffer_bytes(4, channels=4, env={})
    assert nccl_buffer_bytes(4, compute_capability=H100, env={}) > nccl_buffer_bytes(4, compute_capability=A100, env={})
