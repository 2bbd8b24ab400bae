"""Dense or sparse gradient? Both compiled by libtpu and costed from their own schedules.

At H = 64, D = 128, B = 1 and each (S, W, top_k) of ``SHAPES``, compiles (ahead of time, no TPU) the
gradient of a loss through the production variant's ``score`` with causal CSA bounds and through its
``sparse_score`` at top_k indices, for each chip, and reads every kernel's cost as ``codegen explain
--compiled`` does (``codegen.compiled``): the bundles of its grid steps, a loop inside a step once per
trip, and the HBM bytes of its DMAs (the dense kernels' from the plan's model); a kernel's time is the
larger of its cycles (at the clock where the calibration matmul runs at the chip's cited peak) and
its bytes at the chip's cited HBM bandwidth.

The break-even: under causal masking the dense gradient's cost grows with the (query, visible block)
pairs, about S W / 2 with S = 4 W, the sparse one's with the slots, S top_k, while all of k fits VMEM
(past that, each window of k costs the sparse kernels another call). From the per-pair and per-slot
costs at S = 65536, W = 16384 (one window), the sparse gradient is the cheaper one from W / top_k =
2 x (cost per slot) / (cost per visible pair): a linear extrapolation in W, checked by the measured
shape at W = 65536 (W / top_k = 64: the backward takes k in two windows, the forward in one).

    python benchmarks/sparse_backward.py [--variant NAME] [--chip v6e,7x] [--jobs N]
"""

from __future__ import annotations

import argparse
import pathlib
import re

import numpy as np

from codegen import compiled
from codegen.pipeline import load_family

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEC = "specs/csa_v4.yaml"
SHAPES = ((8192, 2048, 512), (65536, 16384, 1024), (262144, 65536, 1024))  # S, W, top_k, S = 4 W
BREAK_EVEN_SHAPE = SHAPES[1]  # the largest with all of k in one window
HEADS, HEAD_DIM, BATCH = 64, 128, 1
DEFAULT_VARIANT = "tpu_sm_bf16_q512_w2048c512_hc16"
ROUTES = (("dense", "grad"), ("sparse", "sparse_grad"))


def largest_in_hbm(variant, seq_len, num_blocks, top_k, sparse, windows=1):
    """(name, bytes) of the largest array the gradient program holds in HBM: inputs, kernel outputs and
    the cotangent (what a caller's loss makes outside the kernels is the caller's)."""
    item = lambda dtype: 1 if dtype == "float8_e4m3fn" else np.dtype(dtype).itemsize
    q = BATCH * seq_len * HEADS * HEAD_DIM
    arrays = {"q": q * item(variant.policy.qk), "dq": q * item(variant.policy.qk_grad_dtype)}
    if sparse:
        arrays |= {"indices [S, top_k] int32": BATCH * seq_len * top_k * 4,
                   "score, cotangent [S, top_k] float32": BATCH * seq_len * top_k * 4,
                   "dk [W, D] float32": BATCH * num_blocks * HEAD_DIM * 4}  # fmt: skip
        if windows > 1:  # dq adds up over k's windows in float32
            arrays["dq [S, H, D] float32, summed over k's windows"] = q * 4
    else:
        out = variant.policy.out
        arrays[f"score, cotangent [S, W] {out}"] = BATCH * seq_len * num_blocks * item(out)
    return max(arrays.items(), key=lambda item: item[1])


def hbm_oom(error):
    """The compiler's HBM shortfall where ``error`` says the program does not fit HBM (else None)."""
    m = re.search(r"temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", error or "")
    return m and f"its HBM temporaries {m.group(1)} exceed the chip's {m.group(2)}"


