"""A prototype of ``sparse_score`` for selections neighbouring queries share (issue 42), forward and
backward, timed on a TPU against the dense score: not part of the generated kernels.

Forward, per q tile of ``T`` queries: one dense window of ``wd`` compressed blocks ending at the tile's
largest selected block (its start a multiple of 16), every head stacked into one matmul a piece; each
query's slots outside the window (its "stragglers", at most ``NS``) gathered row by row from k resident
in VMEM, all of them before the matmuls that contract them ``G`` queries a matmul (only its diagonal
used); then each slot's score taken out of [window scores | straggler scores] by a lane gather
(``jnp.take_along_axis`` on 128 lanes, which Mosaic lowers to ``tpu.dynamic_gather``; a source of more
than one vreg along lanes does not lower, so a slot's chunk is selected among the 128-lane chunks).
XLA prepares, per tile, the window's start and, per slot, its column; it compacts each query's
stragglers (a cumulative count, then a sort or a sum per place).

Backward (a custom VJP), per tile: the window's cotangent [T, wd] sums each slot's into its column (a
compare of each column with the tile's slots laid along sublanes); the window then runs as the dense
backward does (logits again, u = the opened cotangent by k, dk by q: dq = w * u, dweights = sum_d q * u);
a straggler's cotangent is a lane gather from its slot, its rows' dk contracted 128 rows a matmul and
added to dk (resident in VMEM) 16 distinct rows at a time.

    python benchmarks/sparse_window.py --check   # CPU, interpret mode: against a gather and einsums
    python benchmarks/sparse_window.py           # TPU: the shared selection of `codegen bench`

On a TPU v5e (JAX 0.10.2), B 1, H 64, D 128, causal, the shared selection (``bench.shared_selection``:
each query's last top_k - 16 visible blocks and 16 others; at most 16 stragglers a query), bf16, ms
(measured; dense: ``tpu_sm_bf16_q256_w2048c512f256_hc16`` in the same run):

    S 8192, W 2048, top_k 128, window 128:  dense forward 0.865, forward + gradient 4.831;
        prototype forward 0.726 (0.84 x), forward + gradient 2.815 (0.58 x); its kernels 0.425 and 1.839
    S 16384, W 8192, top_k 512, window 512:  dense 3.983 and 23.920;
        prototype 2.287 (0.57 x) and 11.663 (0.49 x); its kernels 1.399 and 8.164

Scores agree with the reference to the bit; dq, dk and dweights within 3.5e-3 of the largest magnitude
of a float32 reference, except dq at S 16384 (2.3e-2: a relu gate at a logit within float32 rounding
of 0 opens in one summation order and not the other, moving a whole term; ``_relative_norm``).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from codegen.bench import median_ms, shared_selection, with_gradient

T = 64  # queries a grid step
NS = 16  # straggler slots a query
G = 8  # queries a straggler matmul: G * NS = 128 lanes
PIECE = 256  # window columns a matmul, at most


def prepare(idx, num_blocks, wd, compact="sort"):
    """(window start per tile, int32 [B * S / T]; each slot's column in [window | stragglers], int32
    [B, S, top_k]; each query's stragglers compacted, NS a query, rows of its window where fewer, flat
    int32; the most stragglers of any query: more than NS is not supported by the prototype; each
    query's stragglers' slots, int32 [B, S, NS], -1 where fewer).

    ``compact``: "sort", a cumulative count and a sort per query, or "one-hot", the count as a matmul
    against a triangle of ones (0/1 in bfloat16 summed in float32: exact) and the compaction as a sum
    over the slots per straggler place (elementwise work, no sort). On a v5e the whole preparation took
    0.37 ms sorted and 0.59 one-hot at S 8192 / top_k 128, 2.40 and 1.32 at S 16384 / top_k 512."""

    batch, seq_len, top_k = idx.shape
    tiles = seq_len // T
    valid = idx >= 0
    hi = jnp.max(jnp.where(valid, idx + 1, 0).reshape(batch, tiles, T * top_k), axis=2)
    lo = jnp.clip((hi - wd) // 16 * 16, 0, num_blocks - wd)
    lo_q = jnp.repeat(lo, T, axis=1)[:, :, None]
    in_window = valid & (idx >= lo_q) & (idx < lo_q + wd)
    straggler = valid & ~in_window
    if compact == "sort":
        rank = jnp.cumsum(straggler, axis=2, dtype=jnp.int32) - 1
    else:
        triangle = jnp.triu(jnp.ones((top_k, top_k), jnp.bfloat16))  # [j', j]: j' <= j
        counts = jnp.einsum(
            "bsk,kj->bsj", straggler.astype(jnp.bfloat16), triangle, preferred_element_type=jnp.float32
        )
        rank = counts.astype(jnp.int32) - 1
    in_group = (jnp.arange(seq_len, dtype=jnp.int32) % G)[None, :, None]
    column = jnp.where(in_window, idx - lo_q, jnp.where(straggler, wd + in_group * NS + rank, 0))
    slot = jnp.broadcast_to(jnp.arange(top_k, dtype=jnp.int32), idx.shape)
    if compact == "sort":
        key = jnp.where(straggler, rank, top_k + slot)
        _, rows, slots = jax.lax.sort((key, jnp.where(straggler, idx, 0), slot), dimension=2, num_keys=1)
        rows, slots = rows[:, :, :NS], slots[:, :, :NS]
    else:
        place = straggler[..., None] & (rank[..., None] == jnp.arange(NS, dtype=jnp.int32))  # [B, S, K, NS]
        rows = jnp.sum(jnp.where(place, idx[..., None], 0), axis=2, dtype=jnp.int32)
        slots = jnp.sum(jnp.where(place, slot[..., None], 0), axis=2, dtype=jnp.int32)
    count = jnp.sum(straggler, axis=2, dtype=jnp.int32)
    # a query's places past its stragglers name rows of its window, distinct from each other and from
    # its stragglers (which lie outside the window): the backward adds their (zero) dk in one batch
    place = jnp.arange(NS, dtype=jnp.int32)
    rows = jnp.where(place < count[..., None], rows, lo_q + place)
    slots = jnp.where(place < count[..., None], slots, -1)
    most = jnp.max(count)
    return lo.reshape(-1).astype(jnp.int32), column.astype(jnp.int32), rows.reshape(-1), most, slots


def _gather_stragglers(rows_ref, k_ref, gathered_ref):
    """Copies the tile's T * NS straggler rows of k into ``gathered_ref``, one row a copy, all of them
    before any matmul reads them (a loop per group of G queries, each followed by its matmul, took
    0.89 ms at S 8192 where this takes 0.49, window and extraction left out)."""

    def gather(r, carry):
        for u in range(16):
            row = rows_ref[r * 16 + u]
            gathered_ref[pl.ds(r * 16 + u, 1), :] = k_ref[pl.ds(row, 1), :]
        return carry

    jax.lax.fori_loop(0, T * NS // 16, gather, 0)


def _tile(q_ref, w_ref):
    """The tile's q with every head stacked along rows [T * H, D], and its weights [T, H, 1] float32."""

    _, heads, head_dim = q_ref.shape
    return q_ref[...].reshape(T * heads, head_dim), w_ref[...].astype(jnp.float32)[:, :, None]


