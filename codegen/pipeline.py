"""The generator's data path, run once: spec -> variants -> legality -> kernel plans -> VMEM budget.

Its result, a ``Family``, is what rendering, ``codegen explain``, the benchmarks and the tests read:
nothing downstream recomputes a plan or a limit.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

from codegen import budget, load, plan, validate, variants
from codegen.errors import Problem, SpecError
from codegen.spec import FamilySpec


@dataclasses.dataclass(frozen=True)
class Family:
    spec: FamilySpec
    plans: tuple[plan.VariantPlan, ...]  # sorted by variant name, VMEM limits set
    warnings: tuple[Problem, ...]
    spec_path: str  # as stamped into generated files
    sha256: str

    @property
    def variants(self) -> list[variants.Variant]:
        return [p.variant for p in self.plans]

    def plan(self, name: str) -> plan.VariantPlan:
        """The plan of the variant called ``name``; KeyError if there is none."""
        for p in self.plans:
            if p.name == name:
                return p
        raise KeyError(name)


def build(spec: FamilySpec, source: str = "<spec>", spec_path: str = "<spec>", sha256: str = "") -> Family:
    """Expands, validates, plans and budgets; raises ``SpecError`` listing every broken rule."""
    found = variants.expand(spec, source)
    problems: list[Problem] = []
    warnings: list[Problem] = []
    plans = []
    for variant in found:
        illegal = validate.problems(spec, variant)
        problems += illegal
        if illegal:  # the budget needs legal blocks and a target to measure against
            continue
        budgeted, errors, cautions = budget.apply(spec, plan.build(variant))
        plans.append(budgeted)
        problems += errors
        warnings += cautions
    problems += _production_problems(spec, {variant.name: variant for variant in found})
    if problems:
        raise SpecError(source, problems)
    unique = tuple({str(w): w for w in warnings}.values())
    return Family(spec, tuple(plans), unique, spec_path, sha256)


def _production_problems(spec: FamilySpec, emitted: dict[str, variants.Variant]) -> list[Problem]:
    """``production`` names emitted variants, each once, at most one per q layout."""
    problems = []
    layouts: dict[str, str] = {}
    for i, name in enumerate(spec.production):
        if name not in emitted:
            problems.append(Problem(f"production[{i}]", name, "must name a variant the spec emits"))
        elif spec.production.index(name) != i:
            problems.append(Problem(f"production[{i}]", name, "names a variant already listed"))
        else:
            layout = emitted[name].q_layout
            if layout in layouts:
                problems.append(
                    Problem(f"production[{i}]", name, f"a second {layout} variant (first: {layouts[layout]})")
                )
            layouts.setdefault(layout, name)
    return problems


def load_family(spec_path: str | os.PathLike, out_root: str | os.PathLike | None = None) -> Family:
    """The family of the spec file at ``spec_path``. The path stamped into generated files is relative
    to the project root that holds ``out_root`` (default: the spec's own project)."""
    spec, sha256 = load.load(spec_path)
    resolved = pathlib.Path(spec_path).resolve()
    root = pathlib.Path(out_root).resolve().parent if out_root else resolved.parent.parent
    stamped = pathlib.Path(os.path.relpath(resolved, root)).as_posix()
    return build(spec, str(spec_path), stamped, sha256)
