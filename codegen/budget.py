"""VMEM budget: does each kernel of a variant fit every target chip, and what limit must it ask for?

Footprints come from ``codegen.cost`` over the kernel plan (double-buffered blocks, scratch,
in-flight float32 tiles, padded to (sublane, 128) tiles). A kernel under every target's default
scoped limit asks for nothing; one above it gets ``vmem_limit_bytes`` (its footprint plus a quarter
for Mosaic's own scratch, in whole MiB) when every target physically has that much; otherwise the
variant is rejected with the numbers.
"""

from __future__ import annotations

from codegen import chips, cost, plan
from codegen.errors import Problem
from codegen.spec import FamilySpec
from codegen.shipped import _geometry as geometry

# Chips whose vreg tiles hold 16-bit rows in 16s and 8-bit rows in 32s (earlier chips tile 16-bit
# rows in 8s too): there a block of another row count is legal but costs a relayout.
PACKED_ROW_CHIPS = ("v6e", "7x")


def targets(spec: FamilySpec, backend: str) -> list[chips.Chip]:
    """The spec's target chips of ``backend`` (validation makes sure there is one)."""
    return [chips.get(name) for name in spec.targets if chips.get(name).backend == backend]


def apply(spec: FamilySpec, p: plan.VariantPlan) -> tuple[plan.VariantPlan, list[Problem], list[Problem]]:
    """(the plan with each kernel's ``vmem_limit_bytes`` set, errors, warnings) on the spec's targets."""
    variant = p.variant
    chosen = targets(spec, variant.backend)
    footprints = cost.vmem_footprints(p, spec.model.num_heads, spec.model.head_dim)
    default = min(chip.scoped_vmem_default_bytes for chip in chosen)
    limits = {kernel: geometry.vmem_limit(need, default) for kernel, need in footprints.items()}
    errors, warnings = [], []
    for kernel, limit in list(limits.items()):
        need = limit or footprints[kernel]
        short = [chip for chip in chosen if chip.vmem_bytes < need]
        if short and kernel in plan.OPTIONAL:  # the variant runs without it
            p = plan.without(p, kernel)
            del limits[kernel]
        elif short:
            have = ", ".join(f"{chip.name} {chip.vmem_bytes / geometry.MIB:.0f} MiB" for chip in short)
            errors.append(
                Problem(
                    f"tilings.{variant.tiling}",
                    f"block_q={variant.block_q}, block_w={variant.block_w}",
                    f"variant {variant.name}: its {kernel} kernel needs {footprints[kernel] / geometry.MIB:.1f} MiB "
                    f"of VMEM ({need / geometry.MIB:.0f} MiB with headroom) at {spec.model.num_heads} heads x "
                    f"{spec.model.head_dim}, more than {have}; use smaller blocks or a head_chunk",
                )
            )
    late = [chip.name for chip in chosen if chip.name in PACKED_ROW_CHIPS]
    for dtype in dict.fromkeys(
        (variant.policy.qk, variant.policy.weights, variant.policy.out)
    ):  # stable order
        rows = geometry.sublanes(dtype)
        if rows > geometry.MIN_SUBLANES and late and variant.block_q % rows:
            warnings.append(
                Problem(
                    f"tilings.{variant.tiling}.block_q",
                    variant.block_q,
                    f"legal, but not a multiple of {rows}, {dtype}'s native row tiling on {', '.join(late)}: "
                    f"each {dtype} block costs a relayout",
                )
            )
    return plan.with_vmem_limits(p, limits), errors, warnings
