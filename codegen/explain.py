"""``codegen explain``: what each kernel of a variant costs on a chip, before anyone books one.

Per kernel: grid, block shapes, VMEM footprint against the limit it compiles with, HBM bytes moved
(re-fetches counted as the Pallas pipeline does them) against the minimum, MXU FLOPs and elementwise
(VPU) operations, arithmetic intensity and the roofline time (``cost.KernelCost``'s one model). With
``causal``, tiles the kernels skip are discounted: their work, and the fetches of the operands the
plan holds still on a skipped step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from codegen import chips, cost, tiles
from codegen.plan import VariantPlan


def active_fraction(plan: VariantPlan, shape: tuple[int, ...], compress_rate: int) -> float:
    """Fraction of (q block, w block) tiles with work for causal CSA from position 0."""
    t = cost.tiling(plan, shape)
    _, _, seq_len, _, num_blocks = shape
    ends = np.minimum((np.arange(t.seq_pad) + 1) // compress_rate, num_blocks)
    ends[seq_len:] = 0
    last = ends.reshape(-1, t.block_q).max(axis=1)  # max kv_end per q block; kv_start is 0
    active = -(-last // t.block_w)  # w blocks [0, ceil(last / block_w)) have work
    return float(active.sum()) / (len(last) * (t.blocks_pad // t.block_w))


@dataclasses.dataclass(frozen=True)
class Row:
    variant: str
    kernel: str
    grid: tuple[int, ...]
    blocks: dict[str, tuple[int, ...]]
    vmem_bytes: int
    vmem_limit_bytes: int
    hbm_bytes: int
    min_hbm_bytes: int
    mxu_flops: int
    vpu_ops: int
    intensity: float
    roofline_us: float
    bound: str


def explain(
    plan: VariantPlan, shape: tuple[int, ...], chip: chips.Chip, compress_rate: int, causal: bool = False
) -> list[Row]:
    fraction = active_fraction(plan, shape, compress_rate) if causal else 1.0
    rows = []
    for kernel in plan.kernels:
        k = cost.kernel_cost(plan, kernel, shape).scaled(fraction, kernel.skipped_operands())
        rows.append(
            Row(
                variant=plan.name,
                kernel=k.kernel,
                grid=k.grid,
                blocks=k.blocks,
                vmem_bytes=k.vmem_bytes,
                vmem_limit_bytes=kernel.vmem_limit_bytes or chip.scoped_vmem_default_bytes,
                hbm_bytes=k.hbm_bytes,
                min_hbm_bytes=k.min_hbm_bytes,
                mxu_flops=k.mxu_flops,
                vpu_ops=k.vpu_ops,
                intensity=k.intensity(),
                roofline_us=k.roofline_seconds(chip) * 1e6,
                bound=k.bound(chip),
            )
        )
    return rows


def table(rows: list[Row], chip: chips.Chip, shape, causal: bool, blocks: bool = True) -> str:
    """A plain-text table, one line per kernel, then (with ``blocks``) each kernel's block shapes."""
    head = f"chip {chip.name}; B,H,S,D,W = {','.join(map(str, shape))}" + (
        "; causal (skipped tiles discounted)" if causal else ""
    )
    columns = ["variant", "kernel", "grid", "VMEM MiB / limit", "HBM MiB", "x min", "MXU GFLOP", "VPU Gop"]
    columns += ["op/B", "roofline us"]
    lines = [
        [
            r.variant,
            r.kernel,
            "x".join(map(str, r.grid)),
            f"{r.vmem_bytes / tiles.MIB:.1f} / {r.vmem_limit_bytes / tiles.MIB:.0f}",
            f"{r.hbm_bytes / tiles.MIB:,.1f}",
            f"{r.hbm_bytes / r.min_hbm_bytes:.2f}",
            f"{r.mxu_flops / 1e9:,.1f}",
            f"{r.vpu_ops / 1e9:,.1f}",
            f"{r.intensity:,.0f}",
            f"{r.roofline_us:,.1f} ({r.bound})",
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(columns)]
    out = [head, "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    out += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    if blocks:
        out.append("blocks:")
        out += [
            f"  {r.variant} {r.kernel}: " + ", ".join(f"{n} {list(s)}" for n, s in r.blocks.items())
            for r in rows
        ]
    return "\n".join(out)
