"""AllocatorConfig: PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF read as c10/core/AllocatorConfig.cpp reads
them (which variable wins, every documented key, errors naming the key), and the settings' effect on
CachingAllocatorModel's segments. The allocator's own rules are tests/estimator/test_allocator.py's."""
import pytest

from memplan.estimator.allocator import AllocatorConfig, CachingAllocatorModel
from memplan.units import MiB


def test_config_from_env_reads_the_cuda_variable():
    cfg = AllocatorConfig.from_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True, max_split_size_mb:128"})
    assert cfg.expandable_segments is True
    assert cfg.max_split_size_bytes == 128 * MiB
    assert AllocatorConfig.from_env({}) == AllocatorConfig()


def test_config_pytorch_alloc_conf_wins_and_the_other_is_not_read():
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    cfg = AllocatorConfig.from_env(env)
    assert cfg.max_split_size_bytes == 64 * MiB
    assert cfg.expandable_segments is False


def test_config_accepts_every_documented_key():
    cfg = AllocatorConfig.parse(
        "max_split_size_mb:40,max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,"
        "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],expandable_segments:False,"
        "large_segment_size_mb:64,pinned_use_background_threads:True,release_lock_on_cudamalloc:True")
    assert cfg.max_non_split_rounding_bytes == 30 * MiB
    assert cfg.large_segment_size_bytes == 64 * MiB
    assert cfg.garbage_collection_threshold == 0.5  # accepted, has no effect in the model
    # c10/test/core/AllocatorConfig_test.cpp expects 8,8,2,4,2,4 for 32..1024 MiB; 2048 MiB is '>'.
    assert [cfg.divisions(n * MiB) for n in (32, 64, 128, 256, 512, 1024, 2048)] == [8, 8, 2, 4, 2, 4, 1]
    assert AllocatorConfig.parse("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16


def test_large_segment_size_sets_segment_and_expandable_page():
    a = CachingAllocatorModel(AllocatorConfig(large_segment_size_bytes=64 * MiB))
    a.malloc(3 * MiB)
    assert a.reserved_bytes == 64 * MiB
    e = CachingAllocatorModel(AllocatorConfig(large_segment_size_bytes=64 * MiB, expandable_segments=True))
    e.malloc(12 * MiB)
    assert e.reserved_bytes == 64 * MiB


@pytest.mark.parametrize("text, key", [
    ("max_split_size_mb:10", "max_split_size_mb"),
    ("max_split_size_mb:lots", "max_split_size_mb"),
    ("max_non_split_rounding_mb:5", "max_non_split_rounding_mb"),
    ("large_segment_size_mb:10", "large_segment_size_mb"),
    ("expandable_segments:true", "expandable_segments"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions"),
    ("roundup_power2_divisions:[100:4]", "roundup_power2_divisions"),
    ("roundup_power2_divisions:[64:8", "roundup_power2_divisions"),
    ("garbage_collection_threshold:1.5", "garbage_collection_threshold"),
    ("backend:tensorflow", "backend"),
    ("expandable_segment:True", "expandable_segment"),
    ("expandable_segments", "expandable_segments"),
    ("max_split_size_mb:128;expandable_segments:True", "max_split_size_mb"),
])
def test_config_errors_name_the_key(text, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        AllocatorConfig.from_env({"PYTORCH_CUDA_ALLOC_CONF": text})


def test_cuda_malloc_async_backend_is_parsed_but_not_modelled():
    cfg = AllocatorConfig.parse("backend:cudaMallocAsync")
    assert cfg.backend == "cudaMallocAsync"
    with pytest.raises(ValueError, match="backend:cudaMallocAsync"):
        CachingAllocatorModel(cfg)
