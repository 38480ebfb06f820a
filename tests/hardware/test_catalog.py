"""The GPU catalog: lookups a user types, the figures behind them, and the errors they get."""
from __future__ import annotations

import dataclasses

import pytest

from memplan.hardware.catalog import (
    KNOWN_GPUS, GpuModel, custom_gpu, known_gpu_names, lookup_gpu, match_nvml_name, max_threads_per_sm,
    streaming_multiprocessors, supports_bf16,
)
from memplan.units import GiB, MiB

# Marketing size in decimal GB. NVML's total is within a few percent above it (vendors round down
# and sell GB, NVML counts MiB); a figure outside that band is a typo or a GB/GiB mix-up.
MARKETED_GB = {
    "V100-16GB": 16, "V100-32GB": 32, "T4": 16, "A10G": 24, "A100-40GB": 40, "A100-80GB": 80,
    "A40": 48, "RTX-A6000": 48, "RTX-3090": 24, "L4": 24, "L40": 48, "L40S": 48, "RTX-4090": 24,
    "RTX-6000-Ada": 48, "H100-80GB": 80, "H100-NVL": 94, "H200": 141, "B200": 180,
}


@pytest.mark.parametrize("typed, expected", [
    ("h100", "H100-80GB"), ("H100-80GB", "H100-80GB"), ("a100_80g", "A100-80GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("A100 40GB", "A100-40GB"), ("rtx 4090", "RTX-4090"),
    ("RTX3090", "RTX-3090"), ("a6000", "RTX-A6000"), ("Tesla T4", "T4"), ("l40s", "L40S"),
    ("L40", "L40"), ("v100-32g", "V100-32GB"), ("H100 NVL", "H100-NVL"), ("h200", "H200"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX-6000-Ada"), ("b200", "B200"), ("a10g", "A10G"),
])
def test_lookup_ignores_case_punctuation_and_vendor_words(typed, expected):
    assert lookup_gpu(typed).name == expected


def test_catalog_covers_the_boards_people_train_on():
    assert set(MARKETED_GB) == set(known_gpu_names())


def test_memory_is_what_nvml_reports():
    assert lookup_gpu("A100-80GB").total_bytes == 81920 * MiB == 80 * GiB
    assert lookup_gpu("H100-80GB").total_bytes == 81559 * MiB  # less than 80 GiB, more than 80 GB
    assert lookup_gpu("H200").total_bytes == 143771 * MiB
    assert lookup_gpu("T4").total_bytes == 15 * GiB


@pytest.mark.parametrize("model", KNOWN_GPUS, ids=lambda m: m.name)
def test_every_figure_sits_just_above_the_marketed_size(model):
    marketed = MARKETED_GB[model.name] * 10**9
    assert marketed * 0.99 <= model.total_bytes <= marketed * 1.10
    assert model.total_bytes % MiB == 0  # NVML reports whole MiB


@pytest.mark.parametrize("name, bf16", [
    ("V100-16GB", False), ("T4", False), ("A10G", True), ("A100-40GB", True), ("RTX-3090", True),
    ("L4", True), ("RTX-4090", True), ("H100-80GB", True), ("B200", True),
])
def test_bf16_support_by_compute_capability(name, bf16):
    assert lookup_gpu(name).bf16_supported is bf16


def test_supports_bf16_starts_at_sm80():
    assert [supports_bf16(cc) for cc in [(7, 0), (7, 5), (8, 0), (8, 9), (10, 0)]] == [
        False, False, True, True, True]


def test_unknown_gpu_error_lists_known_names_and_the_memory_escape_hatch():
    with pytest.raises(ValueError) as info:
        lookup_gpu("Radeon MI300X")
    message = str(info.value)
    assert "'Radeon MI300X'" in message and "H100-80GB" in message and "RTX-4090" in message
    assert "--gpu-memory 24GiB" in message


@pytest.mark.parametrize("family, options", [("a100", "A100-40GB or A100-80GB"),
                                             ("V100", "V100-16GB or V100-32GB")])
def test_bare_family_name_is_ambiguous_not_guessed(family, options):
    with pytest.raises(ValueError, match=f"ambiguous: say {options}"):
        lookup_gpu(family)


@pytest.mark.parametrize("model", KNOWN_GPUS, ids=lambda m: m.name)
def test_nvml_names_map_back_to_their_model(model):
    assert model.nvml_names, "every catalogued board must say how NVML names it"
    for nvml_name in model.nvml_names:
        assert match_nvml_name(nvml_name) is model


def test_nvml_names_outside_the_catalog_do_not_match():
    assert match_nvml_name("NVIDIA A100-SXM4-80GB MIG 3g.40gb") is None  # a slice, not the board
    assert match_nvml_name("Quadro RTX 6000") is None
    assert match_nvml_name("h100") is None  # user spellings are for lookup_gpu, not NVML names


def test_custom_gpu_from_a_size_string_or_bytes():
    gpu = custom_gpu("24GiB")
    assert gpu.total_bytes == 24 * GiB and gpu.compute_capability == (8, 0) and gpu.bf16_supported
    assert custom_gpu(16 * 10**9, compute_capability=(7, 5)).bf16_supported is False
    assert custom_gpu("80GB").total_bytes == 80 * 10**9  # decimal stays decimal


@pytest.mark.parametrize("size", [0, "0GiB", "24 potatoes", -1])
def test_custom_gpu_rejects_bad_sizes_naming_the_flag(size):
    with pytest.raises(ValueError, match="--gpu-memory"):
        custom_gpu(size)


def test_gpu_model_validates_and_is_frozen():
    with pytest.raises(ValueError, match="compute_capability must be a .major, minor. tuple"):
        custom_gpu("24GiB", compute_capability=(8,))
    with pytest.raises(ValueError, match="total_bytes must be a positive int"):
        GpuModel(name="x", total_bytes=24.5 * GiB, compute_capability=(8, 0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lookup_gpu("T4").total_bytes = 1


def test_every_catalogued_gpu_has_its_sm_count_and_the_count_follows_any_spelling():
    assert all(isinstance(m.sm_count, int) and m.sm_count > 0 for m in KNOWN_GPUS)
    # NVIDIA's specifications: an A100 has 108 SMs, an L4 58, an H100 SXM 132 (its PCIe board's 114 is not kept)
    assert streaming_multiprocessors("A100-80GB", (8, 0)) == 108
    assert streaming_multiprocessors("NVIDIA L4", (8, 9)) == 58
    assert streaming_multiprocessors("h100-pcie", (9, 0)) == 132


def test_a_gpu_outside_the_catalog_gets_the_most_sms_of_its_generation_never_fewer():
    ampere_and_ada = max(m.sm_count for m in KNOWN_GPUS if m.compute_capability[0] == 8)
    assert streaming_multiprocessors("custom-24GiB", (8, 6)) == ampere_and_ada == 142
    assert streaming_multiprocessors("NVIDIA Future GPU", (99, 0)) == max(m.sm_count for m in KNOWN_GPUS)


def test_resident_threads_per_sm_follow_the_compute_capability():
    assert max_threads_per_sm((9, 0)) == max_threads_per_sm((8, 0)) == 2048
    assert max_threads_per_sm((8, 6)) == max_threads_per_sm((8, 9)) == 1536
    assert max_threads_per_sm((7, 5)) == 1024
