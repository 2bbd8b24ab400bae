"""``codegen explain``: what each kernel of a variant costs on a chip, before anyone books one.

Per kernel: grid, block shapes, VMEM footprint against the limit it compiles with, HBM bytes moved
(re-fetches counted as the Pallas pipeline does them) against the minimum, FLOPs, arithmetic
intensity and the roofline time. With ``causal``, tiles the kernels skip are discounted: FLOPs and
the fetches of the operands whose index maps clamp on skipped tiles scale by the active fraction.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from codegen import budget, chips, cost
from codegen.spec import FamilySpec
from codegen.variants import Variant

MIB = 2**20
# Operands whose index maps hold still on a skipped tile, per kernel (see the templates' fetch functions).
_SKIPPED_FETCHES = {
    "forward": {"q", "k", "weights", "k_scale"},
    "dq_dweights": {"k", "g", "k_scale"},
    "dk": {"q", "weights", "kv_bounds", "g"},
}


def active_fraction(variant: dict, shape: tuple[int, ...], compress_rate: int) -> float:
    """Fraction of (q block, w block) tiles with work for causal CSA from position 0."""
    t = cost.tiling(variant, shape)
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
    flops: int
    intensity: float
    roofline_us: float
    bound: str


def explain(
    spec: FamilySpec, variant: Variant, shape: tuple[int, ...], chip: chips.Chip, causal: bool = False
) -> list[Row]:
    params = variant.as_dict()
    limits = budget.vmem_limits(spec, variant)
    fraction = active_fraction(params, shape, spec.computation.compress_rate) if causal else 1.0
    rows = []
    for k in cost.variant_costs(params, shape):
        scale = {name: fraction if name in _SKIPPED_FETCHES[k.kernel] else 1.0 for name in k.fetches}
        hbm = int(sum(moved * scale[name] for name, moved in k.hbm_bytes_by_operand.items()))
        flops = int(k.flops * fraction)
        mxu_rate = chip.matmul_flops_per_second(k.mxu_itemsize)
        compute = flops / mxu_rate
        memory = hbm / chip.hbm_bytes_per_second_per_device()
        rows.append(
            Row(
                variant=variant.name,
                kernel=k.kernel,
                grid=k.grid,
                blocks=k.blocks,
                vmem_bytes=k.vmem_bytes,
                vmem_limit_bytes=limits.get(k.kernel) or chip.scoped_vmem_default_bytes,
                hbm_bytes=hbm,
                min_hbm_bytes=k.min_hbm_bytes,
                flops=flops,
                intensity=flops / hbm,
                roofline_us=max(compute, memory) * 1e6,
                bound="compute" if compute >= memory else "memory",
            )
        )
    return rows


def table(rows: list[Row], chip: chips.Chip, shape, causal: bool) -> str:
    """A plain-text table, one line per kernel."""
    head = f"chip {chip.name}; B,H,S,D,W = {','.join(map(str, shape))}" + (
        "; causal (skipped tiles discounted)" if causal else ""
    )
    columns = [
        "variant",
        "kernel",
        "grid",
        "VMEM MiB / limit",
        "HBM MiB",
        "x min",
        "GFLOP",
        "FLOP/B",
        "roofline us",
    ]
    lines = []
    for r in rows:
        lines.append(
            [
                r.variant,
                r.kernel,
                "x".join(map(str, r.grid)),
                f"{r.vmem_bytes / MIB:.1f} / {r.vmem_limit_bytes / MIB:.0f}",
                f"{r.hbm_bytes / MIB:,.1f}",
                f"{r.hbm_bytes / r.min_hbm_bytes:.2f}",
                f"{r.flops / 1e9:,.1f}",
                f"{r.intensity:,.0f}",
                f"{r.roofline_us:,.1f} ({r.bound})",
            ]
        )
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(columns)]
    out = [head, "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    out += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    blocks = {(r.variant, r.kernel): r.blocks for r in rows}
    out.append("blocks:")
    out += [
        f"  {v} {k}: " + ", ".join(f"{n} {list(s)}" for n, s in b.items()) for (v, k), b in blocks.items()
    ]
    return "\n".join(out)
