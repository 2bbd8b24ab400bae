"""``codegen explain``: what each kernel of a variant costs on a chip, before anyone books one.

Per kernel: grid, block shapes, VMEM footprint against the limit it compiles with, HBM bytes moved
(re-fetches counted as the Pallas pipeline does them) against the minimum, MXU FLOPs and elementwise
(VPU) operations, arithmetic intensity and the roofline time (``cost.KernelCost``'s one model). With
``causal``, every (q block, compute block) is classified by the kernels' own rule on the causal
ranges (``codegen/shipped/_geometry.py``): empty blocks do no MXU or VPU work, full and partial ones do the
work and the mask; tiles with no work fetch nothing for the operands the plan holds still on a skipped step.
"""

from __future__ import annotations

import dataclasses

from codegen import chips, cost
from codegen.plan import VariantPlan
from codegen.shipped import _geometry as geometry


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
    mxu_vs_unmasked: float  # executed MXU FLOPs over those of the same call unmasked
    compute_blocks: dict[str, int]  # (q block, compute block) pairs: empty, full, partial; DMA tiles; the
    # forward's covered (q block, compressed block) pairs (visible_columns) of all (columns)
    intensity: float
    roofline_us: float
    bound: str


def explain(
    plan: VariantPlan, shape: tuple[int, ...], chip: chips.Chip, compress_rate: int, causal: bool = False
) -> list[Row]:
    bounds = cost.causal_bounds(cost.Shape(*shape), compress_rate) if causal else None
    rows = []
    for kernel in cost.call_kernels(plan, shape):
        k = cost.kernel_cost(plan, kernel, shape, bounds)
        shown, block_w = k.kinds, cost.tiling(plan, shape, kernel).block_w
        unmasked = cost.kernel_cost(plan, kernel, shape)
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
                mxu_vs_unmasked=k.mxu_flops / unmasked.mxu_flops,
                compute_blocks=dict(dataclasses.asdict(shown), columns=shown.tiles * block_w),
                intensity=k.intensity(),
                roofline_us=k.roofline_seconds(chip) * 1e6,
                bound=k.bound(chip),
            )
        )
    return rows


def table(rows: list[Row], chip: chips.Chip, shape, causal: bool, blocks: bool = True) -> str:
    """A plain-text table, one line per kernel, then (with ``blocks``) each kernel's block shapes."""
    head = (
        f"modelled (codegen/cost.py), not compiled; chip {chip.name}; B,H,S,D,W = {','.join(map(str, shape))}"
        + ("; causal (only the compute blocks with work counted)" if causal else "")
    )
    columns = ["variant", "kernel", "grid", "VMEM MiB / limit", "HBM MiB", "x min", "MXU GFLOP", "VPU Gop"]
    columns += ["MXU x unmasked"] * causal + ["op/B", "roofline us"]
    lines = [
        [
            r.variant,
            r.kernel,
            "x".join(map(str, r.grid)),
            f"{r.vmem_bytes / geometry.MIB:.1f} / {r.vmem_limit_bytes / geometry.MIB:.0f}",
            f"{r.hbm_bytes / geometry.MIB:,.1f}",
            f"{r.hbm_bytes / r.min_hbm_bytes:.2f}",
            f"{r.mxu_flops / 1e9:,.1f}",
            f"{r.vpu_ops / 1e9:,.1f}",
            *[f"{r.mxu_vs_unmasked:.3f}"] * causal,
            f"{r.intensity:,.0f}",
            f"{r.roofline_us:,.1f} ({r.bound})",
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(columns)]
    out = [head, "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    out += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    if causal:
        out.append(
            "(q block, compute block) pairs of the backward kernels; (q block, compressed block) pairs the forward's pieces cover:"
        )
        seen = set()
        for r in rows:
            if r.variant not in seen:
                seen.add(r.variant)
                n = r.compute_blocks
                out.append(
                    f"  {r.variant}: {n['empty']} empty (no work), {n['full']} full, "
                    f"{n['partial']} partial (all with work masked); the forward {n['visible_columns']:,} of "
                    f"{n['columns']:,}; DMA tiles with work {n['tiles_with_work']} of {n['tiles']}"
                )
    if blocks:
        out.append("blocks:")
        out += [
            f"  {r.variant} {r.kernel}: " + ", ".join(f"{n} {list(s)}" for n, s in r.blocks.items())
            for r in rows
        ]
    return "\n".join(out)
