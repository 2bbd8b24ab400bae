"""A family's plans -> formatted Python source: Jinja2 templates, then black. Pure: writes nothing.

A family package holds, besides its ``__init__``: the modules of ``SHIPPED``, copied as they are
from ``codegen/shipped/`` (what every variant shares), ``_family`` (the spec's few constants they
read), one ``_dense_*`` module per dense kernel shape and one ``_sparse_*`` module per sparse one
(each written once for every variant that runs it), and one small module per variant binding its
tiling, dtypes and plan to those kernels.

Output is a function of the spec bytes, the templates and the shipped modules alone (no dates, no
absolute paths), so rendering twice gives byte-identical files. The templates ship inside the package
(``codegen.templates``, mapped from the repository's ``templates/``), so an installed codegen renders
from any directory.
"""

from __future__ import annotations

import importlib.resources
import math

import black
import jinja2

from codegen import budget
from codegen import plan as plan_module
from codegen.pipeline import Family
from codegen.plan import VariantPlan

# Black's style is pinned by its major version in pyproject.toml; the line length is ours.
BLACK_MODE = black.Mode(line_length=110, target_versions={black.TargetVersion.PY310})
# Copied from codegen/shipped/ into every family package (see codegen/shipped/__init__.py).
SHIPPED = (
    "_geometry", "_checks", "_fp8", "_mesh", "_kernel_ops", "_operands", "_gather", "_autodiff", "_take",
    "_helpers", "_select", "_topk",
)  # fmt: skip
_BACKWARD = {
    "fused": "fused Pallas kernels (``_dense.backward``: dq with dweights and dk in one where one w tile covers W, "
    "else two), logits recomputed in VMEM",
    "reference": "the float32 reference VJP, scanned over head chunks (``_autodiff.reference_backward``)",
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


def _policy_facts(variant) -> dict:
    return dict(
        precision=variant.policy.precision.upper(),
        fp8=variant.policy.qk == "float8_e4m3fn",
        k_scale=variant.policy.k_scale,
    )


_DTYPE_TAG = {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "fp8"}


def sparse_modules(family: Family) -> dict[str, list[VariantPlan]]:
    """The variants of each ``_sparse_*`` module: one per sparse kernel shape, which is the q/k dtype,
    the key scale, the MXU precision and the sparse plan (a reference-backward variant gathers float32
    rows in its backward: its own module where that differs). The output and weights dtypes are the
    variant's, at call time."""
    groups: dict[tuple, list[VariantPlan]] = {}
    for p in family.plans:
        policy = p.variant.policy
        key = (policy.qk, policy.k_scale, policy.precision, plan_module.sparse(p.variant))
        groups.setdefault(key, []).append(p)
    names = {}
    fused_first = sorted(groups.items(), key=lambda item: all(p.variant.backward != "fused" for p in item[1]))
    for (qk, *_), plans in fused_first:
        name = f"_sparse_{_DTYPE_TAG[qk]}"
        while name in names:
            name += "_refbwd"  # the fused variants' module holds the plain name
        names[name] = plans
    return names


def dense_modules(family: Family) -> dict[str, list[VariantPlan]]:
    """The variants of each ``_dense_*`` module (see ``VariantPlan.dense_module``)."""
    groups: dict[str, list[VariantPlan]] = {}
    for p in family.plans:
        groups.setdefault(p.dense_module, []).append(p)
    return groups


def sparse_module_names(family: Family) -> dict[str, str]:
    """Variant name -> the ``_sparse_*`` module it binds."""
    return {p.name: module for module, plans in sparse_modules(family).items() for p in plans}


def render_variant(
    env: jinja2.Environment, family: Family, plan: VariantPlan, sparse_module: str | None = None
) -> str:
    """A variant's module; ``sparse_module`` (its ``_sparse_*`` module) is looked up when not given."""
    variant = plan.variant
    sparse_module = sparse_module or sparse_module_names(family)[plan.name]
    source = env.get_template("module.py.j2").render(
        **_stamp(family),
        **_policy_facts(variant),
        v=variant,
        p=plan,
        variant_dict=repr(variant.as_dict()),
        default_scale=family.spec.computation.softmax_scale,
        masked_text=repr(family.spec.computation.masked_value),
        vmem_limits=repr({k.name: k.vmem_limit_bytes for k in plan.kernels}),
        targets=", ".join(family.spec.targets),
        backward_summary=_BACKWARD[variant.backward],
        sparse_module=sparse_module,
    )
    return format_source(source)


def _geometry_of(kernel: plan_module.KernelPlan) -> tuple:
    """What a dense module renders of a kernel: its grid, prefetch, skip and blocks, not their dtypes."""
    blocks = tuple((b.name, b.shape, b.index, b.array, b.dtype_key, b.grad_of) for b in kernel.blocks)
    scratch = tuple((b.name, b.shape, b.dtype) for b in kernel.scratch)
    return kernel.grid, kernel.scalar_prefetch, kernel.skip, blocks, scratch


def render_dense(env: jinja2.Environment, family: Family, plans: list[VariantPlan]) -> str:
    """One ``_dense_*`` module: rendered from the plan of a variant with the fused backward (their
    kernels' geometry is the same for every variant of the module; tiling and dtypes are call-time)."""
    p = max(plans, key=lambda p: len(p.kernels))
    for other in plans:  # what the module renders must hold for every variant that binds it
        mismatched = [k.name for k in other.kernels if _geometry_of(k) != _geometry_of(p.kernel(k.name))]
        assert (
            not mismatched
        ), f"{other.name} and {p.name} share {other.dense_module} but differ in {mismatched}"
    return format_source(
        env.get_template("tpu/dense.py.j2").render(
            **_stamp(family),
            v=p.variant,
            p=p,
            chunked=p.head_chunk > 0,
            upcast=p.mxu_operand != p.variant.policy.qk,
            k_scale=p.variant.policy.k_scale,
            users=[q.name for q in plans],
        )
    )


def render_sparse(env: jinja2.Environment, family: Family, plans: list[VariantPlan]) -> str:
    variant = plans[0].variant
    return format_source(
        env.get_template("tpu/sparse.py.j2").render(
            **_stamp(family),
            **_policy_facts(variant),
            v=variant,
            sparse=dict(zip(("forward", "backward"), plan_module.sparse(variant))),
            users=[p.name for p in plans],
        )
    )


def _sparse_vmem(family: Family) -> dict:
    """The VMEM facts the sparse kernels' resident route is sized by: the smallest capacity, and the
    smallest default scoped limit, of the spec's TPU targets."""
    chosen = budget.targets(family.spec, "tpu")
    return dict(
        sparse_vmem_capacity=f"{min(c.vmem_bytes for c in chosen)}  # {', '.join(c.name for c in chosen)}",
        sparse_scoped_default=min(c.scoped_vmem_default_bytes for c in chosen),
    )


def shipped_source(env: jinja2.Environment, family: Family, module: str) -> str:
    """``codegen/shipped/<module>.py`` under the generated header, as it is."""
    text = importlib.resources.files("codegen.shipped").joinpath(f"{module}.py").read_text()
    header = env.from_string('{% import "_macros.j2" as m %}{{ m.header(spec_path, spec_sha256) }}\n')
    return format_source(header.render(**_stamp(family)) + text)


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
                production=spec.production,
            )
        ),
        f"{spec.family}/_family.py": format_source(
            env.get_template("family.py.j2").render(
                **_stamp(family),
                compress_rate=spec.computation.compress_rate,
                default_scale=repr(spec.computation.softmax_scale),
                masked_value=_float_literal(spec.computation.masked_value),
                **_sparse_vmem(family),
            )
        ),
    }
    for module in SHIPPED:
        files[f"{spec.family}/{module}.py"] = shipped_source(env, family, module)
    for module, plans in dense_modules(family).items():
        files[f"{spec.family}/{module}.py"] = render_dense(env, family, plans)
    for module, plans in sparse_modules(family).items():
        files[f"{spec.family}/{module}.py"] = render_sparse(env, family, plans)
    sparse_of = sparse_module_names(family)
    for plan in family.plans:
        files[f"{spec.family}/{plan.name}.py"] = render_variant(env, family, plan, sparse_of[plan.name])
    return files
