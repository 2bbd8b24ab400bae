"""Tilings chosen by the compiler: ``codegen explain SPEC VARIANT --compiled --rank``.

A variant's candidates are the variant itself (its layout, dtypes and backward) with each tiling and
head chunk the spec's ``tuning`` section names (default: every spec tiling, the matrix's head chunks).
Each legal candidate is planned and budgeted as any variant is, rendered into a scratch package (never
into ``generated/``), compiled with libtpu for every chip and costed as ``codegen.compiled`` costs the
variant itself: cycles of a forward and gradient call (forward, then dq_dk or dq_dweights and dk) at the
shape and mask.
The ranking per chip, fastest first, is what the spec's production tiling should follow.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile

from codegen import compiled, output, pipeline, render
from codegen.errors import SpecError
from codegen.spec import VariantChoice, VariantMatrix, Variants

# one call's forward and gradient: the forward, then dq_dk or dq_dweights and dk (``cost.call_kernels``)
KERNELS = ("forward", "dq_dweights", "dk", "dq_dk")


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str  # the candidate variant's name
    tiling: str  # spec tiling name
    head_chunk: int
    error: str  # why it is not a candidate (illegal, over VMEM), or ""


def _spec_for(family: pipeline.Family, choices: list[dict]):
    """The family's spec emitting just ``choices``, as a family of its own (``<family>_tuning``)."""
    first, rest = choices[0], choices[1:]
    matrix = VariantMatrix(**{axis: [value] for axis, value in first.items()})
    variants = Variants(matrix=matrix, include=[VariantChoice(**c) for c in rest])
    return family.spec.model_copy(
        update={"family": f"{family.spec.family}_tuning", "variants": variants, "production": []}
    )


def candidates(
    family: pipeline.Family, variant: str, on_chip: bool = False
) -> tuple[pipeline.Family | None, list[Candidate]]:
    """The tuning family of ``variant`` (None if no candidate is legal) and every candidate, with why
    each illegal one is not. ``on_chip``: those ``codegen bench --rank`` times, the spec's ``tuning.chip``
    tilings with the variant's own head chunk (at most 8), not the compiler's whole matrix."""
    base = family.plan(variant).variant.choice()
    tuning = family.spec.tuning
    if on_chip:
        tilings, chunks = (tuning.chip if tuning else []), [base["head_chunk"]]
    else:
        tilings = tuning.tilings if tuning else sorted(family.spec.tilings)
        chunks = tuning.head_chunk if tuning else family.spec.variants.matrix.head_chunk
    legal, found = [], []
    for tiling in tilings:
        for chunk in chunks:
            choice = {**base, "tiling": tiling, "head_chunk": chunk}
            try:
                one = pipeline.build(_spec_for(family, [choice]))
            except SpecError as err:
                reasons = "; ".join(str(p) for p in err.problems)
                found.append(Candidate(f"{tiling}/hc{chunk}", tiling, chunk, reasons))
                continue
            legal.append(choice)
            found.append(Candidate(one.plans[0].name, tiling, chunk, ""))
    if not legal:
        return None, found
    return pipeline.build(_spec_for(family, legal)), found


def render_to(family: pipeline.Family, root: str) -> str:
    """Writes ``family``'s package under ``root``; returns its importable name (``root`` on sys.path)."""
    files = {rel: text for rel, text in render.render_family(family).items() if "/" in rel}
    output.apply(output.plan(pathlib.Path(root), family.spec.family, files))
    return family.spec.family


@dataclasses.dataclass(frozen=True)
class Ranked:
    chip: str
    variant: str
    tiling: str
    head_chunk: int
    cycles: dict[str, int]  # per kernel of KERNELS, at the mask
    error: str  # a kernel that did not compile, or ""

    @property
    def total(self) -> int:
        return sum(self.cycles.values())


