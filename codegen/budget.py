"""VMEM budget: does each kernel of a variant fit every target chip, and what limit must it ask for?

Footprints come from ``codegen.cost`` (double-buffered blocks, scratch, in-flight float32 tiles,
padded to (sublane, 128) tiles). A kernel under every target's default scoped limit asks for
nothing; one above it gets ``vmem_limit_bytes`` (its footprint plus a quarter for Mosaic's own
scratch, in whole MiB) when every target physically has that much; otherwise the variant is
rejected with the numbers.
"""

from __future__ import annotations

from codegen import chips, cost
from codegen.errors import Problem
from codegen.spec import FamilySpec
from codegen.variants import Variant

MIB = 2**20
HEADROOM = 1.25
# Rows a vreg tile holds natively, by dtype width, on v6e and later (earlier chips tile 16-bit rows
# in 8s too); a block of another row count is legal but costs a relayout.
NATIVE_ROWS_V6 = {2: 16, 1: 32}


def _targets(spec: FamilySpec, variant: Variant) -> list[chips.Chip]:
    return [chips.get(name) for name in spec.targets if chips.get(name).backend == variant.backend]


def _footprints(spec: FamilySpec, variant: Variant) -> dict[str, int]:
    return cost.vmem_footprints(variant.as_dict(), spec.model.num_heads, spec.model.head_dim)


def vmem_limits(
    spec: FamilySpec, variant: Variant, footprints: dict[str, int] | None = None
) -> dict[str, int | None]:
    """Per kernel: the ``vmem_limit_bytes`` to compile with, None where the default scope suffices."""
    targets = _targets(spec, variant)
    default = min((chip.scoped_vmem_default_bytes for chip in targets), default=0)
    footprints = footprints or _footprints(spec, variant)
    return {
        kernel: None if need <= default else -(-int(need * HEADROOM) // MIB) * MIB
        for kernel, need in footprints.items()
    }


def problems(spec: FamilySpec, variant: Variant) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings) of the variant's VMEM budget and row tiling on the spec's targets."""
    errors, warnings = [], []
    targets = _targets(spec, variant)
    footprints = _footprints(spec, variant)
    for kernel, limit in vmem_limits(spec, variant, footprints).items():
        need = limit or footprints[kernel]
        short = [chip for chip in targets if chip.vmem_bytes < need]
        if short:
            have = ", ".join(f"{chip.name} {chip.vmem_bytes / MIB:.0f} MiB" for chip in short)
            errors.append(
                Problem(
                    f"tilings.{variant.tiling}",
                    f"block_q={variant.block_q}, block_w={variant.block_w}",
                    f"variant {variant.name}: its {kernel} kernel needs {footprints[kernel] / MIB:.1f} MiB of VMEM "
                    f"({need / MIB:.0f} MiB with headroom) at {spec.model.num_heads} heads x {spec.model.head_dim}, "
                    f"more than {have}; use smaller blocks or a head_chunk",
                )
            )
    for dtype in dict.fromkeys(
        (variant.policy.qk, variant.policy.weights, variant.policy.out)
    ):  # stable order
        rows = NATIVE_ROWS_V6.get(cost.itemsize(dtype))
        late = [chip.name for chip in targets if chip.name in ("v6e", "7x")]
        if rows and late and variant.block_q % rows:
            warnings.append(
                Problem(
                    f"tilings.{variant.tiling}.block_q",
                    variant.block_q,
                    f"legal, but not a multiple of {rows}, {dtype}'s native row tiling on {', '.join(late)}: "
                    f"each {dtype} block costs a relayout",
                )
            )
    return errors, warnings
