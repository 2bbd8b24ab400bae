"""The work the kernels skip for causal CSA: DMA tiles, and compute blocks inside them.

Counted by the cost model ``codegen explain --causal`` uses (``codegen.cost.causal_kinds``), which
classifies every (q block, compute block) pair with the kernels' own rule (``codegen/shipped/_geometry.py``, the
source of ``_geometry.py`` in every family package) on the causal ranges: empty (no matmul, no elementwise op), full
(work, every query sees it all) or partial (work, some entries masked; both apply the mask); a DMA tile with no work is never fetched. The
backward kernels' MXU work is proportional to the pairs with work; the forward's to the columns its pieces
cover (``_geometry.visible_pieces``: each q block's visible blocks, to whole lane groups).

    python benchmarks/tile_skipping.py [--variant NAME] [--seq-len S] [--blocks W]
"""

from __future__ import annotations

import argparse
import pathlib

from codegen import cost
from codegen.pipeline import load_family

SPEC = pathlib.Path(__file__).resolve().parent.parent / "specs" / "csa_v4.yaml"
DEFAULT_VARIANTS = (
    "tpu_hm_bf16_q256_w2048c512f256_hc16",
    "tpu_hm_bf16_q16_w128_hc16",
)  # production, small tiling


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=2048)
    args = parser.parse_args(argv)
    names = args.variant or list(DEFAULT_VARIANTS)
    family = load_family(SPEC)
    rate, model = family.spec.computation.compress_rate, family.spec.model
    print(f"causal CSA, compress rate {rate}, S = {args.seq_len}, W = {args.blocks}")
    width = max(len(name) for name in names)
    print(
        f"{'variant':{width}s} {'q x w / compute':>16s} {'DMA tiles':>9s} {'skipped':>8s} {'pairs':>6s}"
        f" {'empty':>6s} {'full':>6s} {'partial':>7s} {'work skipped':>12s} {'forward skipped':>15s}"
    )
    for name in names:
        plan = family.plan(name)
        shape = (1, model.num_heads, args.seq_len, model.head_dim, args.blocks)  # H and D change nothing here
        n = cost.causal_kinds(cost.tiling(plan, shape), rate)
        tiling = f"{plan.block_q} x {plan.block_w} / {plan.compute_w}"
        print(
            f"{name:{width}s} {tiling:>16s} {n.tiles:9d} {1 - n.tiles_with_work / n.tiles:8.1%} {n.total:6d}"
            f" {n.empty:6d} {n.full:6d} {n.partial:7d} {n.empty / n.total:12.1%}"
            f" {1 - n.visible_columns / (n.tiles * plan.block_w):15.1%}"
        )
    print(
        "Every kernel skips the same DMA tiles. The backward kernels (dq/dweights, dk, dq_dk) skip the empty"
    )
    print(
        "compute blocks: their MXU and per-head elementwise work is skipped in proportion to the empty pairs."
    )
    print(
        "The forward computes only pieces covering each q block's visible blocks. Every entry computed is masked."
    )


if __name__ == "__main__":
    main()
