"""How much [S, W]-sized work does a training step (``jax.value_and_grad``) of the score do outside the kernels?

Lowers ``jax.value_and_grad`` of ``sum(score(q, k, weights) * cotangent)`` for the TPU at the DeepSeek-V4
production shape (no TPU needed: the Mosaic lowering runs on the CPU) and walks the StableHLO:
every operation outside the Pallas calls whose result has at least S*W elements is listed, its
count multiplied by the trip count of each loop around it; and the largest array the program
holds outside the Pallas calls is reported. Compares the fused backward with the reference one.

    python benchmarks/backward_hlo.py [--variant NAME ...] [--shape B,H,S,D,W]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from codegen.hlo_audit import analyse
from generated.csa_v4 import VARIANTS

DEFAULT_VARIANTS = ("tpu_sm_bf16_q256_w2048c512f256_hc16", "tpu_sm_bf16_q256_w2048c512f256_hc16_refbwd")
PRODUCTION_SHAPE = (1, 64, 8192, 128, 2048)  # B, H, S, D, W


def lower_grad(module, shape):
    batch, heads, seq_len, head_dim, num_blocks = shape
    variant = module.VARIANT
    q_shape = (
        (batch, heads, seq_len, head_dim)
        if variant["q_layout"] == "head_major"
        else (batch, seq_len, heads, head_dim)
    )
    args = (
        jax.ShapeDtypeStruct(q_shape, variant["q_dtype"]),
        jax.ShapeDtypeStruct((batch, num_blocks, head_dim), variant["k_dtype"]),
        jax.ShapeDtypeStruct((batch, seq_len, heads), variant["weights_dtype"]),
        jax.ShapeDtypeStruct((batch, seq_len, num_blocks), variant["out_dtype"]),
    )

    def loss(q, k, weights, cotangent):
        return jnp.sum((module.score(q, k, weights) * cotangent).astype(jnp.float32))

    # value_and_grad, as a training step takes it: the loss needs the forward, so every JAX release
    # keeps the forward kernel in the program (a bare grad lets newer releases drop it).
    step = jax.value_and_grad(loss, argnums=(0, 1, 2))
    lowered = jax.jit(step).trace(*args).lower(lowering_platforms=("tpu",))
    return lowered.compiler_ir("stablehlo")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", help=f"default: {', '.join(DEFAULT_VARIANTS)}")
    parser.add_argument("--shape", default=",".join(map(str, PRODUCTION_SHAPE)), help="B,H,S,D,W")
    args = parser.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    threshold = shape[2] * shape[4]
    print(
        f"jax.value_and_grad of sum(score * cotangent), lowered for TPU at B,H,S,D,W = {shape}; S*W = {threshold:,}"
    )
    for name in args.variant or DEFAULT_VARIANTS:
        module = VARIANTS[name]
        report = analyse(lower_grad(module, shape), threshold, name)
        ours = sum(count for (owner, *_), count in report.big_ops.items() if owner == "score")
        print(f"\n{name} (backward: {module.VARIANT['backward']})")
        print(f"  Pallas calls: {len(report.pallas_calls)} ({', '.join(sorted(set(report.pallas_calls)))})")
        print(f"  loops outside the kernels: {report.loops or 'none'}")
        print(
            f"  ops outside the kernels with >= S*W elements, x loop trips: {ours} in score, "
            f"{sum(report.big_ops.values()) - ours} in the loss"
        )
        for (owner, op, printed), count in sorted(
            report.big_ops.items(), key=lambda item: (item[0][0] != "score", item[0])
        ):
            print(f"    {owner:5s} {count:3d} x {op:28s} {printed}")
        size, printed = report.largest
        print(f"  largest array outside the kernels: {printed} ({size / 2**20:,.0f} MiB)")


if __name__ == "__main__":
    main()
