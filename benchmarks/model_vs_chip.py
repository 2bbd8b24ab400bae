"""The compiled-schedule model (``codegen explain --compiled --chip v5e``) against ``codegen bench`` on a v5e.

For each production variant, at both bench shapes and under the masks the bench times, the model's
time of a call is the sum of its programs' parts as ``codegen.compiled`` costs them (the Pallas kernels,
and XLA's own programs around them: the operands' layout and bounds), and at least the per-call floor
measured on the chip (``benchmarks/chip_constants.py``: what a call of empty grid steps costs when calls
run back to back, as the bench runs them). Forward: its program. Forward + gradient: the forward
kernel and the gradient program's kernels and XLA programs. Measured: ``benchmarks/results/v5e.json``
(the production variants at the bench's two shapes, the cases the model's chip facts were read
against) and the cases it was not tuned on (``v5e-untuned-*.json``: the float8 and float32-weights
variants at three shapes). Prints a markdown table (docs/performance.md, "The model against the
chip"); takes minutes (libtpu).

    python benchmarks/model_vs_chip.py
"""

from __future__ import annotations

import json
import pathlib

from codegen import compiled, pipeline

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MEASURED = [
    (RESULTS / "v5e.json", "tuned"),
    *((f, "untuned") for f in sorted(RESULTS.glob("v5e-untuned-*.json"))),
]
CONSTANTS = ROOT / "benchmarks" / "results" / "v5e_constants.json"
MASKS = {"unmasked": "unmasked", "causal": "causal", "masked": "every block masked"}
WITHIN = 0.25  # the bar: the model within 25% of the chip


def modelled_ms(rows, mask: str, gradient: bool, floor_ms: float) -> float:
    """A call's modelled milliseconds from ``explain`` rows of one variant and shape."""
    parts = [
        r.report.seconds
        for r in rows
        if r.mask == mask
        and (
            (r.program == "fwd" and r.kernel == "forward")
            or (r.program == ("grad" if gradient else "fwd") and r.kernel != "forward")
        )
    ]
    return max(1e3 * sum(parts), floor_ms)


def main() -> None:
    family = pipeline.load_family(str(ROOT / "specs" / "csa_v4.yaml"))
    floor_ms = json.loads(CONSTANTS.read_text())["empty_steps"]["fixed_us"] / 1e3
    variants = {p.name for p in family.plans}
    lines = [
        "| variant | S, W | case | modelled ms | measured ms | measured / modelled | set |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    ratios: dict[str, list[float]] = {}
    dates = set()
    for path, label in MEASURED:
        measured = json.loads(path.read_text())
        dates.add(f"{measured['date']}, JAX {measured['jax']}")
        chip = {
            (r["subject"], tuple(r["shape"][:5]), r["case"]): r["ms"] for r in measured["results"] if r["ms"]
        }
        subjects = dict.fromkeys((name, shape) for name, shape, _ in chip if name in variants)
        for name, shape in sorted(subjects, key=lambda x: (x[1][2], x[0])):
            rows = compiled.explain(
                "generated.csa_v4", [family.plan(name)], ["v5e"], shape, family.spec.computation.compress_rate,
                masks=tuple(MASKS), programs=("fwd", "grad"),
            )  # fmt: skip
            for mask, text in MASKS.items():
                for gradient in (False, True):
                    ms = chip.get((name, shape, f"{'grad' if gradient else 'score'}.{mask}"))
                    if ms is None:
                        continue
                    model = modelled_ms(rows, mask, gradient, floor_ms)
                    ratios.setdefault(label, []).append(ms / model)
                    what = f"{'forward + gradient' if gradient else 'forward'}, {text}"
                    lines.append(
                        f"| `{name}` | {shape[2]}, {shape[4]} | {what} | {model:.2f} | {ms:.2f} | {ms / model:.2f} | {label} |"
                    )
    lines.append("")
    for label, found in ratios.items():
        inside = sum(abs(r - 1) <= WITHIN for r in found)
        lines.append(
            f"{label.capitalize()} cases: measured / modelled from {min(found):.2f} to {max(found):.2f}, {inside} of "
            f"{len(found)} within {WITHIN:.0%}."
        )
    lines.append(f"Per-call floor {floor_ms:.3f} ms; chip runs of {'; '.join(sorted(dates))}.")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
