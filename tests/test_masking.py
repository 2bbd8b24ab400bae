"""Visibility masking: exact placement of masked entries, no gradient through them, tile skipping,
the causal off-by-one, and top-k agreement. Every generated variant, discovered from VARIANTS."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from codegen import cost
from generated.csa_v4 import VARIANTS, _geometry, block_kind, causal_kv_range, tile_ranges
from tests import support
from tests.spec_cases import family

MASKED_SHAPE = (4, 16, 45, 128, 1100)  # B = 4: one visibility pattern per batch element; > 1 tile of W
TOP_K = 8


def _top_k_agrees(name, scores, reference, seen):
    """Rows with > TOP_K visible entries and a clear gap after the k-th: the same top-k set."""
    values = np.asarray(jnp.asarray(scores, jnp.float32))
    expected = np.asarray(reference)
    order = np.argsort(-expected, axis=-1, kind="stable")
    ranked = np.take_along_axis(expected, order, axis=-1)
    with np.errstate(invalid="ignore"):  # -inf - -inf in rows with few visible entries
        gap = ranked[..., TOP_K - 1] - ranked[..., TOP_K]
    clear = (seen > TOP_K) & (gap > 1e-2 * np.abs(ranked[..., :1]).squeeze(-1))
    assert clear.sum() > 10, f"{name}: too few rows without near-ties to test top-k"
    got = np.sort(np.asarray(jax.lax.top_k(jnp.asarray(values), TOP_K)[1]), axis=-1)[clear]
    want = np.sort(order[..., :TOP_K], axis=-1)[clear]
    assert np.array_equal(got, want), f"{name}: top-{TOP_K} differs on {np.any(got != want, -1).sum()} rows"


def _skippable_tiles(kv_start, kv_end, block_q, block_w, num_w_blocks):
    """Brute force of the skipping contract: w tile j of batch b may be skipped by every kernel when it
    lies outside every q block's covering range [min kv_start, max kv_end) of non-empty rows."""
    kv_start, kv_end = np.asarray(kv_start), np.asarray(kv_end)
    batch, seq_len = kv_start.shape
    skippable = np.ones((batch, num_w_blocks), bool)
    for b in range(batch):
        for start in range(0, seq_len, block_q):
            rows = slice(start, start + block_q)
            nonempty = np.clip(kv_end[b, rows], 0, None) > np.clip(kv_start[b, rows], 0, None)
            if not nonempty.any():
                continue
            lo, hi = max(kv_start[b, rows][nonempty].min(), 0), kv_end[b, rows][nonempty].max()
            for j in range(num_w_blocks):
                if j * block_w < hi and lo < (j + 1) * block_w:
                    skippable[b, j] = False
    return skippable


