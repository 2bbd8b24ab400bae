"""Dense or sparse backward? The gradient of ``score`` against that of ``sparse_score``, lowered for TPU.

At H = 64, D = 128, B = 1 and (S, W, top_k) = (8192, 2048, 512) and (65536, 16384, 1024), lowers (does not
run: there is no TPU here) ``jax.value_and_grad`` of a loss on the dense ``score`` of the production
variant and of one on its ``sparse_score`` at ``top_k`` random indices, checks which Pallas calls each
program holds, and names the largest array each holds in HBM. Per kernel it
reports the MXU FLOPs executed, the rows gathered (and scattered) one at a time, the DMAs issued and
the HBM bytes moved (from the kernel plan for the dense kernels, from the sparse kernels' blocking for
the sparse ones), and a modelled time on v6e:

    time = max(MXU FLOPs / peak, HBM bytes / bandwidth) + grid steps * STEP_SECONDS + rows * ROW_SECONDS

The two overheads are assumptions, not measurements: ~0.35 us per grid step (Pallas's pipeline
bookkeeping and DMA issue per step), and ROW_SECONDS per row gathered from, or added into, VMEM by the
sparse kernels' serial slot loops (an SMEM index load, a one-row vector load and a one-row store or
add per slot: a few TensorCore cycles even unrolled). The row loops, not the MXU, decide the sparse
time; the break-even ``W / top_k`` printed below scales with ROW_SECONDS.

    python benchmarks/sparse_backward.py [--variant NAME] [--row-ns 2.0]
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

from codegen import chips, cost
from codegen.hlo_audit import analyse
from codegen.pipeline import load_family
from generated.csa_v4 import VARIANTS, _geometry

SHAPES = ((8192, 2048, 512), (65536, 16384, 1024))  # S, W, top_k
HEADS, HEAD_DIM, BATCH = 64, 128, 1
DEFAULT_VARIANT = "tpu_sm_bf16_q256_w1024c512_hc16"
STEP_SECONDS = 0.35e-6
CHIP = "v6e"


def _arrays(variant, seq_len, num_blocks, top_k):
    q_shape = (
        (BATCH, HEADS, seq_len, HEAD_DIM)
        if variant["q_layout"] == "head_major"
        else (BATCH, seq_len, HEADS, HEAD_DIM)
    )
    return (
        jax.ShapeDtypeStruct(q_shape, variant["q_dtype"]),
        jax.ShapeDtypeStruct((BATCH, num_blocks, HEAD_DIM), variant["k_dtype"]),
        jax.ShapeDtypeStruct((BATCH, seq_len, HEADS), variant["weights_dtype"]),
        jax.ShapeDtypeStruct((BATCH, seq_len, top_k), jnp.int32),
    )


def lowered_report(module, seq_len, num_blocks, top_k, sparse):
    """The hlo_audit report of value_and_grad of sum(score) (or of the sparse score) lowered for TPU."""
    q, k, weights, indices = _arrays(module.VARIANT, seq_len, num_blocks, top_k)
    extra = (
        {"k_scale": jax.ShapeDtypeStruct((BATCH, num_blocks), jnp.float32)}
        if module.VARIANT["k_scale"]
        else {}
    )

    def loss(q, k, weights, indices, **extra):
        out = (
            module.sparse_score(q, k, weights, indices, **extra)
            if sparse
            else module.score(q, k, weights, **extra)
        )
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0).astype(jnp.float32))

    step = jax.value_and_grad(loss, argnums=(0, 1, 2))
    lowered = jax.jit(step).trace(q, k, weights, indices, **extra).lower(lowering_platforms=("tpu",))
    return analyse(lowered.compiler_ir("stablehlo"), seq_len * top_k, module.VARIANT["name"])


def dense_rows(module, seq_len, num_blocks):
    """(kernel, MXU FLOPs, rows, DMAs, HBM bytes, grid steps) of the dense gradient's kernels, from the plan."""
    plan = load_family("specs/csa_v4.yaml").plan(module.VARIANT["name"])
    rows = []
    for c in cost.variant_costs(plan, (BATCH, HEADS, seq_len, HEAD_DIM, num_blocks)):
        rows.append((c.kernel, c.mxu_flops, 0, sum(c.fetches.values()), c.hbm_bytes, math.prod(c.grid)))
    return rows


def sparse_rows(module, seq_len, num_blocks, top_k):
    """The same of the sparse gradient's two kernels, from their blocking (see the variant's ``_sparse`` module)."""
    variant = module.VARIANT
    seq_pad = _geometry.round_up(seq_len, _geometry.SPARSE_BLOCK_Q)
    steps = BATCH * seq_pad // _geometry.SPARSE_BLOCK_Q
    rows = []
    for kernel, dtype in (
        ("sparse_forward", module._sparse.SPARSE_GATHER_DTYPE),
        ("sparse_backward", module._sparse.SPARSE_BACKWARD_GATHER_DTYPE),
    ):
        top_k_pad = _geometry.sparse_top_k_pad(top_k, dtype)
        slots = BATCH * seq_pad * top_k_pad
        phase = kernel.removeprefix("sparse_")
        flops = (
            2
            * slots
            * HEADS
            * (module._sparse.SPARSE_WORK[phase] * HEAD_DIM + module._sparse.SPARSE_ROW_DOTS[phase])
        )
        q_bytes = seq_pad * HEADS * HEAD_DIM * jnp.dtype(variant["q_dtype"]).itemsize
        k_bytes = BATCH * num_blocks * HEAD_DIM * jnp.dtype(variant["k_dtype"]).itemsize
        per_query = slots * 4 + BATCH * seq_pad * HEADS * 4  # indices, weights (float32)
        if kernel == "sparse_forward":
            moved = q_bytes + k_bytes + per_query + slots * 4  # + the score rows
            dmas, gathered = 4 * steps + BATCH, slots
        else:
            dq_bytes = seq_pad * HEADS * HEAD_DIM * jnp.dtype(variant["qk_grad_dtype"]).itemsize
            moved = q_bytes + k_bytes + per_query + slots * 4 + dq_bytes + BATCH * seq_pad * HEADS * 4
            moved += BATCH * num_blocks * HEAD_DIM * 4  # the float32 dk, written once per batch element
            dmas, gathered = 6 * steps + 2 * BATCH, 2 * slots  # rows gathered, then dk rows added
        rows.append((kernel, flops, gathered, dmas, moved, steps))
    return rows


