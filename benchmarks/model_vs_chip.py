"""The compiled-schedule model (``codegen explain --compiled --chip v5e``) against ``codegen bench`` on a v5e.

For each production variant, at both bench shapes and under the masks the bench times, the model's
time of a call is the sum of its programs' parts as ``codegen.compiled`` costs them (the Pallas kernels,
and XLA's own programs around them: the operands' layout and bounds), and at least the per-call floor
measured on the chip (``benchmarks/chip_constants.py``: what a call of empty grid steps costs when calls
run back to back, as the bench runs them). Forward: its program. Forward + gradient: the forward
kernel and the gradient program's kernels and XLA programs. Measured: ``benchmarks/results/v5e.json``.
Prints a markdown table (docs/performance.md, "The model against the chip"); takes minutes (libtpu).

    python benchmarks/model_vs_chip.py
"""

from __future__ import annotations

import json
import pathlib

from codegen import compiled, pipeline

ROOT = pathlib.Path(__file__).resolve().parent.parent
MEASURED = ROOT / "benchmarks" / "results" / "v5e.json"
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
    measured = json.loads(MEASURED.read_text())
    floor_ms = json.loads(CONSTANTS.read_text())["empty_steps"]["fixed_us"] / 1e3
    chip = {(r["subject"], r["shape"][2], r["case"]): r["ms"] for r in measured["results"] if r["ms"]}
    shapes = sorted({tuple(r["shape"][:5]) for r in measured["results"] if r["shape"][2]}, key=lambda s: s[2])
    lines = [
        "| variant | S, W | case | modelled ms | measured ms | measured / modelled |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    ratios = []
    for name in family.spec.production:
        plan = family.plan(name)
        for shape in shapes:
            rows = compiled.explain(
                "generated.csa_v4", [plan], ["v5e"], shape, family.spec.computation.compress_rate,
                masks=tuple(MASKS), programs=("fwd", "grad"),
            )  # fmt: skip
            for mask, label in MASKS.items():
                for gradient in (False, True):
                    case = f"{'grad' if gradient else 'score'}.{mask}"
                    if (name, shape[2], case) not in chip:
                        continue
                    model, ms = modelled_ms(rows, mask, gradient, floor_ms), chip[(name, shape[2], case)]
                    ratios.append(ms / model)
                    what = f"{'forward + gradient' if gradient else 'forward'}, {label}"
                    lines.append(
                        f"| `{name}` | {shape[2]}, {shape[4]} | {what} | {model:.2f} | {ms:.2f} | {ms / model:.2f} |"
                    )
    inside = sum(abs(r - 1) <= WITHIN for r in ratios)
    lines += [
        "",
        f"Measured / modelled from {min(ratios):.2f} to {max(ratios):.2f}: {inside} of {len(ratios)} cases within "
        f"{WITHIN:.0%} (per-call floor {floor_ms:.3f} ms; chip run of {measured['date']}, JAX {measured['jax']}).",
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