@pytest.mark.chip
def test_masked_forward_top_k_gradients_and_skipped_tiles(module):
    """The masked forward against the reference (masked entries exactly where the reference has them),
    its top-k, and the gradients against the reference VJP with a cotangent that is non-zero on masked
    entries too; the same call twice bitwise identical. The four visibility patterns of ``mask_batch``
    (one per batch element) hold empty rows, full ones and partial ones. With the fused backward, keys
    in compute blocks the kernels must skip (for every q block) are NaN: any matmul on them would leak
    NaN into dq, so finite gradients show those blocks were skipped (and contribute nothing), inside
    DMA tiles that have work too. The reference backward has no blocks to skip: it gets finite keys.

    The forward and the backward run as one compiled program (as a training step runs them), twice."""
    name = module.VARIANT["name"]
    variant = module.VARIANT
    batch, _, seq_len, _, num_blocks = MASKED_SHAPE
    q, k, weights = support.make_inputs(variant, MASKED_SHAPE, seed=23)
    kv_start, kv_end = support.mask_batch(seq_len, num_blocks, seed=24)
    block_q, block_w = module.tiles(seq_len, num_blocks)
    # blocks both passes skip (a tile of one compute block shrinks its width with it)
    compute_w = min(max(module.COMPUTE_W, module.FUSED_COMPUTE_W), block_w)
    skippable = _skippable_tiles(kv_start, kv_end, block_q, compute_w, -(-num_blocks // compute_w))
    assert skippable.any(), "the masks should leave some compute block to skip"
    if compute_w < block_w:  # some skipped compute block lies in a DMA tile that has work
        tiles_with_work = ~_skippable_tiles(kv_start, kv_end, block_q, block_w, -(-num_blocks // block_w))
        assert (
            skippable & np.repeat(tiles_with_work, block_w // compute_w, axis=1)[:, : skippable.shape[1]]
        ).any()
    poisoned = np.repeat(skippable, compute_w, axis=1)[:, :num_blocks]  # [B, W]
    poisoned &= variant["backward"] == "fused"
    k_poisoned = jnp.where(poisoned[..., None], jnp.nan, k).astype(k.dtype)

    cotangent = jax.random.normal(jax.random.PRNGKey(25), (batch, seq_len, num_blocks)).astype(
        variant["out_dtype"]
    )
    program = support.vjp_program(module, kv_start=kv_start, kv_end=kv_end, interpret=support.INTERPRET)
    out, grads = program(q, k_poisoned, weights, cotangent)
    # Determinism: the same call again gives the forward and every gradient bit for bit.
    again_out, again_grads = program(q, k_poisoned, weights, cotangent)
    for first, second in zip((out, *grads), (again_out, *again_grads)):
        assert np.array_equal(support.bits(first), support.bits(second))
    # The reference sees the unpoisoned keys: the poisoned ones are never visible.
    expected_out = support.reference_score(variant, q, k, weights, kv_start=kv_start, kv_end=kv_end)
    ref_grads = support.reference_grads(variant, q, k, weights, cotangent, kv_start=kv_start, kv_end=kv_end)

    support.assert_close(f"{name} score", out, expected_out)
    seen = np.asarray(jnp.sum(jnp.isfinite(expected_out), axis=-1))
    assert (seen == 0).any() and (seen > TOP_K).any()  # the batch holds empty rows and full ones
    _top_k_agrees(name, out, expected_out, seen)
    for arg, grad, ref_grad in zip(("q", "k", "weights"), grads, ref_grads):
        support.assert_close(f"{name} d{arg}", grad, ref_grad)
    assert not np.asarray(grads[1], np.float32)[poisoned].any()  # skipped keys get exactly zero


@pytest.mark.chip
def test_queries_that_see_nothing(module):
    """Causal positions 0..2 with r = 4 see no complete block: all masked, zero gradients, no NaN."""
    variant = module.VARIANT
    q, k, weights = support.make_inputs(variant, (1, 16, 3, 64, 2), seed=26)
    kv_start, kv_end = causal_kv_range(jnp.arange(3)[None], 4)
    program = support.vjp_program(module, kv_start=kv_start, kv_end=kv_end, interpret=support.INTERPRET)
    out, grads = program(q, k, weights, jnp.ones((1, 3, 2), variant["out_dtype"]))
    assert np.all(np.isneginf(np.asarray(out, np.float32)))
    grad_dtypes = (variant["qk_grad_dtype"], variant["qk_grad_dtype"], variant["weights_dtype"])
    for grad, dtype in zip(grads, grad_dtypes):
        assert grad.dtype == jnp.dtype(dtype)
        assert not np.asarray(grad, np.float32).any()


def _one_per_tiling(seq_len, num_blocks):
    """One variant per distinct (block_q, block_w, compute_w, fused_compute_w) at this problem size:
    ``tile_ranges`` and ``block_kind`` are the shared runtime's, and depend on nothing else of a variant."""
    chosen = {}
    for name in sorted(VARIANTS):
        module = VARIANTS[name]
        chosen.setdefault(
            (*module.tiles(seq_len, num_blocks), module.COMPUTE_W, module.FUSED_COMPUTE_W), name
        )
    return sorted(chosen.values())


@pytest.mark.parametrize("name", _one_per_tiling(300, 2500))
def test_tile_ranges_match_brute_force(name):
    """The scalar-prefetch ranges are exactly the tiles the contract allows: tight, never short."""
    module = VARIANTS[name]
    seq_len, num_blocks = 300, 2500
    kv_start, kv_end = support.mask_batch(seq_len, num_blocks, seed=27)
    block_q, block_w = module.tiles(seq_len, num_blocks)
    seq_pad = -(-seq_len // block_q) * block_q
    num_w_blocks = -(-num_blocks // block_w)
    pad = lambda x: jnp.pad(jnp.clip(x, 0, num_blocks), ((0, 0), (0, seq_pad - seq_len)))
    ranges = tile_ranges(pad(kv_start), pad(kv_end), block_q, block_w, num_w_blocks)
    batch = kv_start.shape[0]
    w_lo, w_hi = (np.asarray(x).reshape(batch, -1) for x in (ranges.w_lo, ranges.w_hi))
    q_lo, q_hi = (np.asarray(x).reshape(batch, -1) for x in (ranges.q_lo, ranges.q_hi))
    skippable = _skippable_tiles(kv_start, kv_end, block_q, block_w, num_w_blocks)
    blocks = np.arange(num_w_blocks)
    active = (w_lo[..., None] <= blocks) & (blocks < w_hi[..., None])  # [B, q blocks, w blocks]
    assert np.array_equal(~active.any(axis=1), skippable)
    for b, j in zip(*np.nonzero(active.any(axis=1))):
        rows = np.nonzero(active[b, :, j])[0]
        assert (q_lo[b, j], q_hi[b, j]) == (rows.min(), rows.max() + 1)


class _Visibility(NamedTuple):
    kv_start: jax.Array
    kv_end: jax.Array
    seq_len: int
    num_blocks: int
    block_q: int
    block_w: int
    compute_w: int
    fused_compute_w: int
    blocks_pad: int
    ranges: object  # the call's tile_ranges
    seen: np.ndarray  # bool [B, S_pad, W_pad]: query s may see compressed block w


def _visibility(name, causal, seed, seq_len=300, num_blocks=700):
    """A call of variant ``name`` at S x W under causal CSA or random ranges (``seed``): its tiling
    (a tile of one compute block shrinks its compute widths with it), its scalar-prefetch ranges, and
    the [S, W] visibility matrix, padded as the kernels pad."""
    module = VARIANTS[name]
    if causal:
        kv_start, kv_end = causal_kv_range(jnp.arange(4 * seq_len, step=4)[None] + 3, 4)
    else:
        kv_start, kv_end = support.mask_batch(seq_len, num_blocks, seed=seed)
    block_q, block_w = module.tiles(seq_len, num_blocks)
    seq_pad, blocks_pad = -(-seq_len // block_q) * block_q, -(-num_blocks // block_w) * block_w
    pad = lambda x: jnp.pad(jnp.clip(x, 0, num_blocks), ((0, 0), (0, seq_pad - seq_len)))
    ranges = tile_ranges(pad(kv_start), pad(kv_end), block_q, block_w, blocks_pad // block_w)
    columns = np.arange(blocks_pad)
    seen = (np.asarray(pad(kv_start))[..., None] <= columns) & (columns < np.asarray(pad(kv_end))[..., None])
    return _Visibility(kv_start, kv_end, seq_len, num_blocks, block_q, block_w, min(module.COMPUTE_W, block_w),
                       min(module.FUSED_COMPUTE_W, block_w), blocks_pad, ranges, seen)  # fmt: skip


@pytest.mark.parametrize("name", _one_per_tiling(300, 700))
@pytest.mark.parametrize("causal", [False, True], ids=["random_ranges", "causal"])
def test_compute_block_kinds_match_brute_force(name, causal):
    """Every (q block, compute block) the kernels call full is fully visible and every one they call
    empty is invisible, against the [S, W] visibility matrix, at each compute width the variant's
    kernels step by; under a causal mask (contiguous ranges) the kernels call empty exactly the
    invisible ones, so no compute block with no work runs."""
    v = _visibility(name, causal, seed=28)
    seq_len, block_q, blocks_pad = v.seq_len, v.block_q, v.blocks_pad
    bounds = [
        np.asarray(x)[:, None] for x in (v.ranges.any_lo, v.ranges.any_hi, v.ranges.all_lo, v.ranges.all_hi)
    ]
    for compute_w in sorted({v.compute_w, v.fused_compute_w}):
        lo = np.arange(0, blocks_pad, compute_w)[None]
        empty, full = (np.asarray(x) for x in block_kind(*bounds, lo, lo + compute_w))
        seen = v.seen.reshape(-1, block_q, blocks_pad // compute_w, compute_w)
        truly_empty, truly_full = ~seen.any(axis=(1, 3)), seen.all(axis=(1, 3))
        assert np.array_equal(full, truly_full), compute_w
        assert not (empty & ~truly_empty).any(), compute_w
        if causal:
            assert np.array_equal(empty, truly_empty), compute_w
            assert (~empty & ~full).any(), compute_w
            assert empty.any() == (blocks_pad > compute_w)  # S = 300 sees up to 300 blocks
            # query s sees s + 1 blocks: a compute block is full for a q block whose first query sees
            # compute_w blocks and which has no padded rows (they see none)
            assert full.any() == any(
                i * block_q + 1 >= compute_w for i in range(seq_len // block_q)
            ), compute_w


@pytest.mark.parametrize("name", _one_per_tiling(300, 700))
@pytest.mark.parametrize("causal", [False, True], ids=["random_ranges", "causal"])
def test_forward_pieces_cover_exactly_the_visible_lane_groups(name, causal):
    """The forward's walk (``visible_pieces``: ``big`` compute-wide pieces from ``start``, then the
    tails ``rest`` names) lays disjoint, lane-aligned pieces inside the tile that cover every column a
    query of the q block sees there, and no lane group past the first and last it sees; the cost
    model's count of covered columns is their sum. Against the [S, W] visibility matrix."""
    v = _visibility(name, causal, seed=29)
    block_w, compute_w, blocks_pad, ranges = v.block_w, v.compute_w, v.blocks_pad, v.ranges
    seen = v.seen.reshape(-1, v.block_q, blocks_pad).any(axis=1)  # [B * q blocks, W]: some query sees it
    total = 0
    for row in range(seen.shape[0]):
        for tile_lo in range(0, blocks_pad, block_w):
            any_lo, any_hi = (int(x[row]) for x in (ranges.any_lo, ranges.any_hi))
            start, big, rest = (
                int(x) for x in _geometry.visible_pieces(any_lo, any_hi, tile_lo, block_w, compute_w)
            )
            pieces = [(start + n * compute_w, compute_w) for n in range(big)]
            at = start + big * compute_w
            for width in _geometry.tail_widths(compute_w):
                if rest & width:
                    pieces.append((at, width))
                    at += width
            covered = np.zeros(block_w, int)
            for at, width in pieces:
                assert at % 128 == 0 and 0 <= at and at + width <= block_w, (row, tile_lo, pieces)
                covered[at : at + width] += 1
            assert covered.max(initial=0) <= 1, (row, tile_lo, pieces)  # disjoint
            visible = seen[row, tile_lo : tile_lo + block_w]
            assert not (visible & (covered == 0)).any(), (row, tile_lo, pieces)
            groups = visible.reshape(-1, 128).any(axis=1)  # lane groups with a visible column
            if groups.any():  # from the first lane group with a visible column to the last
                first, last = np.nonzero(groups)[0][[0, -1]]
                assert covered.sum() == (last - first + 1) * 128, (row, tile_lo, pieces)
            else:
                assert not pieces
            total += covered.sum()
    t = cost.tiling(family().plan(name), (v.kv_start.shape[0], 16, v.seq_len, 64, v.num_blocks))
    assert cost.visible_columns(t, np.asarray(v.kv_start), np.asarray(v.kv_end)) == total


@pytest.mark.parametrize("rate", [4, 128])
def test_causal_kv_range_boundary(rate):
    """Position p sees block w iff the block is complete: (w + 1) * r - 1 <= p. Brute force."""
    positions = jnp.asarray([0, rate - 2, rate - 1, rate, 2 * rate - 1, 5 * rate + 1])
    kv_start, kv_end = causal_kv_range(positions, rate)
    assert np.asarray(kv_end).tolist() == [0, 0, 1, 1, 2, 5]
    for p, end in zip(np.asarray(positions), np.asarray(kv_end)):
        assert end == sum((w + 1) * rate - 1 <= p for w in range(p + 1))
    assert not np.asarray(kv_start).any()


def test_causal_kv_range_packed_segments():
    """A query sees only blocks that start inside its own segment (brute force over blocks)."""
    rate = 4
    positions = np.arange(40)
    segment_starts = np.where(positions < 13, 0, np.where(positions < 30, 13, 30))
    kv_start, kv_end = map(np.asarray, causal_kv_range(positions, rate, segment_starts))
    for p, s0, lo, hi in zip(positions, segment_starts, kv_start, kv_end):
        seen = [w for w in range(20) if w * rate >= s0 and (w + 1) * rate - 1 <= p]
        assert list(range(lo, hi)) == seen, (p, s0)


def test_bad_kv_bounds_raise():
    module = next(m for m in VARIANTS.values() if m.VARIANT["q_layout"] == "seq_major")
    q, k, weights = support.make_inputs(module.VARIANT, (2, 16, 8, 64, 130), seed=0)
    ok = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match=r"^kv_start must be \[B=2, S=8\]"):
        support.call(module, q, k, weights, kv_start=ok[:, :4], kv_end=ok, interpret=True)
    with pytest.raises(ValueError, match=r"^kv_end must be an integer array"):
        support.call(module, q, k, weights, kv_start=ok, kv_end=ok.astype(jnp.float32), interpret=True)


def test_kernels_use_scalar_prefetch(kernels_module):
    """Every pallas_call of the forward and gradient skips tiles through the scalar-prefetched ranges
    its plan names."""
    module = kernels_module
    name = module.VARIANT["name"]
    q, k, weights = support.make_inputs(module.VARIANT, (1, 32, 40, 128, 300), seed=0)

    def loss(q, k, weights):
        return jnp.sum(support.call(module, q, k, weights).astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, weights)
    # the forward, and the backward this W takes
    calls = cost.call_kernels(family().plan(name), (1, 32, 40, 128, 300))
    expected = {kernel.name: len(kernel.scalar_prefetch) for kernel in calls}
    assert (
        min(expected.values()) >= 4
    )  # every kernel finds empty compute blocks by two bounds, skips tiles by two
    found = {
        support.kernel_name(e, name): e.params["grid_mapping"].num_index_operands
        for e in support.pallas_calls(jaxpr.jaxpr)
    }
    assert found == expected


def test_scalar_prefetch_stays_far_below_smem_at_the_largest_context():
    """At 1M tokens (S = 1048576, W = 262144, the largest context docs/design.md claims), the
    production tiling's scalar-prefetch arrays, every kernel's together, fill under a fifth of SMEM's
    1 MiB: no table per (q block, compute block), a few int32 per q block and per w tile."""
    module = VARIANTS["tpu_hm_bf16_q256_w2048c512f256_hc16"]
    seq_len, num_blocks = 2**20, 2**18
    kv_start, kv_end = causal_kv_range(jnp.arange(seq_len)[None], 4)
    block_q, block_w = module.tiles(seq_len, num_blocks)
    ranges = tile_ranges(kv_start, kv_end, block_q, block_w, num_blocks // block_w)
    assert all(x.ndim == 1 and x.dtype == jnp.int32 for x in ranges)  # flat: no (8, 128) SMEM tile padding
    assert sum(x.nbytes for x in ranges) == 4 * (6 * seq_len // block_q + 2 * num_blocks // block_w)
    assert sum(x.nbytes for x in ranges) < 2**20 // 5
