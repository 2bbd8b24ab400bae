"""A family's plans -> formatted Python source: Jinja2 templates, then black. Pure: writes nothing.

Output is a function of the spec bytes and the templates alone (no dates, no absolute paths), so
rendering twice gives byte-identical files. The templates ship inside the package
(``codegen.templates``, mapped from the repository's ``templates/``), so an installed codegen renders
from any directory.
"""

from __future__ import annotations

import inspect
import math

import black
import jinja2

from codegen import budget, masks
from codegen import plan as plan_module
from codegen.pipeline import Family
from codegen.plan import VariantPlan

# Black's style is pinned by its major version in pyproject.toml; the line length is ours.
BLACK_MODE = black.Mode(line_length=110, target_versions={black.TargetVersion.PY310})
RUNTIME = "_runtime"  # the family module every variant imports what they share from
_BACKWARD = {
    "fused": (
        "tpu/backward.py.j2",
        "two fused Pallas kernels (dq with dweights, and dk) that recompute logits in VMEM",
    ),
    "reference": ("backward/reference.py.j2", "the reference VJP in float32, scanned over head chunks"),
}


def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("codegen.templates", "."),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _float_literal(value: float) -> str:
    """A Python expression for ``value`` (``float("-inf")`` for infinities)."""
    return repr(value) if math.isfinite(value) else f'float("{value}")'


def format_source(source: str) -> str:
    return black.format_str(source, mode=BLACK_MODE)


def _stamp(family: Family) -> dict:
    return dict(spec_path=family.spec_path, spec_sha256=family.sha256, family=family.spec.family)


def render_variant(env: jinja2.Environment, family: Family, plan: VariantPlan) -> str:
    variant = plan.variant
    backward_template, backward_summary = _BACKWARD[variant.backward]
    source = env.get_template("module.py.j2").render(
        **_stamp(family),
        v=variant,
        p=plan,
        variant_dict=repr(variant.as_dict()),
        precision=variant.policy.precision.upper(),
        default_scale=family.spec.computation.softmax_scale,
        masked_text=repr(family.spec.computation.masked_value),
        fp8=variant.policy.qk == "float8_e4m3fn",
        k_scale=variant.policy.k_scale,
        vmem_limits=repr({k.name: k.vmem_limit_bytes for k in plan.kernels}),
        targets=", ".join(family.spec.targets),
        backward_template=backward_template,
        backward_summary=backward_summary,
        sparse=dict(zip(("forward", "backward"), plan_module.sparse(variant))),
    )
    return format_source(source)


def _sparse_vmem(family: Family) -> dict:
    """The VMEM facts the sparse kernels' resident route is sized by: the smallest capacity, and the
    smallest default scoped limit, of the spec's TPU targets."""
    chosen = budget.targets(family.spec, "tpu")
    return dict(
        sparse_vmem_capacity=f"{min(c.vmem_bytes for c in chosen)}  # {', '.join(c.name for c in chosen)}",
        sparse_scoped_default=min(c.scoped_vmem_default_bytes for c in chosen),
    )


def render_family(family: Family) -> dict[str, str]:
    """Every file of the family, keyed by its path relative to the output root (``generated/``)."""
    env = environment()
    spec = family.spec
    files = {
        "__init__.py": format_source(env.get_template("generated_root.py.j2").render()),
        f"{spec.family}/__init__.py": format_source(
            env.get_template("package_init.py.j2").render(
                **_stamp(family),
                description=spec.description.strip() or "CSA StreamIndex score kernels.",
                variants=family.variants,
            )
        ),
        f"{spec.family}/{RUNTIME}.py": format_source(
            env.get_template("runtime.py.j2").render(
                **_stamp(family),
                compress_rate=spec.computation.compress_rate,
                default_scale=repr(spec.computation.softmax_scale),
                masked_value=_float_literal(spec.computation.masked_value),
                masks_source="\n\n".join(
                    inspect.getsource(f) for f in (masks.query_block_bounds, masks.block_kind)
                ),
                **_sparse_vmem(family),
            )
        ),
    }
    for plan in family.plans:
        files[f"{spec.family}/{plan.name}.py"] = render_variant(env, family, plan)
    return files
