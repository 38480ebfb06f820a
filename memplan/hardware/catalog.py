"""Known GPU models, for planning on a machine that does not have the GPU (`--gpu H100-80GB`).

Memory figures are what NVML (and so nvidia-smi and nvitop) reports as the board's *total*, in MiB
times 1 MiB, because that is the number a user compares a plan with. They are neither the marketing
figure (NVIDIA sells "80 GB" in decimal gigabytes, with headroom: an H100 "80 GB" reports 81559 MiB
= 85.5 GB) nor what a training process can allocate: the CUDA context and the driver take a few
hundred MiB more, which memplan's estimate accounts for separately.

Sources: nvidia-smi output published for each board (collected, with the units spelled out, in
https://thundergolfer.com/blog/nvidia-gpu-memory-capacity for H200, H100, A100, A10, L40S, L4, T4;
nvidia-smi transcripts in public repositories for the rest). Figures move by a few MiB to a few
tens of MiB with the driver and with ECC; the comments below say where we have seen them move.
Compute capabilities are NVIDIA's (https://developer.nvidia.com/cuda-gpus).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from memplan.units import MiB, format_bytes, parse_bytes

BF16_MIN_CAPABILITY = (8, 0)
"""Native bf16 tensor cores arrived with Ampere (sm_80). Older cards run bf16 only by emulation."""


def supports_bf16(compute_capability: tuple[int, int]) -> bool:
    """True when the GPU has native bf16 (sm_80+), the condition for Lightning's "bf16-mixed"."""
    return tuple(compute_capability) >= BF16_MIN_CAPABILITY


@dataclass(frozen=True, kw_only=True)
class GpuModel:
    """A GPU model memplan can plan for without the hardware."""

    name: str
    """Canonical name, as accepted by `--gpu` (e.g. "H100-80GB")."""
    total_bytes: int
    """Board memory in bytes as NVML reports it (nvidia-smi's total), or the given size for custom."""
    compute_capability: tuple[int, int]
    """CUDA compute capability (major, minor), e.g. (9, 0) for Hopper."""
    aliases: tuple[str, ...] = ()
    """Other spellings accepted by lookup_gpu (matched ignoring case and punctuation)."""
    nvml_names: tuple[str, ...] = ()
    """Names NVML gives this board (nvmlDeviceGetName), used by match_nvml_name."""
    sm_count: int | None = None
    """Streaming multiprocessors (NVIDIA's specification; the larger where SXM and PCIe boards share a name):
    kernels size per-launch buffers by it (a CUDA sum's staging buffer, cuDNN's dropout state). None: unknown."""

    def __post_init__(self) -> None:
        if not isinstance(self.total_bytes, int) or self.total_bytes <= 0:
            raise ValueError(
                f"GpuModel.total_bytes must be a positive int of bytes (e.g. 24 * GiB); "
                f"got {self.total_bytes!r}"
            )
        cc = self.compute_capability
        if (not isinstance(cc, tuple) or len(cc) != 2
                or not all(isinstance(x, int) and x >= 0 for x in cc)):
            raise ValueError(
                f"GpuModel.compute_capability must be a (major, minor) tuple of ints such as (8, 0); "
                f"got {cc!r}"
            )

    @property
    def bf16_supported(self) -> bool:
        """Native bf16 (compute capability 8.0 or newer)."""
        return supports_bf16(self.compute_capability)


def _m(name: str, mib: int, cc: tuple[int, int], aliases: tuple[str, ...],
       nvml: tuple[str, ...], sms: int) -> GpuModel:
    return GpuModel(name=name, total_bytes=mib * MiB, compute_capability=cc,
                    aliases=aliases, nvml_names=nvml, sm_count=sms)


