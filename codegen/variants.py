"""Expands a spec's variant matrix (plus include, minus exclude) into concrete, named variants.

A variant's name is its parameters in a fixed order, so the same parameters always give the same
name and file: ``{backend}_{hm|sm}_{dtype}_q{block_q}_w{block_w}_hc{head_chunk|all}`` and a
``_refbwd`` suffix only when the backward is the reference VJP rather than the fused kernels.
"""

from __future__ import annotations

import dataclasses
import itertools

from codegen.errors import Problem, SpecError
from codegen.spec import DtypePolicy, FamilySpec

_LAYOUT_TAG = {"head_major": "hm", "seq_major": "sm"}
_AXES = ("backend", "q_layout", "dtype", "tiling", "head_chunk", "backward")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel to render: every parameter resolved, plus where in the spec it came from."""

    backend: str
    q_layout: str
    dtype: str
    policy: DtypePolicy
    tiling: str
    block_q: int
    block_w: int
    # Compressed blocks per compute step inside a block_w tile (not in the name: a tiling has one).
    compute_w: int
    head_chunk: int
    backward: str
    origin: str  # spec path of the entry that asked for it, for error messages

    @property
    def name(self) -> str:
        chunk = f"hc{self.head_chunk}" if self.head_chunk else "hcall"
        name = f"{self.backend}_{_LAYOUT_TAG[self.q_layout]}_{self.dtype}_q{self.block_q}_w{self.block_w}_{chunk}"
        return name + ("_refbwd" if self.backward == "reference" else "")

    @property
    def head_major(self) -> bool:
        return self.q_layout == "head_major"

    def choice(self) -> dict:
        """The matrix-axis values, as a spec would write them."""
        return {axis: getattr(self, axis) for axis in _AXES}

    def as_dict(self) -> dict:
        """The resolved parameters a generated module exposes as ``VARIANT``."""
        return {
            "name": self.name,
            "backend": self.backend,
            "q_layout": self.q_layout,
            "q_dtype": self.policy.qk,
            "k_dtype": self.policy.qk,
            "weights_dtype": self.policy.weights,
            "accum_dtype": self.policy.accum,
            "out_dtype": self.policy.out,
            "k_scale": self.policy.k_scale,
            "matmul_precision": self.policy.precision,
            "qk_grad_dtype": self.policy.qk_grad_dtype,
            "block_q": self.block_q,
            "block_w": self.block_w,
            "compute_w": self.compute_w,
            "head_chunk": self.head_chunk,
            "backward": self.backward,
        }


def _resolve(spec: FamilySpec, choice: dict, origin: str, problems: list[Problem]) -> Variant | None:
    policy = spec.dtype_policies.get(choice["dtype"])
    tiling = spec.tilings.get(choice["tiling"])
    if policy is None:
        problems.append(
            Problem(
                f"{origin}.dtype",
                choice["dtype"],
                f"no such dtype policy; defined: {sorted(spec.dtype_policies)}",
            )
        )
    if tiling is None:
        problems.append(
            Problem(f"{origin}.tiling", choice["tiling"], f"no such tiling; defined: {sorted(spec.tilings)}")
        )
    if policy is None or tiling is None:
        return None
    return Variant(
        policy=policy,
        block_q=tiling.block_q,
        block_w=tiling.block_w,
        compute_w=tiling.compute_width,
        origin=origin,
        **choice,
    )


def _matches(selector: dict, variant: Variant) -> bool:
    return all(getattr(variant, axis) == value for axis, value in selector.items())


def expand(spec: FamilySpec, source: str = "<spec>") -> list[Variant]:
    """All variants the spec asks for, sorted by name. Raises ``SpecError`` on dangling names."""
    problems: list[Problem] = []
    matrix = spec.variants.matrix
    variants: dict[str, Variant] = {}
    for values in itertools.product(*(getattr(matrix, axis) for axis in _AXES)):
        variant = _resolve(spec, dict(zip(_AXES, values)), "variants.matrix", problems)
        if variant is not None:
            variants.setdefault(variant.name, variant)

    for index, selector in enumerate(spec.variants.exclude):
        wanted = selector.model_dump(exclude_none=True)
        hits = [name for name, variant in variants.items() if _matches(wanted, variant)]
        if not hits:
            problems.append(Problem(f"variants.exclude[{index}]", wanted, "matches no variant of the matrix"))
        for name in hits:
            del variants[name]

    # Includes come after excludes, so an include can bring back one point an exclude removed.
    for index, choice in enumerate(spec.variants.include):
        origin = f"variants.include[{index}]"
        variant = _resolve(spec, choice.model_dump(), origin, problems)
        if variant is None:
            continue
        if variant.name in variants:
            problems.append(
                Problem(
                    origin,
                    variant.name,
                    "duplicates a variant already emitted (by the matrix or an earlier include)",
                )
            )
        variants[variant.name] = variant

    if problems:
        raise SpecError(source, problems)
    if not variants:
        raise SpecError(source, [Problem("variants", "<none>", "the spec emits no variant")])
    return [variants[name] for name in sorted(variants)]
