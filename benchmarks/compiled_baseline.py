"""The production kernels as the TPU compiler schedules them: the baseline later kernel work improves on.

Compiles (libtpu, ahead of time; the tpu extra) the production variants' forward and gradient at the
DeepSeek-V4 prefill shape for v6e and 7x, and prints per kernel and mask the cycles of one call (the
bundles of the path each grid step takes, summed: ``codegen.compiled``), the ratio to a plain Pallas
matmul of the same depth over as many logits, and the unit whose slots the full path fills most.
Takes about ten minutes on two cores (each all-heads gradient compiles for two to three).

    python benchmarks/compiled_baseline.py [--chips v6e,7x] [--variants A,B] [--shape B,H,S,D,W]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only classifies blocks; libtpu runs in children
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from codegen import compiled, pipeline, tpu_compile  # noqa: E402

PRODUCTION = (
    "tpu_hm_bf16_q256_w2048c512f256_hcall",
    "tpu_sm_bf16_q256_w2048c512f256_hcall",
    "tpu_sm_bf16_q512_w2048c512_hc16",
)
UNITS = ("MXU", "XLU", "VALU", "VLOAD", "VSTORE")
# MaxText's forward kernel (the seed PR's csa_streamindex.py: heads stacked, no branches, no skipping),
# compiled at the V4 shape: bundles of its grid step, which covers 64 heads x 128 queries x 1024 blocks.
MAXTEXT_STEP = {"v6e": 8541, "7x": 8524}
MAXTEXT_LOGITS = 64 * 128 * 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chips", default="v6e,7x")
    ap.add_argument("--variants", default=",".join(PRODUCTION))
    ap.add_argument("--shape", default="1,64,8192,128,2048")
    ap.add_argument("--jobs", type=int)
    a = ap.parse_args(argv)
    if not tpu_compile.available():
        print(f"error: this needs {tpu_compile.MISSING}", file=sys.stderr)
        return 2
    root = pathlib.Path(__file__).resolve().parent.parent
    family = pipeline.load_family(root / "specs" / "csa_v4.yaml")
    shape = tuple(int(x) for x in a.shape.split(","))
    plans = [family.plan(name) for name in a.variants.split(",")]
    chips = a.chips.split(",")
    rows = compiled.explain(
        f"generated.{family.spec.family}", plans, chips, shape, family.spec.computation.compress_rate,
        masks=("unmasked", "causal"), programs=("fwd", "grad"), jobs=a.jobs,
    )  # fmt: skip
    # the kernels alone (XLA around them: model_vs_chip.py)
    rows = [r for r in rows if r.kernel != compiled.XLA]
    import jax

    print(f"B,H,S,D,W = {a.shape}; JAX {jax.__version__}; compiled by libtpu, read from its final bundles")
    print(
        "cycles: per grid step the bundles of the path it takes, summed (a bundle a cycle, DMAs overlapped, no stalls)"
    )
    print(
        "x matmul: over a plain Pallas matmul of the same depth, operand type and output dtype, as many logits"
    )
    print("busiest unit: the largest slot occupancy of the full path, among " + ", ".join(UNITS))
    width = max(len(p.name) for p in plans)
    header = f"{'variant':{width}s} {'chip':4s} {'kernel':12s} {'mask':9s} {'Mcycles':>8s} {'x matmul':>8s}  busiest unit"
    print(header)
    totals: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        if not r.ok:
            print(f"{r.variant:{width}s} {r.chip:4s} {r.kernel:12s} {r.mask:9s} DOES NOT COMPILE: {r.error}")
            continue
        k = r.report
        unit = max(UNITS, key=lambda u: k.occupancy[u])
        print(f"{r.variant:{width}s} {r.chip:4s} {r.kernel:12s} {r.mask:9s} {k.cycles / 1e6:8.2f} "
              f"{k.cycles / k.calibration_cycles:8.2f}  {unit} {k.occupancy[unit]:.0%}")  # fmt: skip
        total = totals.setdefault((r.variant, r.chip, r.mask), [0, 0])
        total[0] += k.cycles
        total[1] = k.calibration_cycles
    print("forward + gradient (forward, dq_dweights, dk):")
    for (variant, chip, mask), (cycles, calib) in totals.items():
        print(
            f"{variant:{width}s} {chip:4s} {'all three':12s} {mask:9s} {cycles / 1e6:8.2f} {cycles / calib:8.2f}"
        )
    print(
        "a grid step in bundles, on the full path and with every region counted as taken (the first step's "
        "zeroing, the last one's finish, the empty and masked paths), and per 64 heads x 128 queries x 1024 "
        "blocks against MaxText's forward step (seed PR: "
        + ", ".join(f"{c} {n:,}" for c, n in MAXTEXT_STEP.items())
        + ")"
    )
    print(f"{'variant':{width}s} {'chip':4s} {'kernel':12s} {'full path':>17s} {'every region':>17s}")
    for r in rows:
        if r.ok and r.mask == "causal" and r.chip in MAXTEXT_STEP:
            plan = next(p for p in plans if p.name == r.variant)
            heads = plan.head_chunk if "c" in plan.kernel(r.kernel).axes else shape[1]  # heads a step covers
            per_step = heads * plan.block_q * plan.block_w  # logits a step covers
            cells = [
                f"{n:9,d} {n * MAXTEXT_LOGITS / per_step / MAXTEXT_STEP[r.chip]:6.2f}x"
                for n in (r.report.executed, r.report.straight_line)
            ]
            print(f"{r.variant:{width}s} {r.chip:4s} {r.kernel:12s} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
