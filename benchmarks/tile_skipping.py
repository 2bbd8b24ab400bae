"""Fraction of (q block, w block) tiles the kernels skip for causal CSA.

Uses the generated module's own tile-range computation (what its kernels receive as scalar
prefetch), so the numbers are the kernels' behaviour, not a model of it.

    python benchmarks/tile_skipping.py [--variant NAME] [--seq-len S] [--blocks W]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from generated.csa_v4 import COMPRESS_RATE, VARIANTS, causal_kv_range, tile_ranges

DEFAULT_VARIANTS = ("tpu_hm_bf16_q128_w1024_hc16", "tpu_hm_bf16_q16_w128_hc16")  # production, small tiling


def skipped_fraction(module, seq_len: int, num_blocks: int) -> tuple[int, int]:
    """(tiles with work, all tiles) for one causal sequence of ``seq_len`` queries."""
    kv_start, kv_end = causal_kv_range(jnp.arange(seq_len)[None], COMPRESS_RATE)
    block_q, block_w = module.tiles(seq_len, num_blocks)
    seq_pad = -(-seq_len // block_q) * block_q
    num_w_blocks = -(-num_blocks // block_w)
    kv_start, kv_end = (jnp.pad(x, ((0, 0), (0, seq_pad - seq_len))) for x in (kv_start, kv_end))
    w_lo, w_hi, _, _ = tile_ranges(kv_start, kv_end, block_q, block_w, num_w_blocks)
    active = int(np.sum(np.asarray(w_hi) - np.asarray(w_lo)))
    return active, (seq_pad // block_q) * num_w_blocks


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=2048)
    args = parser.parse_args(argv)
    names = args.variant or list(DEFAULT_VARIANTS)
    print(f"causal CSA, compress rate {COMPRESS_RATE}, S = {args.seq_len}, W = {args.blocks}")
    print(f"{'variant':36s} {'block_q x block_w':>18s} {'tiles':>7s} {'with work':>10s} {'skipped':>8s}")
    for name in names:
        module = VARIANTS[name]
        active, total = skipped_fraction(module, args.seq_len, args.blocks)
        tiling = f"{module.VARIANT['block_q']} x {module.VARIANT['block_w']}"
        print(f"{name:36s} {tiling:>18s} {total:7d} {active:10d} {1 - active / total:8.1%}")
    print("Every kernel (forward, dq/dweights, dk) skips the same tiles.")


if __name__ == "__main__":
    main()
