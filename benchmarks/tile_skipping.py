"""The work the kernels skip for causal CSA: DMA tiles, and compute blocks inside them.

Uses the generated runtime's own ranges and classification (``tile_ranges``, ``block_kind``: what
its kernels receive as scalar prefetch and test each compute block by), so the numbers are the
kernels' behaviour, not a model of it. Every (q block, compute block) pair is empty (no matmul, no
elementwise op), full (work, no mask) or partial (work, masked); a DMA tile with no work is never
fetched. MXU work is proportional to the pairs with work, in every kernel alike.

    python benchmarks/tile_skipping.py [--variant NAME] [--seq-len S] [--blocks W]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from generated.csa_v4 import COMPRESS_RATE, VARIANTS, block_kind, causal_kv_range, tile_ranges

DEFAULT_VARIANTS = ("tpu_hm_bf16_q128_w1024_hc16", "tpu_hm_bf16_q16_w128_hc16")  # production, small tiling


def causal_block_kinds(module, seq_len: int, num_blocks: int) -> dict[str, int]:
    """Counts of one causal sequence of ``seq_len`` queries: DMA tiles (all, with work) and
    (q block, compute block) pairs by kind."""
    kv_start, kv_end = causal_kv_range(jnp.arange(seq_len)[None], COMPRESS_RATE)
    block_q, block_w = module.tiles(seq_len, num_blocks)
    compute_w = module.COMPUTE_W
    seq_pad = -(-seq_len // block_q) * block_q
    blocks_pad = -(-num_blocks // block_w) * block_w
    kv_start, kv_end = (
        jnp.pad(jnp.clip(x, 0, num_blocks), ((0, 0), (0, seq_pad - seq_len))) for x in (kv_start, kv_end)
    )
    ranges = tile_ranges(kv_start, kv_end, block_q, block_w, blocks_pad // block_w)
    bounds = [np.asarray(x)[:, None] for x in (ranges.any_lo, ranges.any_hi, ranges.all_lo, ranges.all_hi)]
    lo = np.arange(0, blocks_pad, compute_w)[None]
    empty, full = (np.asarray(x) for x in block_kind(*bounds, lo, lo + compute_w))
    return dict(
        tiles=int(np.asarray(ranges.w_lo).size * (blocks_pad // block_w)),
        tiles_with_work=int(np.sum(np.asarray(ranges.w_hi) - np.asarray(ranges.w_lo))),
        empty=int(empty.sum()),
        full=int(full.sum()),
        partial=int((~empty & ~full).sum()),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=2048)
    args = parser.parse_args(argv)
    names = args.variant or list(DEFAULT_VARIANTS)
    print(f"causal CSA, compress rate {COMPRESS_RATE}, S = {args.seq_len}, W = {args.blocks}")
    print(
        f"{'variant':28s} {'q x w / compute':>16s} {'DMA tiles':>9s} {'skipped':>8s} {'pairs':>6s}"
        f" {'empty':>6s} {'full':>6s} {'partial':>7s} {'work skipped':>12s}"
    )
    for name in names:
        module = VARIANTS[name]
        n = causal_block_kinds(module, args.seq_len, args.blocks)
        pairs = n["empty"] + n["full"] + n["partial"]
        tiling = f"{module.BLOCK_Q} x {module.BLOCK_W} / {module.COMPUTE_W}"
        print(
            f"{name:28s} {tiling:>16s} {n['tiles']:9d} {1 - n['tiles_with_work'] / n['tiles']:8.1%} {pairs:6d}"
            f" {n['empty']:6d} {n['full']:6d} {n['partial']:7d} {n['empty'] / pairs:12.1%}"
        )
    print("Every kernel (forward, dq/dweights, dk) skips the same tiles and compute blocks; MXU and")
    print(
        "per-head elementwise work is skipped in proportion to the empty pairs, masks are built in partial ones."
    )


if __name__ == "__main__":
    main()
