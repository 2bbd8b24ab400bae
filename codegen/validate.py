"""Backend legality: refuses, before anything is written, every variant a backend cannot run.

Each rule names the spec field a user must change. TPU (Mosaic) rules: a block's last two
dimensions must be multiples of (8, 128) or span the whole array dimension.
"""

from __future__ import annotations

from codegen import budget
from codegen.errors import Problem, SpecError
from codegen.spec import FamilySpec
from codegen.variants import Variant

TPU_SUBLANES = 8
TPU_LANES = 128
RENDERABLE_BACKENDS = ("tpu",)
RENDERABLE_BACKWARDS = ("fused", "reference")


def _head_chunk_path(variant: Variant) -> str:
    return f"{variant.origin}.head_chunk"


def _tpu_problems(spec: FamilySpec, variant: Variant) -> list[Problem]:
    problems = []
    tiling = f"tilings.{variant.tiling}"
    if variant.block_q % TPU_SUBLANES:
        problems.append(
            Problem(
                f"{tiling}.block_q",
                variant.block_q,
                f"must be a multiple of {TPU_SUBLANES} on TPU (sublanes of the q, weights and output blocks)",
            )
        )
    if variant.block_w % TPU_LANES:
        problems.append(
            Problem(
                f"{tiling}.block_w",
                variant.block_w,
                f"must be a multiple of {TPU_LANES} on TPU (lanes of the output block)",
            )
        )
    heads, head_dim, chunk = spec.model.num_heads, spec.model.head_dim, variant.head_chunk
    if chunk and heads % chunk:
        problems.append(
            Problem(
                _head_chunk_path(variant),
                chunk,
                f"must divide model.num_heads = {heads} (or be 0 for all heads)",
            )
        )
    elif chunk and chunk != heads and variant.q_layout == "seq_major" and (chunk * head_dim) % TPU_LANES:
        problems.append(
            Problem(
                _head_chunk_path(variant),
                chunk,
                f"with q_layout seq_major, head_chunk * model.head_dim = {chunk * head_dim} must be a multiple "
                f"of {TPU_LANES} on TPU (the q block's lanes), or head_chunk must equal num_heads",
            )
        )
    return problems


def check(spec: FamilySpec, variants: list[Variant], source: str = "<spec>") -> list[Problem]:
    """Raises ``SpecError`` listing every rule any variant breaks; returns the warnings."""
    problems: list[Problem] = []
    warnings: list[Problem] = []
    for variant in variants:
        if variant.backend not in RENDERABLE_BACKENDS:
            problems.append(
                Problem(
                    f"{variant.origin}.backend",
                    variant.backend,
                    f"no templates for this backend yet; renderable: {list(RENDERABLE_BACKENDS)}",
                )
            )
            continue
        if variant.backward not in RENDERABLE_BACKWARDS:
            problems.append(
                Problem(
                    f"{variant.origin}.backward",
                    variant.backward,
                    f"no templates for this backward yet; renderable: {list(RENDERABLE_BACKWARDS)}",
                )
            )
        if variant.backward == "reference" and variant.policy.k_scale:
            problems.append(
                Problem(
                    f"{variant.origin}.backward",
                    variant.backward,
                    f"the reference backward does not take a key scale (dtype policy {variant.dtype!r}); use fused",
                )
            )
        illegal = _tpu_problems(spec, variant)
        problems += illegal
        if not illegal:  # the budget needs legal blocks to measure
            errors, cautions = budget.problems(spec, variant)
            problems += errors
            warnings += cautions
    if problems:
        raise SpecError(source, problems)
    return list({str(w): w for w in warnings}.values())
