"""Hardware facts the cost model and validation need, per target chip.

TPU numbers come from JAX's own table (``pltpu.get_tpu_info_for_chip``, which needs no TPU), so they
move with the pinned JAX release. Only what JAX does not expose is written here by hand, each fact
with its public source.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.experimental.pallas import tpu as pltpu

KIB, MIB = 1024, 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Chip:
    """Capacities per core, peak rates per whole chip (dense, no sparsity)."""

    name: str
    backend: str  # "tpu" | "gpu"
    vmem_bytes: int  # TPU: VMEM per TensorCore; GPU: shared memory per SM
    scoped_vmem_default_bytes: int  # TPU: what a kernel may use without vmem_limit_bytes; GPU: = vmem_bytes
    smem_bytes: int  # TPU: scalar memory per TensorCore; GPU: 0
    cores: int  # TPU: TensorCores per chip; GPU: SMs
    cores_per_device: int  # cores one JAX device, so one pallas_call, runs on
    bf16_flops: float  # per second, whole chip
    fp8_flops: float  # per second, whole chip; 0 where the chip has no fp8 matmul
    f32_flops: float  # per second, whole chip, at full float32 precision (Precision.HIGHEST)
    hbm_bytes_per_second: float  # whole chip
    # Itemsize in bytes -> row granule of an array's second-to-last dimension. Empty on GPU.
    sublane_tiling: dict[int, int] = dataclasses.field(hash=False)

    @property
    def device_fraction(self) -> float:
        """Share of the chip's peaks one pallas_call can use: 1/2 on 7x, whose two TensorCores are separate
        JAX devices; 1 where the device is the whole chip (v5e, v6e, v5p megacore, GPUs)."""
        return self.cores_per_device / self.cores

    def matmul_flops_per_second(self, itemsize: int) -> float:
        """Peak matmul rate of one device on inputs of ``itemsize`` bytes (no fp8 unit: the bf16 rate)."""
        rates = {4: self.f32_flops, 2: self.bf16_flops, 1: self.fp8_flops or self.bf16_flops}
        return rates[itemsize] * self.device_fraction

    def hbm_bytes_per_second_per_device(self) -> float:
        return self.hbm_bytes_per_second * self.device_fraction


# Not in JAX's table: the default scoped VMEM limit (the --xla_tpu_scoped_vmem_limit_kib default that
# jax's CompilerParams.vmem_limit_bytes docstring refers to), as Mosaic's "Scoped allocation ... exceeds
# the limit" compile errors report it: 16 MiB on v5e and v5p, 32 MiB on v6e and 7x.
_SCOPED_VMEM_DEFAULT = {"v5e": 16 * MIB, "v5p": 16 * MIB, "v6e": 32 * MIB, "7x": 32 * MIB}
# jax.lax.Precision docstring: "HIGHEST ... On TPU: performs float32 computations in 6 bfloat16 [passes]".
_TPU_F32_PASSES = 6
# Cores one JAX device spans: v5p runs as a megacore (its two TensorCores are one device); 7x does not
# support megacore, so each of its two TensorCores is a device (pltpu.ChipVersion's table).
_TPU_TARGETS = {
    "v5e": (pltpu.ChipVersion.TPU_V5E, 1),
    "v5p": (pltpu.ChipVersion.TPU_V5P, 2),
    "v6e": (pltpu.ChipVersion.TPU_V6E, 1),
    "7x": (pltpu.ChipVersion.TPU_7X, 1),
}


def _tpu(name: str) -> Chip:
    version, cores_per_device = _TPU_TARGETS[name]
    info = pltpu.get_tpu_info_for_chip(version, cores_per_device)
    cores = version.num_physical_tensor_cores_per_chip
    # JAX's rates are per TensorCore (its docstring): scale to the whole chip.
    bf16 = float(info.bf16_ops_per_second * cores)
    return Chip(
        name=name,
        backend="tpu",
        vmem_bytes=info.vmem_capacity_bytes,
        scoped_vmem_default_bytes=_SCOPED_VMEM_DEFAULT[name],
        smem_bytes=info.smem_capacity_bytes,
        cores=cores,
        cores_per_device=cores_per_device,
        bf16_flops=bf16,
        fp8_flops=float(info.fp8_ops_per_second * cores),
        f32_flops=bf16 / _TPU_F32_PASSES,
        hbm_bytes_per_second=float(info.mem_bw_bytes_per_second * cores),
        # TpuInfo.get_sublane_tiling: XLA's default HBM tiling, 8 rows for 32- and 16-bit types before
        # 7x (16 for bf16 on 7x). Mosaic's VMEM tiles of packed types can be taller; cost.py pads to
        # the larger (packed-vreg) granule.
        sublane_tiling={n: info.get_sublane_tiling(np.dtype(f"int{8 * n}")) for n in (4, 2, 1)},
    )


# NVIDIA Hopper, SXM parts, dense (non-sparse) Tensor Core peaks:
# - H100 datasheet (nvidia.com/en-us/data-center/h100): BF16 1,979 and FP8 3,958 TFLOPS *with sparsity*,
#   so 989e12 and 1979e12 dense; FP32 67 TFLOPS; HBM3 3.35 TB/s.
# - H200 product page (nvidia.com/en-us/data-center/h200): same compute as H100 SXM; HBM3e 4.8 TB/s.
# - Hopper tuning guide (docs.nvidia.com/cuda/hopper-tuning-guide): 228 KB shared memory per SM (at most
#   227 KB to one thread block); the H100 architecture whitepaper: 132 SMs on the SXM5 part.
def _hopper(name: str, hbm_bytes_per_second: float) -> Chip:
    return Chip(
        name=name,
        backend="gpu",
        vmem_bytes=228 * KIB,
        scoped_vmem_default_bytes=228 * KIB,
        smem_bytes=0,
        cores=132,
        cores_per_device=132,
        bf16_flops=989e12,
        fp8_flops=1979e12,
        f32_flops=67e12,
        hbm_bytes_per_second=hbm_bytes_per_second,
        sublane_tiling={},
    )


CHIPS: dict[str, Chip] = {
    **{name: _tpu(name) for name in _TPU_TARGETS},
    "h100": _hopper("h100", 3.35e12),
    "h200": _hopper("h200", 4.8e12),
}


def get(name: str) -> Chip:
    """The chip called ``name``; ValueError naming the valid ones otherwise."""
    try:
        return CHIPS[name]
    except KeyError:
        raise ValueError(f"unknown chip {name!r}; valid: {sorted(CHIPS)}") from None
