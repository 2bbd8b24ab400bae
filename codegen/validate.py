"""Backend legality: refuses, before anything is written, every variant a backend cannot run.

Each rule names the spec field a user must change. TPU (Mosaic) rules: a block's last two
dimensions must be multiples of (8, 128) or span the whole array dimension. The VMEM budget
(``budget``) runs after these, on the plans of legal variants.
"""

from __future__ import annotations

from codegen import chips
from codegen.errors import Problem
from codegen.spec import FamilySpec
from codegen.variants import Variant
from codegen.shipped import _geometry as geometry

RENDERABLE_BACKENDS = ("tpu",)
RENDERABLE_BACKWARDS = ("fused", "reference")


def _head_chunk_path(variant: Variant) -> str:
    return f"{variant.origin}.head_chunk"


def _tpu_problems(spec: FamilySpec, variant: Variant) -> list[Problem]:
    problems = []
    tiling = f"tilings.{variant.tiling}"
    if variant.block_q % geometry.MIN_SUBLANES:
        problems.append(
            Problem(
                f"{tiling}.block_q",
                variant.block_q,
                f"must be a multiple of {geometry.MIN_SUBLANES} on TPU (sublanes of the q, weights and output blocks)",
            )
        )
    if variant.block_w % geometry.LANES:
        problems.append(
            Problem(
                f"{tiling}.block_w",
                variant.block_w,
                f"must be a multiple of {geometry.LANES} on TPU (lanes of the output block)",
            )
        )
    # fused_compute_w left out is compute_w's: a problem of that field alone
    widths = ("compute_w", "fused_compute_w") if variant.tiles.fused_compute_w else ("compute_w",)
    for field in widths:
        if getattr(variant, field) % geometry.LANES:
            problems.append(
                Problem(
                    f"{tiling}.{field}",
                    getattr(variant, field),
                    f"must be a multiple of {geometry.LANES} on TPU (lanes of a compute block's slice of the tile)",
                )
            )
    heads, chunk, q_dtype = spec.model.num_heads, variant.head_chunk, variant.policy.qk
    rows = geometry.sublanes(q_dtype)  # of a q block's [heads, D], as HBM tiles it
    if chunk and heads % chunk:
        problems.append(
            Problem(
                _head_chunk_path(variant),
                chunk,
                f"must divide model.num_heads = {heads} (or be 0 for all heads)",
            )
        )
    elif chunk and chunk != heads and variant.q_layout == "seq_major" and chunk % rows:
        problems.append(
            Problem(
                _head_chunk_path(variant),
                chunk,
                f"with q_layout seq_major and {q_dtype} q, head_chunk must be a multiple of "
                f"{rows} on TPU (a chunk's q block is [block_q, head_chunk, D] of "
                f"[B, S, H, D], whose [H, D] HBM tiles {rows} rows of {q_dtype}), "
                "or 0 for all heads",
            )
        )
    return problems


def problems(spec: FamilySpec, variant: Variant) -> list[Problem]:
    """Every rule the variant breaks before its plan can be budgeted (empty: legal)."""
    if variant.backend not in RENDERABLE_BACKENDS:
        return [
            Problem(
                f"{variant.origin}.backend",
                variant.backend,
                f"no templates for this backend yet; renderable: {list(RENDERABLE_BACKENDS)}",
            )
        ]
    found = []
    if not any(chips.get(name).backend == variant.backend for name in spec.targets):
        found.append(
            Problem(
                "targets",
                list(spec.targets),
                f"holds no {variant.backend} chip, so variant {variant.name} has no chip to be budgeted and "
                f"costed for; add one of {sorted(n for n, c in chips.CHIPS.items() if c.backend == variant.backend)}",
            )
        )
    if variant.backward not in RENDERABLE_BACKWARDS:
        found.append(
            Problem(
                f"{variant.origin}.backward",
                variant.backward,
                f"no templates for this backward yet; renderable: {list(RENDERABLE_BACKWARDS)}",
            )
        )
    if variant.backward == "reference" and variant.policy.k_scale:
        found.append(
            Problem(
                f"{variant.origin}.backward",
                variant.backward,
                f"the reference backward does not take a key scale (dtype policy {variant.dtype!r}); use fused",
            )
        )
    return found + _tpu_problems(spec, variant)