CONTRACT_LAST = (((1,), (1,)), ((), ()))  # a [m, D] . b [n, D] -> [m, n]
CONTRACT_FIRST = (((0,), (0,)), ((), ()))  # a [n, m] . b [n, p] -> [m, p]


def _window_logits(stacked, k_ref, at, heads):
    """The keys of window piece ``at`` (bfloat16) and every head's logits against them, [T, H, piece]."""
    keys = k_ref[at, :].astype(jnp.bfloat16)
    logits = jax.lax.dot_general(stacked, keys, CONTRACT_LAST, preferred_element_type=jnp.float32)
    return keys, logits.reshape(T, heads, keys.shape[0])


def _group_logits(stacked, gathered_ref, g, heads):
    """Straggler group ``g``: its G queries' stacked q [G * H, D], their gathered rows (bfloat16,
    [G * NS, D]) and every head's logits against all of them, [G, H, G * NS] (a query's own at lanes
    (s % G) * NS onwards)."""
    queries = stacked[g * G * heads : (g + 1) * G * heads]
    rows = gathered_ref[g * G * NS : (g + 1) * G * NS, :].astype(jnp.bfloat16)
    logits = jax.lax.dot_general(queries, rows, CONTRACT_LAST, preferred_element_type=jnp.float32)
    return queries, rows, logits.reshape(G, heads, G * NS)