def visible_pairs(seq_len, num_blocks, compress_rate):
    """(query, compressed block) pairs causal CSA lets a query see: w < (p + 1) // r."""
    return int(np.minimum((np.arange(seq_len) + 1) // compress_rate, num_blocks).sum())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default=DEFAULT_VARIANT)
    parser.add_argument("--chip", default="v6e,7x")
    parser.add_argument("--jobs", type=int)
    args = parser.parse_args(argv)
    family = load_family(SPEC)
    plan = family.plan(args.variant)
    rate = family.spec.computation.compress_rate
    chip_names = args.chip.split(",")
    print(f"Gradient of a loss through `{args.variant}`, causal, H = {HEADS}, D = {HEAD_DIM}, B = {BATCH}: "
          "compiled by libtpu (not run), costed from the schedules\n")  # fmt: skip
    print("| S, W, top_k | chip | route | kernel | Mcycles | HBM GB | ms |")
    print("|---|---|---|---|---:|---:|---:|")
    totals, largest = {}, []
    for seq_len, num_blocks, top_k in SHAPES:
        shape = (BATCH, HEADS, seq_len, HEAD_DIM, num_blocks)
        rows = compiled.explain(
            f"generated.{family.spec.family}", [plan], chip_names, shape, rate,
            programs=tuple(p for _, p in ROUTES), top_k=top_k, jobs=args.jobs, path=str(ROOT),
        )  # fmt: skip
        failed = [
            f"{r.chip} {r.program} {r.kernel}: {r.error}" for r in rows if not r.ok and not hbm_oom(r.error)
        ]
        if failed:
            raise SystemExit("did not compile: " + "; ".join(failed))
        for chip in chip_names:
            for route, program in ROUTES:
                mine = [r for r in rows if r.chip == chip and r.program == program]
                if not all(r.ok for r in mine):  # the program needs more HBM than the chip has
                    print(f"| {seq_len}, {num_blocks}, {top_k} | {chip} | {route} | **gradient** | "
                          f"does not compile: {hbm_oom(mine[0].error)} | | |")  # fmt: skip
                    continue
                for r in mine:
                    k = r.report
                    print(f"| {seq_len}, {num_blocks}, {top_k} | {chip} | {route} | {r.kernel} | "
                          f"{k.cycles / 1e6:,.1f} | {k.call_bytes / 1e9:,.2f} | {k.seconds * 1e3:,.2f} |")  # fmt: skip
                total = sum(r.report.seconds for r in mine)
                totals[(seq_len, num_blocks, top_k, chip, route)] = total
                print(f"| {seq_len}, {num_blocks}, {top_k} | {chip} | {route} | **gradient** | "
                      f"{sum(r.report.cycles for r in mine) / 1e6:,.1f} | "
                      f"{sum(r.report.call_bytes for r in mine) / 1e9:,.2f} | **{total * 1e3:,.2f}** |")  # fmt: skip
        for route, _ in ROUTES:
            _, (_, windows, _) = compiled.sparse_windows(
                f"generated.{family.spec.family}", str(ROOT), args.variant, "sparse_backward", shape, top_k
            )
            name, held = largest_in_hbm(plan.variant, seq_len, num_blocks, top_k, route == "sparse", windows)
            largest.append(f"{seq_len}, {num_blocks}, {top_k} {route}: {name} ({held / 2**20:,.0f} MiB)")
    print("\nLargest array each gradient program holds in HBM:\n")
    for line in largest:
        print(f"- {line}")
    print("\nSparse against dense gradient time:\n")
    for seq_len, num_blocks, top_k in SHAPES:
        time = lambda chip, route: totals.get((seq_len, num_blocks, top_k, chip, route))
        ratios = ", ".join(
            f"{chip} {time(chip, 'sparse') / time(chip, 'dense'):.2f}" if time(chip, "dense") else
            f"{chip} only the sparse gradient compiles" for chip in chip_names
        )  # fmt: skip
        print(
            f"- S, W, top_k = {seq_len}, {num_blocks}, {top_k} (W / top_k = {num_blocks // top_k}): {ratios}"
        )
    seq_len, num_blocks, top_k = BREAK_EVEN_SHAPE
    pairs = visible_pairs(seq_len, num_blocks, rate)
    print()
    for chip in chip_names:
        per_pair = totals[(seq_len, num_blocks, top_k, chip, "dense")] / pairs
        per_slot = totals[(seq_len, num_blocks, top_k, chip, "sparse")] / (seq_len * top_k)
        print(f"Break-even on {chip} (from S, W, top_k = {seq_len}, {num_blocks}, {top_k}): the sparse gradient is "
              f"the cheaper one from W / top_k ~ {2 * per_slot / per_pair:.0f} "
              f"({per_slot * 1e9:.2f} ns a slot, {per_pair * 1e9:.3f} ns a visible pair)")  # fmt: skip


if __name__ == "__main__":
    main()