def rank(
    family: pipeline.Family,
    variant: str,
    chips: list[str],
    shape,
    mask: str = "causal",
    jobs: int | None = None,
) -> tuple[list[Ranked], list[Candidate]]:
    """Every legal candidate of ``variant`` compiled for ``chips`` and costed at ``shape`` under ``mask``;
    per chip, the compiled ones fastest first, then those that did not compile."""
    tuning, found = candidates(family, variant)
    if tuning is None:
        return [], found
    by_name = {c.name: c for c in found}
    with tempfile.TemporaryDirectory(prefix="codegen-tuning-") as root:
        package = render_to(tuning, root)
        rows = compiled.explain(
            package, list(tuning.plans), chips, shape, family.spec.computation.compress_rate,
            masks=(mask,), programs=("fwd", "grad"), jobs=jobs, path=root,
        )  # fmt: skip
    out = []
    for chip in chips:
        for p in tuning.plans:
            mine = [r for r in rows if r.chip == chip and r.variant == p.name and r.kernel in KERNELS]
            failed = next((f"{r.kernel}: {r.error}" for r in mine if not r.ok), "")
            cycles = {} if failed else {r.kernel: r.report.cycles for r in mine}
            c = by_name[p.name]
            out.append(Ranked(chip, p.name, c.tiling, c.head_chunk, cycles, failed))
    out.sort(key=lambda r: (chips.index(r.chip), bool(r.error), r.total))
    return out, found


def table(
    ranked: list[Ranked], found: list[Candidate], family: pipeline.Family, variant: str, shape, mask: str
) -> str:
    """The ranking per chip, one line per candidate, then the candidates that are not legal."""
    own = family.plan(variant).variant
    head = (
        f"tilings of {variant} ranked by compiled cycles of forward + gradient (backward: dq_dk, or dq_dweights "
        f"and dk) per call; B,H,S,D,W = {','.join(map(str, shape))}, {mask}; libtpu's final bundles, a bundle a cycle, "
        "DMAs overlapped, no stalls; * the spec's tiling for the variant"
    )
    columns = [
        "chip",
        "rank",
        "tiling",
        "block_q x block_w / compute_w",
        "head_chunk",
        "forward",
        "backward",
        "Mcycles",
        "x best",
    ]
    lines = []
    for chip in dict.fromkeys(r.chip for r in ranked):
        mine = [r for r in ranked if r.chip == chip]
        best = min((r.total for r in mine if not r.error), default=0)
        for n, r in enumerate(mine, 1):
            t = family.spec.tilings[r.tiling]
            mark = "*" if (r.tiling, r.head_chunk) == (own.tiling, own.head_chunk) else ""
            shape_text = t.shape_text()
            chunk = str(r.head_chunk or "all")
            if r.error:
                lines.append([chip, "-", r.tiling + mark, shape_text, chunk, f"DOES NOT COMPILE: {r.error}"])
                continue
            lines.append(
                [chip, str(n), r.tiling + mark, shape_text, chunk,
                 f"{r.cycles['forward'] / 1e6:.2f}", f"{(r.total - r.cycles['forward']) / 1e6:.2f}",
                 f"{r.total / 1e6:.2f}", f"{r.total / best:.2f}"]
            )  # fmt: skip
    widths = [max(len(c), *(len(line[i]) for line in lines if len(line) > i)) for i, c in enumerate(columns)]
    out = [head, "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    out += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    pick = best_overall(ranked)
    if pick:
        (tiling, chunk), worst = pick
        out.append(
            f"across the chips: {tiling} with head_chunk {chunk or 'all'} (at worst {worst:.2f}x a chip's best)"
        )
    out += [
        f"not a candidate: {c.tiling} with head_chunk {c.head_chunk}: {c.error}" for c in found if c.error
    ]
    return "\n".join(out)


def _worst_ratios(ranked: list[Ranked]) -> dict[tuple[str, int], float]:
    """Per candidate (tiling, head chunk) that compiled on every chip: its largest ratio to a chip's best."""
    chips = {r.chip for r in ranked}
    best = {c: min((r.total for r in ranked if r.chip == c and not r.error), default=0) for c in chips}
    ratios: dict[tuple[str, int], list[float]] = {}
    for r in ranked:
        if not r.error:
            ratios.setdefault((r.tiling, r.head_chunk), []).append(r.total / best[r.chip])
    return {key: max(v) for key, v in ratios.items() if len(v) == len(chips)}


def best_overall(ranked: list[Ranked]) -> tuple[tuple[str, int], float] | None:
    """The candidate (tiling, head chunk) whose worst chip is nearest that chip's best, and that worst
    ratio: the one tiling to take for every chip."""
    ratios = _worst_ratios(ranked)
    return min(ratios.items(), key=lambda item: item[1]) if ratios else None
