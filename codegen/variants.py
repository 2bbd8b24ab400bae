"""Expands a spec's variant matrix (plus include, minus exclude) into concrete, named variants.

A variant's name is its parameters in a fixed order, so the same parameters always give the same
name and file:
``{backend}_{hm|sm}_{dtype}_q{block_q}_w{block_w}[c{compute_w}][f{fused_compute_w}]_hc{head_chunk|all}`` and
a ``_refbwd`` suffix only when the backward is the reference VJP rather than the fused kernels. The
compute width (and any further tiling field that declares a name tag) shows only when it is not the
value names leave out (``Tiling.name_part``), so that every name that existed before it was a tiling
field still names the same kernel. Two variants with one name are
an error naming both, never a silent drop.
"""

from __future__ import annotations

import dataclasses
import itertools

from codegen.errors import Problem, SpecError
from codegen.spec import DtypePolicy, FamilySpec, Tiling

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
    tiles: Tiling  # the tiling's fields, as ``policy`` holds the dtype policy's
    head_chunk: int
    backward: str
    origin: str  # spec path of the entry that asked for it, for error messages

    @property
    def block_q(self) -> int:
        return self.tiles.block_q

    @property
    def block_w(self) -> int:
        return self.tiles.block_w

    @property
    def compute_w(self) -> int:
        """Compressed blocks per compute step inside a block_w tile."""
        return self.tiles.compute_width

    @property
    def fused_compute_w(self) -> int:
        """The fused backward kernel's compressed blocks per compute step."""
        return self.tiles.fused_compute_width

    @property
    def name(self) -> str:
        chunk = f"hc{self.head_chunk}" if self.head_chunk else "hcall"
        name = f"{self.backend}_{_LAYOUT_TAG[self.q_layout]}_{self.dtype}_{self.tiles.name_part()}_{chunk}"
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
            **self.tiles.resolved(),
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
    return Variant(policy=policy, tiles=tiling, origin=origin, **choice)


def _differ(a: Variant, b: Variant) -> str:
    """What two variants of one name were asked for as, e.g. ``tiling prod and tiling prod2``."""
    axes = [axis for axis in _AXES if getattr(a, axis) != getattr(b, axis)] or list(_AXES)
    return " and ".join(", ".join(f"{axis} {getattr(v, axis)}" for axis in axes) for v in (a, b))


def _matches(selector: dict, variant: Variant) -> bool:
    return all(getattr(variant, axis) == value for axis, value in selector.items())


def expand(spec: FamilySpec, source: str = "<spec>") -> list[Variant]:
    """All variants the spec asks for, sorted by name. Raises ``SpecError`` on dangling names."""
    problems: list[Problem] = []
    matrix = spec.variants.matrix
    variants: dict[str, Variant] = {}
    for values in itertools.product(*(getattr(matrix, axis) for axis in _AXES)):
        variant = _resolve(spec, dict(zip(_AXES, values)), "variants.matrix", problems)
        if variant is None:
            continue
        twin = variants.setdefault(variant.name, variant)
        if twin is not variant:
            problems.append(
                Problem(
                    "variants.matrix",
                    variant.name,
                    f"two matrix points give this name: {_differ(twin, variant)}; one kernel, named once: "
                    "give the tilings (or policies) distinct values, or list one",
                )
            )

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

    for field in ("tilings", "chip"):
        for index, name in enumerate(getattr(spec.tuning, field) if spec.tuning else ()):
            if name not in spec.tilings:
                problems.append(
                    Problem(
                        f"tuning.{field}[{index}]", name, f"no such tiling; defined: {sorted(spec.tilings)}"
                    )
                )

    if problems:
        raise SpecError(source, problems)
    if not variants:
        raise SpecError(source, [Problem("variants", "<none>", "the spec emits no variant")])
    return [variants[name] for name in sorted(variants)]