KNOWN_GPUS: tuple[GpuModel, ...] = (
    # Volta (no bf16). 16160 MiB on most drivers (16152 and 16130 also seen); 32510 MiB for 32 GB
    # (32480 and 32768 also seen).
    _m("V100-16GB", 16160, (7, 0), ("v100-16g", "v100-sxm2-16gb", "v100-pcie-16gb"),
       ("Tesla V100-SXM2-16GB", "Tesla V100-PCIE-16GB", "Tesla V100-FHHL-16GB"), 80),
    _m("V100-32GB", 32510, (7, 0), ("v100-32g", "v100-sxm2-32gb", "v100-pcie-32gb"),
       ("Tesla V100-SXM2-32GB", "Tesla V100-PCIE-32GB"), 80),
    # Turing (no bf16). 15360 MiB with current drivers; drivers before R510 said 15109 MiB
    # (they left the driver's reservation out of the total).
    _m("T4", 15360, (7, 5), ("tesla-t4", "t4-16gb"), ("Tesla T4",), 40),
    # Ampere. A100 PCIe boards report the same totals as SXM4 (40960 / 81920 MiB).
    _m("A10G", 23028, (8, 6), ("a10g-24gb",), ("NVIDIA A10G",), 80),
    _m("A100-40GB", 40960, (8, 0), ("a100-40g", "a100-sxm4-40gb", "a100-pcie-40gb"),
       ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), 108),
    _m("A100-80GB", 81920, (8, 0), ("a100-80g", "a100-sxm4-80gb", "a100-pcie-80gb"),
       ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"), 108),
    _m("A40", 46068, (8, 6), ("a40-48gb",), ("NVIDIA A40",), 84),
    _m("RTX-A6000", 49140, (8, 6), ("a6000", "rtxa6000"), ("NVIDIA RTX A6000",), 84),
    # 24576 MiB on Linux; Windows/WDDM drivers report less.
    _m("RTX-3090", 24576, (8, 6), ("3090", "rtx3090"), ("NVIDIA GeForce RTX 3090",), 82),
    # Ada Lovelace.
    _m("L4", 23034, (8, 9), ("l4-24gb",), ("NVIDIA L4",), 58),
    _m("L40", 46068, (8, 9), ("l40-48gb",), ("NVIDIA L40",), 142),
    _m("L40S", 46068, (8, 9), ("l40s-48gb",), ("NVIDIA L40S",), 142),
    _m("RTX-4090", 24564, (8, 9), ("4090", "rtx4090"), ("NVIDIA GeForce RTX 4090",), 128),
    _m("RTX-6000-Ada", 49140, (8, 9), ("rtx6000ada", "6000ada"),
       ("NVIDIA RTX 6000 Ada Generation",), 142),
    # Hopper. SXM5 and PCIe 80 GB boards both report 81559 MiB (132 and 114 SMs: the larger is kept).
    _m("H100-80GB", 81559, (9, 0), ("h100", "h100-sxm", "h100-pcie", "h100-80gb-hbm3"),
       ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"), 132),
    _m("H100-NVL", 95830, (9, 0), ("h100-94gb", "h100nvl"), ("NVIDIA H100 NVL",), 132),
    _m("H200", 143771, (9, 0), ("h200-141gb", "h200-nvl"), ("NVIDIA H200", "NVIDIA H200 NVL"), 132),
    # Blackwell.
    _m("B200", 183359, (10, 0), ("b200-180gb",), ("NVIDIA B200",), 148),
)

_VENDOR_WORDS = {"nvidia", "tesla", "geforce"}


def _key(name: str) -> str:
    """'NVIDIA A100-SXM4-80GB' -> 'a100sxm480g': no case, punctuation, vendor words or 'B' of GB."""
    words = [w for w in re.split(r"[^0-9a-z]+", name.lower()) if w and w not in _VENDOR_WORDS]
    return re.sub(r"(\d)gb\b", r"\1g", " ".join(words)).replace(" ", "")


def _build_index() -> dict[str, GpuModel]:
    index: dict[str, GpuModel] = {}
    for model in KNOWN_GPUS:
        for spelling in (model.name, *model.aliases, *model.nvml_names):
            key = _key(spelling)
            other = index.setdefault(key, model)
            if other is not model:
                raise RuntimeError(f"catalog: {spelling!r} names both {other.name} and {model.name}")
    return index


_INDEX = _build_index()
_NVML_INDEX = {_key(n): model for model in KNOWN_GPUS for n in model.nvml_names}
# Bare family names that stand for several boards: ask rather than guess.
_AMBIGUOUS = {"v100": ("V100-16GB", "V100-32GB"), "a100": ("A100-40GB", "A100-80GB")}


def known_gpu_names() -> tuple[str, ...]:
    """Canonical names of every catalogued GPU, in catalog order."""
    return tuple(model.name for model in KNOWN_GPUS)


def streaming_multiprocessors(name: str, compute_capability: tuple[int, int]) -> int:
    """SMs of the GPU named `name` (a catalog or NVML spelling); for a GPU outside the catalog, the most of any
    catalogued board of its generation (compute capability major), else of any: buffers sized by SMs are then
    not under-counted."""
    try:
        model = lookup_gpu(name)
    except UnknownGpu:
        model = match_nvml_name(name)
    if model is not None and model.sm_count:
        return model.sm_count
    same = [m.sm_count for m in KNOWN_GPUS if m.compute_capability[0] == compute_capability[0]]
    return max(same or [m.sm_count for m in KNOWN_GPUS])


_THREADS_PER_SM = {(7, 5): 1024, (8, 6): 1536, (8, 9): 1536, (12, 0): 1536}
"""maxThreadsPerMultiProcessor where it is not 2048 (CUDA C Programming Guide, compute capabilities table)."""


def max_threads_per_sm(compute_capability: tuple[int, int]) -> int:
    """Resident threads per SM of a GPU of `compute_capability`."""
    return _THREADS_PER_SM.get(tuple(compute_capability), 2048)


class UnknownGpu(ValueError):
    """A GPU name the catalog does not know, or a family name that stands for several boards. The message
    names it as --gpu's; a caller that takes the name elsewhere says `what` after its own name for it."""

    def __init__(self, name: str, *, boards: tuple[str, ...] = ()) -> None:
        self.name = name
        """The name as given."""
        self.boards = boards
        """The boards a family name stands for ('A100': A100-40GB, A100-80GB); empty for an unknown name."""
        self.what = (f"{name!r} is ambiguous: say {' or '.join(boards)}." if boards else
                     f"{name!r} is not a GPU memplan knows. Known: {', '.join(known_gpu_names())}. "
                     "For any other GPU give its memory instead, e.g. --gpu-memory 24GiB.")
        """What is wrong with the name, starting with it."""
        super().__init__(f"--gpu {self.what}")


def lookup_gpu(name: str) -> GpuModel:
    """A catalogued GPU by name or alias, ignoring case and punctuation ('h100', 'a100_80g',
    'NVIDIA A100-SXM4-80GB'). Raises UnknownGpu (a ValueError) naming the known GPUs when nothing matches."""
    key = _key(name)
    if key in _INDEX:
        return _INDEX[key]
    raise UnknownGpu(name, boards=_AMBIGUOUS.get(key, ()))


def match_nvml_name(nvml_name: str) -> GpuModel | None:
    """The catalogued model for a name NVML reports ("NVIDIA H100 80GB HBM3"), or None for a board
    not in the catalog. A MIG slice ("NVIDIA A100-SXM4-40GB MIG 1g.5gb") is not its board: None."""
    return _NVML_INDEX.get(_key(nvml_name))


def custom_gpu(total_bytes: int | str, compute_capability: tuple[int, int] = (8, 0)) -> GpuModel:
    """A GPU outside the catalog, from its memory (`--gpu-memory 24GiB`): bytes or a size string."""
    size = parse_bytes(total_bytes, field="--gpu-memory")
    if size <= 0:
        raise ValueError(f"--gpu-memory must be a positive size such as 24GiB; got {total_bytes!r}")
    return GpuModel(name=f"custom-{format_bytes(size).replace(' ', '')}", total_bytes=size,
                    compute_capability=compute_capability)


__all__ = ["BF16_MIN_CAPABILITY", "GpuModel", "KNOWN_GPUS", "custom_gpu", "known_gpu_names",
           "lookup_gpu", "match_nvml_name", "max_threads_per_sm", "streaming_multiprocessors", "supports_bf16",
           "UnknownGpu"]


# --- interconnect and compute, for the planner's communication cost (memplan/planner/costs.py) -------

@dataclass(frozen=True, kw_only=True)
class GpuLinks:
    """How fast one GPU of a model computes, reads its memory and talks to its peers; figures per GPU,
    one direction, dense (no 2:4 sparsity)."""

    intra_node_bytes_per_s: float
    """GPU-to-GPU bandwidth inside a node: NVLink where the SXM board has it, else the PCIe slot."""
    dense_half_flops: float
    """Dense bf16 (fp16 before Ampere) tensor-core FLOP/s, without sparsity."""
    link: str
    """The link, in words ('NVLink 4', 'PCIe 4.0 x16')."""
    dense_tf32_flops: float
    """Dense TF32 tensor-core FLOP/s (what fp32 convolutions run at: cuDNN allows TF32 by default);
    the fp32 figure on GPUs without TF32 (before Ampere)."""
    fp32_flops: float
    """fp32 FLOP/s on the CUDA cores (what fp32 matmuls run at: torch keeps TF32 off for them by default)."""
    hbm_bytes_per_s: float
    """Device memory (HBM / GDDR) bandwidth."""


INTER_NODE_BYTES_PER_S = 50e9
"""Network bandwidth per GPU between nodes: one 400 Gb/s InfiniBand NDR / RoCE port per GPU, as in
NVIDIA's DGX H100 reference architecture (8 x ConnectX-7 at 400 Gb/s for 8 GPUs). Older clusters
with 200 Gb/s HDR per GPU have half of it."""

_PCIE3, _PCIE4, _PCIE5 = 16e9, 32e9, 64e9
"""PCIe x16 per direction: 3.0 (~16 GB/s), 4.0 (~32 GB/s), 5.0 (~64 GB/s)."""

# Sources: NVIDIA's datasheets (NVLink bandwidth is quoted bidirectional there; halved here):
# V100 https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
# T4 https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf
# A100 https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
# A10/A10G, A40, RTX A6000, L4, L40, L40S, RTX 6000 Ada: each board's datasheet on nvidia.com (PCIe 4.0 x16);
# RTX 3090 / 4090: NVIDIA Ampere / Ada GA102 / AD102 architecture whitepapers (fp16 with fp32 accumulate);
# H100 / H200 https://www.nvidia.com/en-us/data-center/h100/ and /h200/ (SXM: NVLink 4, 900 GB/s);
# B200 https://www.nvidia.com/en-us/data-center/dgx-b200/ (NVLink 5, 1.8 TB/s per GPU).
# fp32 / TF32 / HBM figures come from the same datasheets (TF32 dense = half the datasheet's sparse figure;
# H100 SXM's 66.9 / 494.7 / 989.4 TFLOP/s and 3.35 TB/s as tabulated in
# https://glennklockwood.com/garden/processors/h100); A10G (AWS's board, no NVIDIA datasheet) takes
# the published A10G figures of AWS's G5 instance page and is the least certain row; Ada and Ampere
# GeForce boards have no TF32 advantage over fp32 for the conv path and list fp32 twice.
# Boards the catalog merges (H100 SXM and PCIe) get the SXM figures.
_LINKS: dict[str, GpuLinks] = {
    "V100-16GB": GpuLinks(intra_node_bytes_per_s=150e9, dense_half_flops=125e12, link="NVLink 2",
                         dense_tf32_flops=1.57e13, fp32_flops=1.57e13, hbm_bytes_per_s=9e11),
    "V100-32GB": GpuLinks(intra_node_bytes_per_s=150e9, dense_half_flops=125e12, link="NVLink 2",
                         dense_tf32_flops=1.57e13, fp32_flops=1.57e13, hbm_bytes_per_s=9e11),
    "T4": GpuLinks(intra_node_bytes_per_s=_PCIE3, dense_half_flops=65e12, link="PCIe 3.0 x16",
                  dense_tf32_flops=8.1e12, fp32_flops=8.1e12, hbm_bytes_per_s=3.2e11),
    "A10G": GpuLinks(intra_node_bytes_per_s=_PCIE4, dense_half_flops=70e12, link="PCIe 4.0 x16",
                    dense_tf32_flops=3.5e13, fp32_flops=3.5e13, hbm_bytes_per_s=6e11),
    "A100-40GB": GpuLinks(intra_node_bytes_per_s=300e9, dense_half_flops=312e12, link="NVLink 3",
                         dense_tf32_flops=1.56e14, fp32_flops=1.95e13, hbm_bytes_per_s=1.555e12),
    "A100-80GB": GpuLinks(intra_node_bytes_per_s=300e9, dense_half_flops=312e12, link="NVLink 3",
                         dense_tf32_flops=1.56e14, fp32_flops=1.95e13, hbm_bytes_per_s=2.039e12),
    "A40": GpuLinks(intra_node_bytes_per_s=_PCIE4, dense_half_flops=150e12, link="PCIe 4.0 x16",
                   dense_tf32_flops=7.48e13, fp32_flops=3.74e13, hbm_bytes_per_s=6.96e11),
    "RTX-A6000": GpuLinks(intra_node_bytes_per_s=_PCIE4, dense_half_flops=155e12, link="PCIe 4.0 x16",
                         dense_tf32_flops=7.74e13, fp32_flops=3.87e13, hbm_bytes_per_s=7.68e11),
    "RTX-3090": GpuLinks(intra_node_bytes_per_s=_PCIE4, dense_half_flops=71e12, link="PCIe 4.0 x16",
                        dense_tf32_flops=3.56e13, fp32_flops=3.56e13, hbm_bytes_per_s=9.36e11),
    "L4": GpuLinks(intra_node_bytes_per_s=_PCIE4, dense_half_flops=121e12, link="PCIe 4.0 x16",
                  dense_tf32_flops=6e13, fp32_flops=3.03e13, hbm_bytes_per_s=3e11),
    "L40": GpuLinks(intra_node_bytes_per_s=_PCIE4, dense_half_flops=181e12, link="PCIe 4.0 x16",
                   dense_tf32_flops=9.05e13, fp32_flops=9.05e13, hbm_bytes_per_s=8.64e11),
    "L40S": GpuLinks(intra_node_bytes_per_s=_PCIE4, dense_half_flops=362e12, link="PCIe 4.0 x16",
                    dense_tf32_flops=1.83e14, fp32_flops=9.16e13, hbm_bytes_per_s=8.64e11),
    "RTX-4090": GpuLinks(intra_node_bytes_per_s=_PCIE4, dense_half_flops=165e12, link="PCIe 4.0 x16",
                        dense_tf32_flops=8.26e13, fp32_flops=8.26e13, hbm_bytes_per_s=1.008e12),
    "RTX-6000-Ada": GpuLinks(intra_node_bytes_per_s=_PCIE4, dense_half_flops=364e12, link="PCIe 4.0 x16",
                            dense_tf32_flops=1.82e14, fp32_flops=9.11e13, hbm_bytes_per_s=9.6e11),
    "H100-80GB": GpuLinks(intra_node_bytes_per_s=450e9, dense_half_flops=989e12, link="NVLink 4",
                         dense_tf32_flops=4.947e14, fp32_flops=6.69e13, hbm_bytes_per_s=3.35e12),
    "H100-NVL": GpuLinks(intra_node_bytes_per_s=_PCIE5, dense_half_flops=835e12, link="PCIe 5.0 x16",
                        dense_tf32_flops=4.175e14, fp32_flops=6e13, hbm_bytes_per_s=3.9e12),
    "H200": GpuLinks(intra_node_bytes_per_s=450e9, dense_half_flops=989e12, link="NVLink 4",
                    dense_tf32_flops=4.947e14, fp32_flops=6.69e13, hbm_bytes_per_s=4.8e12),
    "B200": GpuLinks(intra_node_bytes_per_s=900e9, dense_half_flops=2250e12, link="NVLink 5",
                    dense_tf32_flops=1.1e15, fp32_flops=7.5e13, hbm_bytes_per_s=8e12),
}
_UNKNOWN_LINKS = GpuLinks(intra_node_bytes_per_s=_PCIE4, dense_half_flops=150e12, link="PCIe 4.0 x16 (assumed)",
                           dense_tf32_flops=75e12, fp32_flops=37e12, hbm_bytes_per_s=700e9)


def gpu_links(name: str) -> GpuLinks:
    """Interconnect and compute figures of a GPU by catalog or NVML name; a PCIe 4.0 board of
    mid-range compute for a GPU the catalog does not know (custom sizes included)."""
    key = _key(name)
    model = _INDEX.get(key) or _NVML_INDEX.get(key)
    return _LINKS.get(model.name, _UNKNOWN_LINKS) if model is not None else _UNKNOWN_LINKS
