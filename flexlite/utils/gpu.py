"""GPU detection: architecture, feature flags (TMA, FP8, warpgroup MMA) and sizes of a CUDA device.

Everything is read from ``torch.cuda.get_device_properties``; nothing here launches a kernel.
"""

from __future__ import annotations

import dataclasses
import enum

import torch


class GPUArch(enum.Enum):
    """NVIDIA GPU generations by SM version (the value names the lowest SM of the family)."""

    VOLTA = "sm_70"       # V100 (sm_70, sm_72)
    TURING = "sm_75"      # T4, RTX 20xx
    AMPERE = "sm_80"      # A100 (sm_80), RTX 30xx / A10 (sm_86), Orin (sm_87)
    ADA = "sm_89"         # L4, L40, RTX 40xx
    HOPPER = "sm_90"      # H100, H200
    BLACKWELL = "sm_100"  # B200 / GB200 (sm_100), sm_10x, sm_11x, RTX 50xx (sm_120), sm_12x
    UNKNOWN = "unknown"   # older NVIDIA GPUs, newer families not listed here, and AMD (ROCm) GPUs


@dataclasses.dataclass(frozen=True)
class GPUCapabilities:
    """What :func:`detect_gpu` found.

    Attributes:
        name: device name, e.g. ``"NVIDIA H100 80GB HBM3"``.
        arch: the :class:`GPUArch`.
        compute_capability: ``(major, minor)``, e.g. ``(9, 0)``.
        has_tma: Tensor Memory Accelerator (SM 9.0 and newer).
        has_fp8: FP8 tensor cores (SM 8.9 and newer: Ada, Hopper, Blackwell).
        has_warpgroup_mma: ``wgmma`` instructions (Hopper only; Blackwell's tensor cores use ``tcgen05``).
        sram_per_sm: shared memory per SM in bytes (what the driver reports, else a per-SM table).
        num_sms: number of streaming multiprocessors.
        total_memory_gb: device memory in GiB.
    """

    name: str
    arch: GPUArch
    compute_capability: tuple[int, int]
    has_tma: bool
    has_fp8: bool
    has_warpgroup_mma: bool
    sram_per_sm: int
    num_sms: int
    total_memory_gb: float


# shared memory per SM in bytes, for drivers/torch builds that do not report it
_SRAM_PER_SM = {(7, 0): 96 * 1024, (7, 2): 96 * 1024, (7, 5): 64 * 1024, (8, 0): 164 * 1024,
                (8, 6): 100 * 1024, (8, 7): 164 * 1024, (8, 9): 100 * 1024, (9, 0): 228 * 1024,
                (10, 0): 228 * 1024, (12, 0): 100 * 1024}


def arch_from_compute_capability(cc: tuple[int, int]) -> GPUArch:
    """The :class:`GPUArch` of an NVIDIA compute capability; UNKNOWN below Volta or past Blackwell."""
    major, minor = cc
    if major == 7:
        return GPUArch.TURING if minor >= 5 else GPUArch.VOLTA
    if major == 8:
        return GPUArch.ADA if minor >= 9 else GPUArch.AMPERE
    if major == 9:
        return GPUArch.HOPPER
    if major in (10, 11, 12):
        return GPUArch.BLACKWELL
    return GPUArch.UNKNOWN


def detect_gpu(device_id: int = 0) -> GPUCapabilities:
    """Capabilities of CUDA device ``device_id``.

    Raises:
        RuntimeError: CUDA is not available (``torch.cuda.is_available()`` is False).
        ValueError: ``device_id`` is not a visible device.

    On a ROCm build of torch (AMD GPUs) the arch is UNKNOWN and the NVIDIA feature flags are False;
    the sizes are still reported.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("detect_gpu: CUDA is not available (torch.cuda.is_available() is False); flexlite's "
                           "kernels still run on CPU tensors, through Triton's interpreter")
    count = torch.cuda.device_count()
    if isinstance(device_id, bool) or not isinstance(device_id, int) or not 0 <= device_id < count:
        raise ValueError(f"detect_gpu: device_id must be an int in [0, {count}); got {device_id!r}")
    props = torch.cuda.get_device_properties(device_id)
    cc = (int(props.major), int(props.minor))
    nvidia = getattr(torch.version, "hip", None) is None
    arch = arch_from_compute_capability(cc) if nvidia else GPUArch.UNKNOWN
    sram = getattr(props, "shared_memory_per_multiprocessor", 0) or _SRAM_PER_SM.get(cc, 48 * 1024)
    return GPUCapabilities(
        name=str(props.name),
        arch=arch,
        compute_capability=cc,
        has_tma=nvidia and cc >= (9, 0),
        has_fp8=nvidia and cc >= (8, 9),
        has_warpgroup_mma=arch is GPUArch.HOPPER,
        sram_per_sm=int(sram),
        num_sms=int(props.multi_processor_count),
        total_memory_gb=props.total_memory / 1024 ** 3,
    )


def check_hopper_features(device_id: int = 0) -> dict:
    """Feature flags of device ``device_id`` as a dict:

    ``tma_available`` (TMA and a Triton with ``tl.make_tensor_descriptor``), ``fp8_available``,
    ``wgmma_available``, ``arch`` (the :class:`GPUArch` value, e.g. ``"sm_90"``) and
    ``compute_capability``. Without CUDA every flag is False, ``arch`` is ``"unknown"`` and
    ``compute_capability`` is ``(0, 0)``; this function never raises.
    """
    try:
        caps = detect_gpu(device_id)
    except (RuntimeError, ValueError, AssertionError):
        return {"tma_available": False, "fp8_available": False, "wgmma_available": False,
                "arch": GPUArch.UNKNOWN.value, "compute_capability": (0, 0)}
    try:
        import triton.language as tl
        descriptors = hasattr(tl, "make_tensor_descriptor")
    except ImportError:
        descriptors = False
    return {"tma_available": caps.has_tma and descriptors, "fp8_available": caps.has_fp8,
            "wgmma_available": caps.has_warpgroup_mma, "arch": caps.arch.value,
            "compute_capability": caps.compute_capability}


def supports_fp8(device_id: int = 0) -> bool:
    """Whether device ``device_id`` has FP8 tensor cores (SM 8.9+); False without CUDA."""
    return bool(check_hopper_features(device_id)["fp8_available"])