def _kernel(lo_ref, rows_ref, q_ref, k_ref, w_ref, column_ref, out_ref, gathered_ref, *, wd, scale):
    """The scores of one q tile's slots [T, top_k]: the window's and the stragglers' scores, then each
    slot's taken out of them (``_lane_take``)."""

    b, i = pl.program_id(0), pl.program_id(1)
    lo = pl.multiple_of(lo_ref[b * pl.num_programs(1) + i], 16)
    heads = q_ref.shape[1]
    _gather_stragglers(rows_ref, k_ref, gathered_ref)
    stacked, weights = _tile(q_ref, w_ref)
    chunks = []  # [T, 128] float32 scores: the window's, then the stragglers'
    piece = min(PIECE, wd)
    for p in range(wd // piece):
        _, logits = _window_logits(stacked, k_ref, pl.ds(lo + p * piece, piece), heads)
        scores = jnp.sum(jnp.maximum(logits, 0.0) * weights, axis=1)
        chunks += [scores[:, c * 128 : (c + 1) * 128] for c in range(piece // 128)]
    groups = []
    for g in range(T // G):
        _, _, logits = _group_logits(stacked, gathered_ref, g, heads)
        groups.append(jnp.sum(jnp.maximum(logits, 0.0) * weights[g * G : (g + 1) * G], axis=1))
    chunks.append(jnp.concatenate(groups, axis=0))
    out_ref[...] = scale * _lane_take(chunks, column_ref[...])


def _lane_take(chunks, column):
    """``[T, n]`` float32: at each (row, slot), column ``column`` of the 128-lane ``chunks`` laid side by
    side: a lane gather per chunk, the slot's chunk selected (a gather across more than one vreg does not
    lower)."""

    chunk, lane = column >> 7, column & 127
    out = jnp.zeros(column.shape, jnp.float32)
    for c, values in enumerate(chunks):
        got = jnp.take_along_axis(values, lane, axis=1, mode="promise_in_bounds")
        out = jnp.where(chunk == c, got, out)
    return out


def _grad_kernel(
    lo_ref, rows_ref, q_ref, k_ref, w_ref, column_t_ref, g_t_ref, g_ref, slots_ref,  # inputs
    dq_ref, dw_ref, dk_ref,  # outputs
    gathered_ref, drows_ref, window_g_ref, u_ref,  # scratch
    *, wd,
):  # fmt: skip
    """dq, dweights of one q tile and its adds to dk (resident over the tiles of a batch element), from
    the cotangent of its slots (scale folded in, 0 at empty slots).

    The window's cotangent [T, wd] sums each slot's into its column: for each column a compare over the
    tile's slots laid along sublanes ([top_k / 2, 2 * T]: a column a scalar compared with all of them);
    then the window runs as the dense backward does (logits again, u = the opened cotangent by k, dk by
    q). A straggler's cotangent is a lane gather from its slot; its u is summed with the window's, its
    rows' dk contracted 128 rows a group, then added to dk 16 distinct rows at a time. dq = w * u and
    dweights = sum_d q * u, once."""

    b, i = pl.program_id(0), pl.program_id(1)
    lo = pl.multiple_of(lo_ref[b * pl.num_programs(1) + i], 16)
    heads = q_ref.shape[1]

    @pl.when(i == 0)
    def _zero():
        dk_ref[...] = jnp.zeros(dk_ref.shape, dk_ref.dtype)

    _gather_stragglers(rows_ref, k_ref, gathered_ref)
    # [top_k / 2, 128]: lane h * T + s holds slot h * top_k / 2 + sublane of query s; -1 and 0 outside
    # the window
    column_t, g_t = column_t_ref[...], g_t_ref[...]

    def window_column(c, carry):
        window_g_ref[pl.ds(c, 1), :] = jnp.sum(jnp.where(column_t == c, g_t, 0.0), axis=0, keepdims=True)
        return carry

    jax.lax.fori_loop(0, wd, window_column, 0, unroll=8)
    halves = window_g_ref[...].T  # [2 * T, wd]
    window_g = halves[:T] + halves[T:]  # [T, wd]
    stacked, weights = _tile(q_ref, w_ref)
    # u = (the cotangent where the logit is positive) by k, summed over the window and the stragglers:
    # dq = w * u and dweights = sum_d q * u (relu(x) g = relu'(x) g x), so no head's sum along lanes
    piece = min(PIECE, wd)
    for p in range(wd // piece):
        at = pl.ds(lo + p * piece, piece)
        keys, logits = _window_logits(stacked, k_ref, at, heads)
        g = window_g[:, None, p * piece : (p + 1) * piece]
        opened = jnp.where(logits > 0, g, 0.0)
        u = jnp.dot(
            opened.reshape(T * heads, piece).astype(jnp.bfloat16), keys, preferred_element_type=jnp.float32
        )
        if p == 0:
            u_ref[...] = u
        else:
            u_ref[...] += u
        dlogits = (opened * weights).reshape(T * heads, piece).astype(jnp.bfloat16)
        dk_ref[at, :] += jax.lax.dot_general(
            dlogits, stacked, CONTRACT_FIRST, preferred_element_type=jnp.float32
        )
    g_all = g_ref[...]  # [T, top_k]
    spread = _spread(slots_ref[...])
    chunks = [g_all[:, c * 128 : (c + 1) * 128] for c in range(g_all.shape[1] // 128)]
    straggler_g = jnp.where(spread >= 0, _lane_take(chunks, jnp.maximum(spread, 0)), 0.0)  # [T, G * NS]
    for g in range(T // G):
        queries, rows, logits = _group_logits(stacked, gathered_ref, g, heads)
        opened = jnp.where(logits > 0, straggler_g[g * G : (g + 1) * G, None, :], 0.0)
        u_ref[g * G * heads : (g + 1) * G * heads, :] += jnp.dot(
            opened.reshape(G * heads, G * NS).astype(jnp.bfloat16), rows, preferred_element_type=jnp.float32
        )
        dlogits = (opened * weights[g * G : (g + 1) * G]).reshape(G * heads, G * NS).astype(jnp.bfloat16)
        drows_ref[g * G * NS : (g + 1) * G * NS, :] = jax.lax.dot_general(
            dlogits, queries, CONTRACT_FIRST, preferred_element_type=jnp.float32
        )

    def scatter(r, carry):  # a query's 16 rows are distinct: all read, then all written
        rows = [pl.ds(rows_ref[r * 16 + u], 1) for u in range(16)]
        sums = [dk_ref[row, :] + drows_ref[pl.ds(r * 16 + u, 1), :] for u, row in enumerate(rows)]
        for row, total in zip(rows, sums):
            dk_ref[row, :] = total
        return carry

    jax.lax.fori_loop(0, T * NS // 16, scatter, 0)
    u = u_ref[...]
    dq_ref[...] = (u.reshape(T, heads, -1) * weights).astype(dq_ref.dtype)
    # the sum along d as a sum along sublanes of the transpose: [1, T * H], (query, head) along lanes
    dw_ref[...] = jnp.sum((stacked.astype(jnp.float32) * u).T, axis=0, keepdims=True)


def _spread(slots):
    """Each query's straggler slots [T, NS] (-1 where none) as its straggler scores lie: query s's r-th at
    lane (s % G) * NS + r of a [T, G * NS] row, -1 at the other lanes. The copy along lanes is the MXU's,
    a one-hot matmul in float32 at HIGHEST, exact: on the chip, copying the slot ids' high and low bytes
    (each exact in bfloat16) instead gave the same gradients to the last digit printed at top_k 512."""
    shape = (T, G * NS)
    copy = jax.lax.broadcasted_iota(jnp.int32, (NS, G * NS), 1) % NS == jax.lax.broadcasted_iota(
        jnp.int32, (NS, G * NS), 0
    )
    tiled = jnp.dot(slots.astype(jnp.float32), copy.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    lane, row = jax.lax.broadcasted_iota(jnp.int32, shape, 1), jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return jnp.where(lane // NS == row % G, tiled.astype(jnp.int32), -1)


def _params(interpret):

    return dict(
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=100 * 2**20
        ),
        interpret=interpret,
    )


def window_scores(q, k32, weights, lo, column, rows, wd, scale, interpret=False):
    """The prototype's forward pallas_call: q [B, S, H, D] bf16, k32 [B, W, D] float32 (resident)."""

    batch, seq_len, heads, head_dim = q.shape
    top_k, num_blocks, tiles = column.shape[2], k32.shape[1], seq_len // T
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, tiles),
        in_specs=[
            pl.BlockSpec((T * NS,), lambda b, i, lo: (b * tiles + i,), memory_space=pltpu.SMEM),
            pl.BlockSpec((None, T, heads, head_dim), lambda b, i, lo: (b, i, 0, 0)),
            pl.BlockSpec(
                (None, num_blocks, head_dim), lambda b, i, lo: (b, 0, 0), pipeline_mode=pl.Buffered(1)
            ),
            pl.BlockSpec((None, T, heads), lambda b, i, lo: (b, i, 0)),
            pl.BlockSpec((None, T, top_k), lambda b, i, lo: (b, i, 0)),
        ],
        out_specs=pl.BlockSpec((None, T, top_k), lambda b, i, lo: (b, i, 0)),
        scratch_shapes=[pltpu.VMEM((T * NS, head_dim), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_kernel, wd=wd, scale=scale),
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((batch, seq_len, top_k), jnp.float32),
        **_params(interpret),
    )(lo, rows, q, k32, weights, column)


def window_grads(q, k32, weights, lo, column, rows, slots, g, wd, interpret=False):
    """The prototype's backward pallas_call: (dq like q, dweights float32 [B, S, H], dk float32 [B, W, D])
    from ``g``, the slots' cotangent times the scale, 0 at empty slots."""

    batch, seq_len, heads, head_dim = q.shape
    top_k, num_blocks, tiles = column.shape[2], k32.shape[1], seq_len // T

    def by_tile(x):  # [B, S, top_k] -> [B, tiles, top_k / 2, 2 * T]: the tile's slots along sublanes
        x = x.reshape(batch, tiles, T, 2, top_k // 2).transpose(0, 1, 4, 3, 2)
        return x.reshape(batch, tiles, top_k // 2, 2 * T)

    in_window = (column < wd) & (g != 0)
    column_t = by_tile(jnp.where(in_window, column, -1))
    g_t = by_tile(jnp.where(in_window, g, 0.0))
    tile = lambda *shape: pl.BlockSpec((None, T) + shape, lambda b, i, lo: (b, i) + (0,) * len(shape))
    transposed = pl.BlockSpec((None, None, top_k // 2, 2 * T), lambda b, i, lo: (b, i, 0, 0))
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, tiles),
        in_specs=[
            pl.BlockSpec((T * NS,), lambda b, i, lo: (b * tiles + i,), memory_space=pltpu.SMEM),
            tile(heads, head_dim),
            pl.BlockSpec(
                (None, num_blocks, head_dim), lambda b, i, lo: (b, 0, 0), pipeline_mode=pl.Buffered(1)
            ),
            tile(heads),
            transposed,
            transposed,
            tile(top_k),
            tile(NS),
        ],
        out_specs=[
            tile(heads, head_dim),
            pl.BlockSpec((None, 1, T * heads), lambda b, i, lo: (b, 0, i)),
            pl.BlockSpec((None, num_blocks, head_dim), lambda b, i, lo: (b, 0, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((T * NS, head_dim), jnp.float32),
            pltpu.VMEM((T * NS, head_dim), jnp.float32),
            pltpu.VMEM((wd, 128), jnp.float32),
            pltpu.VMEM((T * heads, head_dim), jnp.float32),
        ],
    )
    dq, dw, dk = pl.pallas_call(
        functools.partial(_grad_kernel, wd=wd),
        grid_spec=spec,
        out_shape=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, 1, seq_len * heads), jnp.float32),
            jax.ShapeDtypeStruct(k32.shape, jnp.float32),
        ),
        **_params(interpret),
    )(lo, rows, q, k32, weights, column_t, g_t, g, slots)
    return dq, dw.reshape(batch, seq_len, heads), dk


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def sparse_forward(q, k, weights, idx, wd, scale, interpret=False, compact="one-hot"):
    """The prototype's sparse score, -inf at empty slots, differentiable in q, k and weights."""
    return _forward(q, k, weights, idx, wd, scale, interpret, compact)[0]


def _forward(q, k, weights, idx, wd, scale, interpret, compact):

    k32 = k.astype(jnp.float32)
    lo, column, rows, _, slots = prepare(idx, k.shape[1], wd, compact)
    out = window_scores(q, k32, weights, lo, column, rows, wd, scale, interpret)
    residuals = (q, k32, weights, idx, lo, column, rows, slots, jnp.zeros((), k.dtype))
    return jnp.where(idx >= 0, out, -jnp.inf), residuals


def _backward(wd, scale, interpret, compact, residuals, cotangent):

    q, k32, weights, idx, lo, column, rows, slots, k_like = residuals
    g = jnp.where(idx >= 0, cotangent, 0.0) * scale
    dq, dw, dk = window_grads(q, k32, weights, lo, column, rows, slots, g, wd, interpret)
    return dq, dk.astype(k_like.dtype), dw.astype(weights.dtype), None


sparse_forward.defvjp(
    lambda q, k, w, idx, wd, scale, interpret, compact: _forward(q, k, w, idx, wd, scale, interpret, compact),
    _backward,
)


def reference(q, k, weights, idx, scale):
    """The same scores from a gather and two einsums, in float32."""

    rows = jnp.take_along_axis(k[:, None], jnp.maximum(idx, 0)[..., None], axis=2)  # [B, S, top_k, D]
    logits = jnp.einsum(
        "bshd,bskd->bshk", q.astype(jnp.float32), rows.astype(jnp.float32), precision="highest"
    )
    w = weights.astype(jnp.float32)
    scores = scale * jnp.einsum("bsh,bshk->bsk", w, jnp.maximum(logits, 0.0), precision="highest")
    return jnp.where(idx >= 0, scores, -jnp.inf)


def shared_indices(seq_len, top_k, rng):
    """``bench.shared_selection`` of the causal bounds (rate 4), its slots in a random order."""

    end = (np.arange(seq_len) + 1) // 4
    chosen = shared_selection(np.zeros((1, seq_len), np.int64), end[None], top_k)
    return np.take_along_axis(
        chosen, rng.permuted(np.tile(np.arange(top_k), (1, seq_len, 1)), axis=2), axis=2
    )


def _reference_in_chunks(q, k, weights, cotangent, idx, scale, chunk=2048):
    """``reference`` and its VJP in float32, ``chunk`` queries at a time (its gathered rows are
    [B, S, top_k, D] float32; the dk of each chunk summed). float32 copies of the inputs: XLA's gradient
    of a bfloat16 gather sums its rows in bfloat16 (5% off on the CPU)."""

    program = jax.jit(with_gradient(reference))
    q, k, weights = (x.astype(jnp.float32) for x in (q, k, weights))
    outs, dqs, dws, dk = [], [], [], 0.0
    for at in range(0, q.shape[1], chunk):
        part = slice(at, at + chunk)
        out, (dq, dk_part, dw) = program(
            q[:, part], k, weights[:, part], cotangent[:, part], idx[:, part], scale
        )
        outs.append(out), dqs.append(dq), dws.append(dw)
        dk = dk + dk_part
    return jnp.concatenate(outs, 1), (jnp.concatenate(dqs, 1), dk, jnp.concatenate(dws, 1))


def _relative(got, want):
    """The largest error relative to the largest magnitude."""
    return float(
        np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))) / np.max(np.abs(want))
    )


def _relative_norm(got, want):
    """The error's norm relative to the reference's. dq's largest error is not a measure: a relu's gate at
    a logit within float32 rounding of 0 opens in one summation order and not in another, which moves a
    whole slot's term of dq (at S 4096, H 64, top_k 512 in interpret mode: a logit of 2.7e-7, an error of
    1.4e-2 of dq's largest magnitude, against 2.7e-3 at H 2)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="CPU, interpret mode, a small shape")
    args = parser.parse_args(argv)

    if not args.check and jax.devices()[0].platform != "tpu":
        print(
            "sparse_window times the prototype on a TPU; this machine has none (see --check)", file=sys.stderr
        )
        return 2
    shapes = (
        [(1024, 256, 128, 128, 4)]
        if args.check
        else [(8192, 2048, 128, 128, 64), (16384, 8192, 512, 512, 64)]
    )
    for seq_len, num_blocks, top_k, wd, heads in shapes:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((1, seq_len, heads, 128)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((1, num_blocks, 128)), jnp.bfloat16)
        weights = jnp.asarray(rng.standard_normal((1, seq_len, heads)), jnp.bfloat16)
        cotangent = jnp.asarray(rng.standard_normal((1, seq_len, top_k)), jnp.float32)
        idx = jnp.asarray(shared_indices(seq_len, top_k, rng), jnp.int32)
        sort = jax.jit(prepare, static_argnums=(1, 2, 3))(idx, num_blocks, wd, "sort")
        one_hot = jax.jit(prepare, static_argnums=(1, 2, 3))(idx, num_blocks, wd, "one-hot")
        assert all(np.array_equal(a, b) for a, b in zip(sort, one_hot))
        most = int(one_hot[3])
        scale = 128**-0.5
        proto = jax.jit(with_gradient(sparse_forward), static_argnums=(5, 6, 7))
        got, got_grads = proto(q, k, weights, cotangent, idx, wd, scale, args.check)
        # float32 copies: XLA's gradient of a bfloat16 gather sums its rows in bfloat16 (5% off, CPU)
        want, want_grads = _reference_in_chunks(q, k, weights, cotangent, idx, scale)
        seen = np.isfinite(np.asarray(want))
        assert most <= NS and (np.isfinite(np.asarray(got)) == seen).all()
        errors = [_relative(np.asarray(got)[seen], np.asarray(want)[seen])]
        errors += [_relative_norm(a, b) for a, b in zip(got_grads, want_grads)]
        largest = [_relative(a, b) for a, b in zip(got_grads, want_grads)]
        print(f"S {seq_len}, W {num_blocks}, top_k {top_k}, window {wd}: at most {most} stragglers a query, "
              "the score's largest error relative to its largest magnitude, and dq, dk, dweights' error norms "
              "relative to theirs: " + ", ".join(f"{e:.1e}" for e in errors) + "; the gradients' largest "
              "errors: " + ", ".join(f"{e:.1e}" for e in largest), flush=True)  # fmt: skip
        if not (errors[0] < 1e-5 and max(errors[1:]) < 1e-2):
            print("  not within 1e-5 (score) and 1e-2 (gradients)", flush=True)
            if args.check:
                return 1
        if args.check:
            continue
        sys.path.insert(0, "generated")
        import csa_v4

        ks, ke = csa_v4.causal_kv_range(jnp.arange(seq_len, dtype=jnp.int32)[None])
        module = csa_v4.VARIANTS["tpu_sm_bf16_q256_w2048c512f256_hc16"]
        dense = lambda q, k, w, ks, ke: module.score(q, k, w, kv_start=ks, kv_end=ke)
        dense_cotangent = jnp.asarray(rng.standard_normal((1, seq_len, num_blocks)), jnp.float32)
        times = {
            "dense forward (production)": median_ms(jax.jit(dense), (q, k, weights, ks, ke), 10),
            "dense forward + gradient": median_ms(
                jax.jit(with_gradient(dense)), (q, k, weights, dense_cotangent, ks, ke), 5
            ),
        }
        forward = jax.jit(sparse_forward, static_argnums=(4, 5))
        times["prototype forward"] = median_ms(forward, (q, k, weights, idx, wd, scale), 10)
        times["prototype forward + gradient"] = median_ms(
            proto, (q, k, weights, cotangent, idx, wd, scale), 10
        )
        for compact in ("sort", "one-hot"):
            times[f"its preparation, {compact}"] = median_ms(
                jax.jit(prepare, static_argnums=(1, 2, 3)), (idx, num_blocks, wd, compact), 10
            )
        lo, column, rows, _, slots = one_hot
        k32 = k.astype(jnp.float32)
        kernel = jax.jit(window_scores, static_argnums=(6, 7))
        times["its forward kernel"] = median_ms(kernel, (q, k32, weights, lo, column, rows, wd, scale), 10)
        grads = jax.jit(window_grads, static_argnums=(8,))
        times["its backward kernel (with the transposes before it)"] = median_ms(
            grads, (q, k32, weights, lo, column, rows, slots, cotangent, wd), 10
        )
        for what, ms in times.items():
            print(f"  {what}: {ms:.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