def largest_in_hbm(module, seq_len, num_blocks, top_k, sparse):
    """(name, bytes) of the largest array the gradient program holds in HBM: inputs, kernel outputs and
    the cotangent. (What XLA ops of a caller's loss make outside the kernels is the caller's: the
    lowered programs are checked for their Pallas calls only, which is the same on every JAX release.)"""
    variant = module.VARIANT
    item = lambda key: jnp.dtype(variant[key]).itemsize
    q = BATCH * seq_len * HEADS * HEAD_DIM
    arrays = {"q": q * item("q_dtype"), "dq": q * item("qk_grad_dtype")}
    if sparse:
        arrays |= {"indices [S, top_k] int32": BATCH * seq_len * top_k * 4,
                   "score, cotangent [S, top_k] float32": BATCH * seq_len * top_k * 4}  # fmt: skip
    else:
        arrays |= {
            f"score, cotangent [S, W] {variant['out_dtype']}": BATCH
            * seq_len
            * num_blocks
            * item("out_dtype")
        }
    return max(arrays.items(), key=lambda item: item[1])


def seconds(row, chip, row_seconds):
    _, flops, gathered, _, moved, steps = row
    roofline = max(flops / chip.matmul_flops_per_second(2), moved / chip.hbm_bytes_per_second_per_device())
    return roofline + steps * STEP_SECONDS + gathered * row_seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default=DEFAULT_VARIANT)
    parser.add_argument(
        "--row-ns", type=float, default=2.0, help="modelled ns per row gathered or added (default 2)"
    )
    args = parser.parse_args(argv)
    module, chip, row_seconds = VARIANTS[args.variant], chips.get(CHIP), args.row_ns * 1e-9
    print(
        f"`value_and_grad` through `{args.variant}`, H = {HEADS}, D = {HEAD_DIM}, B = {BATCH}, lowered for TPU (not run);"
    )
    print(f"modelled on {CHIP}: {chip.bf16_flops / 1e12:.0f} TFLOP/s bf16, {chip.hbm_bytes_per_second / 1e12:.2f} TB/s HBM, "
          f"{STEP_SECONDS * 1e6:.2f} us per grid step, {args.row_ns:g} ns per row gathered or added\n")  # fmt: skip
    print(
        "| S, W, top_k | route | kernel | MXU GFLOP | rows gathered (+ added) | DMAs | HBM MiB | modelled ms |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    largest = []
    for seq_len, num_blocks, top_k in SHAPES:
        for route, rows, sparse in (
            ("dense", dense_rows(module, seq_len, num_blocks), False),
            ("sparse", sparse_rows(module, seq_len, num_blocks, top_k), True),
        ):
            report = lowered_report(module, seq_len, num_blocks, top_k, sparse)
            names = {
                call.strip('"').removeprefix(module.VARIANT["name"] + "_") for call in report.pallas_calls
            }
            assert names == {r[0] for r in rows}, (route, names)  # the lowered program runs these kernels
            total = 0.0
            for row in rows:
                kernel, flops, gathered, dmas, moved, _ = row
                total += seconds(row, chip, row_seconds)
                print(
                    f"| {seq_len}, {num_blocks}, {top_k} | {route} | {kernel} | {flops / 1e9:,.0f} | {gathered:,} | "
                    f"{dmas:,} | {moved / 2**20:,.0f} | {seconds(row, chip, row_seconds) * 1e3:,.2f} |"
                )
            print(f"| {seq_len}, {num_blocks}, {top_k} | {route} | **gradient** | "
                  f"{sum(r[1] for r in rows) / 1e9:,.0f} | {sum(r[2] for r in rows):,} | {sum(r[3] for r in rows):,} | "
                  f"{sum(r[4] for r in rows) / 2**20:,.0f} | **{total * 1e3:,.2f}** |")  # fmt: skip
            name, held = largest_in_hbm(module, seq_len, num_blocks, top_k, sparse)
            largest.append(f"{seq_len}, {num_blocks}, {top_k} {route}: {name} ({held / 2**20:,.0f} MiB)")
    print("\nLargest array each gradient program holds in HBM:\n")
    for line in largest:
        print(f"- {line}")
    # Per query: dense 7 passes of 2 H D W FLOPs at peak; sparse 3 rows per slot (forward gather,
    # backward gather and add) at ROW_SECONDS. Equal at W / top_k = 3 ROW_SECONDS peak / (14 H D).
    ratio = 3 * row_seconds * chip.matmul_flops_per_second(2) / (14 * HEADS * HEAD_DIM)
    print(
        f"\nBreak-even (row loops against dense MXU work): W / top_k ~ {ratio:.0f} at {args.row_ns:g} ns per row."
    )


if __name__ == "__main__":
    main()
