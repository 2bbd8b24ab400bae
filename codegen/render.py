"""Variants -> formatted Python source: Jinja2 templates, then black. Pure: writes nothing.

Output is a function of the spec bytes and the templates alone (no dates, no absolute paths), so
rendering twice gives byte-identical files.
"""

from __future__ import annotations

import math
import pathlib

import black
import jinja2

from codegen import budget, cost
from codegen.spec import FP8, FamilySpec
from codegen.variants import Variant

TEMPLATES = pathlib.Path(__file__).resolve().parent.parent / "templates"
# Black's style is pinned by its major version in pyproject.toml; the line length is ours.
BLACK_MODE = black.Mode(line_length=110, target_versions={black.TargetVersion.PY310})
_BYTES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}
_SUBLANES_BY_BYTES = {4: 8, 2: 16, 1: 32}  # native TPU tiling: narrower dtypes pack more rows per vreg
_BACKWARD = {
    "fused": (
        "tpu/backward.py.j2",
        "two fused Pallas kernels (dq with dweights, and dk) that recompute logits in VMEM",
    ),
    "reference": ("backward/reference.py.j2", "the reference VJP in float32, scanned over head chunks"),
}


def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def sublanes(variant: Variant) -> int:
    """Row granule of the q-row blocks (q, weights, output): the narrowest dtype's native tiling."""
    policy = variant.policy
    return _SUBLANES_BY_BYTES[min(_BYTES[policy.qk], _BYTES[policy.weights], _BYTES[policy.out])]


def _float_literal(value: float) -> str:
    """A Python expression for ``value`` (``float("-inf")`` for infinities)."""
    return repr(value) if math.isfinite(value) else f'float("{value}")'


def format_source(source: str) -> str:
    return black.format_str(source, mode=BLACK_MODE)


def render_variant(
    env: jinja2.Environment, spec: FamilySpec, variant: Variant, spec_path: str, spec_sha256: str
) -> str:
    backward_template, backward_summary = _BACKWARD[variant.backward]
    source = env.get_template("module.py.j2").render(
        v=variant,
        variant_dict=repr(variant.as_dict()),
        spec_path=spec_path,
        spec_sha256=spec_sha256,
        sublanes=sublanes(variant),
        precision=variant.policy.precision.upper(),
        default_scale=spec.computation.softmax_scale,
        masked_value=_float_literal(spec.computation.masked_value),
        fp8=variant.policy.qk == FP8,
        vmem_limits=repr(budget.vmem_limits(spec, variant)),
        targets=", ".join(spec.targets),
        flop_model=repr(cost.flop_model(variant.as_dict())),
        k_scale=variant.policy.k_scale,
        backward_template=backward_template,
        backward_summary=backward_summary,
    )
    return format_source(source)


def render_family(
    spec: FamilySpec, variants: list[Variant], spec_path: str, spec_sha256: str
) -> dict[str, str]:
    """Every file of the family, keyed by its path relative to the output root (``generated/``)."""
    env = environment()
    files = {
        "__init__.py": format_source(env.get_template("generated_root.py.j2").render()),
        f"{spec.family}/__init__.py": format_source(
            env.get_template("package_init.py.j2").render(
                family=spec.family,
                description=spec.description.strip() or "CSA StreamIndex score kernels.",
                variants=variants,
                spec_path=spec_path,
                spec_sha256=spec_sha256,
            )
        ),
    }
    files[f"{spec.family}/helpers.py"] = format_source(
        env.get_template("helpers.py.j2").render(
            family=spec.family,
            compress_rate=spec.computation.compress_rate,
            spec_path=spec_path,
            spec_sha256=spec_sha256,
        )
    )
    for variant in variants:
        files[f"{spec.family}/{variant.name}.py"] = render_variant(env, spec, variant, spec_path, spec_sha256)
    return files
