"""Exact top-k of rows held whole in VMEM: one Pallas kernel (``select``) takes a block of 128 rows of
scores, transposed so that a row runs down the sublanes of one lane, and returns each row's top_k
indices in score order, with no sort of W entries and no gather.

Per block, all in VMEM, every step a vreg at a time (eight compressed blocks of the 128 rows):

1. keys: each score's float32 bits as int32 in the scores' total order (``INT_MIN``: not visible);
2. the threshold: the top_k-th largest key, two bits at a time from the top, one counting pass of
   three candidates each (8 passes for bfloat16 scores, whose float32 bits end in 16 zeros; 16
   otherwise); a row's count is a lane's sum, so no pass reduces across lanes;
3. what is kept: the blocks above the threshold and, of those at it, the lowest-indexed (``room`` of
   them); each kept block's shift is its index less the kept blocks before it (running counts down
   the sublanes, eight at a time);
4. compaction by a shift network: bit b of every shift, lowest first, moves a kept block 2^b rows up.
   Taken lowest bit first, two kept blocks never land on one row (a later block's shift exceeds an
   earlier one's by less than the rows between them), so each step is a select per vreg; a bfloat16
   block's key and index share one int32 (``_PACKED_BITS``), else they travel as two. (Two bits a
   step, three selects per vreg from three rows below, was 4% slower on a v5e.) The steps work in
   place: row v is written after rows v and up are read, in increasing v;
5. a bitonic sort of the first ``n`` rows (top_k rounded up to a power of two), highest first, a tie
   to the lower index. Row ``8 v + s`` holds sort position ``s * n / 8 + v``, so every compare-exchange
   at a stride below ``n / 8`` pairs two whole vregs, and only the three widest strides rotate sublanes;
6. the rows' indices and scores written [128 rows, n] (``_put_ranked``: XLU transposes).

The passes run over the vregs holding a block any of the block's rows sees (``spans``), so a causal
call makes them over half its rows on average. The scores come in as [B, W, rows] (``score_topk``'s
forward writes them so; ``select`` transposes any others in XLA).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _geometry, _kernel_ops, _mesh

ROWS = _geometry.LANES  # rows a block: one a lane
SUBLANES = 8  # rows of int32 in a vreg: a step works on [8, 128] at a time
UNROLL = 8  # vregs a loop trip (the loops' bounds are the data's, so trips are unrolled by hand)
COUNT_UNROLL = 16  # vregs a counting trip, summed as a tree
INT_MIN = -(2**31)
# A key's significant top bits: bfloat16 scores' float32 bits end in 16 zeros, so their key and
# their index (W up to 2^16) share one int32 that orders as (key, then the lower index) does.
_PACKED_BITS = 16
# VMEM the kernel may ask for: two or three [W, 128] int32 buffers, and the scores
# double-buffered. A wider row takes ``_topk``'s selection that streams the row from HBM instead.
VMEM_LIMIT_BYTES = 48 * 2**20
# XLA (TPU, JAX 0.10.2) fuses a caller's dynamic-update-slice of the result (``score_topk``'s loop
# stacking its chunks) into the kernel, which then writes its blocks in place (0.3 ms a call at S
# 32768 on a v5e), but grants the fusion only the default scoped VMEM (16 MiB on a v5e), not the
# kernel's limit: a kernel that needs more is kept apart from it by an optimization barrier.
XLA_FUSION_VMEM_BYTES = 16 * 2**20


def geometry(width: int, top_k: int, dtype) -> tuple[int, int, int, bool]:
    """(rows W is padded to, rows sorted n, shift-network steps, packed) for rows of ``width`` scores."""
    padded = _geometry.round_up(width, _geometry.LANES)  # whole count trips
    n = max(SUBLANES * SUBLANES, 1 << max(0, math.ceil(math.log2(min(top_k, padded)))))
    packed = jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and padded <= 2**16
    return padded, n, max(1, math.ceil(math.log2(padded))), packed


def _buffers(padded, n, packed):
    """The kernel's int32 VMEM buffers, (count, rows of ROWS lanes): the packed key and index and the
    shift, or key, shift and index; each as tall as the sorted rows or the outputs, and a vreg more."""
    return (2 if packed else 3), max(padded, n) + SUBLANES


def vmem_bytes(width: int, top_k: int, dtype) -> int:
    """The kernel's VMEM: its two or three buffers, the scores block and the outputs (double-buffered)."""
    padded, n, _, packed = geometry(width, top_k, dtype)
    arrays, height = _buffers(padded, n, packed)
    scratch = arrays * height * ROWS * 4
    return scratch + 2 * (padded + n) * ROWS * jnp.dtype(dtype).itemsize + 2 * n * ROWS * 4


def fits(width: int, top_k: int, dtype) -> bool:
    """Whether rows of ``width`` scores are selected in VMEM here (else streamed by ``_topk``)."""
    return vmem_bytes(width, top_k, dtype) <= VMEM_LIMIT_BYTES


def _rows(v):
    """The eight rows of vreg ``v`` (an int or a traced index)."""
    start = v * SUBLANES
    return pl.ds(start if isinstance(start, int) else pl.multiple_of(start, SUBLANES), SUBLANES)


def _each(lo, hi, body, carry=None, unroll=UNROLL):
    """``carry = body(v, carry)`` for v in [lo, hi), traced bounds, ``unroll`` vregs a trip then the rest
    one at a time (``fori_loop`` unrolls only static bounds)."""
    trips = (hi - lo) // unroll

    def group(j, c):
        for u in range(unroll):
            c = body(lo + j * unroll + u, c)
        return c

    carry = jax.lax.fori_loop(0, trips, group, carry)
    return jax.lax.fori_loop(lo + trips * unroll, hi, body, carry)


def int_keys(x):
    """int32 keys of float32 scores ``x`` in their total order (-0.0 below +0.0), ``INT_MIN`` for a
    non-finite score (masked, NaN, inf: never a visible block), below every other."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(jnp.abs(x) < jnp.inf, jnp.where(b < 0, b ^ 0x7FFFFFFF, b), INT_MIN)


def tree_sum(xs):
    """The arrays ``xs`` summed pairwise, log2 deep (a pass over many vregs is not one long chain)."""
    while len(xs) > 1:
        xs = [a + b for a, b in zip(xs[::2], xs[1::2])] + xs[len(xs) - len(xs) % 2 :]
    return xs[0]


def _counts(ref, lo, hi, predicates):
    """Per lane, how many rows of vregs [lo, hi) of ``ref`` satisfy each of ``predicates``: int32 [1, 128]
    each, from one pass over the rows."""

    def body(j, acc):
        v = lo + j * COUNT_UNROLL
        keys = [ref[_rows(v + u), :] for u in range(COUNT_UNROLL)]
        return tuple(a + tree_sum([p(k).astype(jnp.int32) for k in keys]) for a, p in zip(acc, predicates))

    zero = jnp.zeros((SUBLANES, ROWS), jnp.int32)
    acc = jax.lax.fori_loop(0, (hi - lo) // COUNT_UNROLL, body, (zero,) * len(predicates))
    return [jnp.sum(a, axis=0, keepdims=True) for a in acc]  # lo and hi are whole count trips (``spans``)


def _count(ref, lo, hi, predicate):
    """Per lane, how many rows of vregs [lo, hi) of ``ref`` satisfy ``predicate``: int32 [1, 128]."""
    return _counts(ref, lo, hi, [predicate])[0]


def _kernel(spans_ref, scores_ref, *refs, top_k, bits, packed, n, steps, unrolled):
    """One block of 128 rows (lanes) of W scores (sublanes): the sorted top_k of each, see the module
    docstring. Outputs [128, n]: each row's indices and scores, in score order (``_put_ranked``)."""
    outs, here = refs[:2], refs[2:]  # here: the packed key and index and the shift, or key, shift, index
    # The keys, then the payloads in place of them: a pass reads a row before it writes it, and each
    # network step writes row v after reading rows v and up only (in_place network, see below).
    key_ref = here[0]
    unroll = UNROLL if unrolled else 1  # interpreted, code is compile time: loops, not copies
    block = pl.program_id(0)
    lo, hi = spans_ref[2 * block], spans_ref[2 * block + 1]  # the vregs holding blocks the rows see
    sub = jax.lax.broadcasted_iota(jnp.int32, (SUBLANES, ROWS), 0)
    # an empty row: the lowest payload, no shift (-1), no index
    empty = [jnp.full((SUBLANES, ROWS), INT_MIN, jnp.int32)] + [jnp.full((SUBLANES, ROWS), -1, jnp.int32)] * (
        len(here) - 1
    )

    def to_keys(v, _):
        key_ref[_rows(v), :] = int_keys(scores_ref[_rows(v), :].astype(jnp.float32))
        return _

    _each(lo, hi, to_keys, unroll=unroll)
    wanted = jnp.minimum(_count(key_ref, lo, hi, lambda k: k != INT_MIN), top_k)

    def search(digit, t):  # t: the threshold's bits so far, unsigned order in int32; two more a pass
        low = 30 - 2 * digit
        candidates = [t | jax.lax.shift_left(jnp.int32(m), low) for m in (1, 2, 3)]
        counts = _counts(key_ref, lo, hi, [lambda k, c=c: k >= (c ^ INT_MIN) for c in candidates])
        for c, count in zip(candidates, counts):  # the counts fall as the candidates rise
            t = jnp.where(count >= wanted, c, t)
        return t

    t = jax.lax.fori_loop(0, bits // 2, search, jnp.zeros((1, ROWS), jnp.int32))
    if bits < 32:  # the low bits as the 32-bit search sets them (``_topk._fill_low_bits``)
        t = jnp.where((wanted == 0) | (t >= 0), t | ((1 << (32 - bits)) - 1), t)
    threshold = t ^ INT_MIN
    room = wanted - _count(key_ref, lo, hi, lambda k: k > threshold)  # ties to keep

    def running(x):  # inclusive running sum down the eight sublanes
        for s in (1, 2, 4):
            x = x + jnp.where(sub >= s, pltpu.roll(x, s, 0), 0)
        return x

    def clear(v, _):
        for a, e in zip(here, empty):
            a[_rows(v), :] = e
        return _

    _each(0, lo, clear, unroll=unroll)

    def shifts(v, before):
        above_before, ties_before = before
        key = key_ref[_rows(v), :]
        above = key > threshold
        ties = (key == threshold) & (key != INT_MIN)
        both = jnp.where(above, 1, jnp.where(ties, 1 << 16, 0))  # both counts in one word: 8 at most
        upto = running(both)
        ahead = upto - both
        ties_ahead = (ahead >> 16) + ties_before
        kept = above | (ties & (ties_ahead < room))
        row = v * SUBLANES + sub
        here[1][_rows(v), :] = jnp.where(
            kept, row - (ahead & 0xFFFF) - above_before - jnp.minimum(ties_ahead, room), -1
        )
        if packed:  # the key's top 16 bits, then the complement of the index: a tie ranks the lower first
            here[0][_rows(v), :] = jnp.where(kept, (key & jnp.int32(-65536)) | (0xFFFF - row), INT_MIN)
        else:
            here[0][_rows(v), :] = jnp.where(kept, key, INT_MIN)
            here[2][_rows(v), :] = jnp.where(kept, row, -1)
        return above_before + (upto[SUBLANES - 1 :] & 0xFFFF), ties_before + (upto[SUBLANES - 1 :] >> 16)

    zero = jnp.zeros((1, ROWS), jnp.int32)
    _each(lo, hi, shifts, (zero, zero), unroll=unroll)

    for step in range(steps):  # the shift network over vregs [0, hi)
        d = 1 << step
        bit = jnp.int32(d | INT_MIN)  # an empty row's shift, -1, has the sign bit: it neither moves nor stays

        def settle(v, cur, incoming, d=d, bit=bit):
            take = (incoming[1] & bit) == d
            stay = (cur[1] & bit) == 0
            for a, new, old, e in zip(here, incoming, cur, empty):
                a[_rows(v), :] = jnp.where(take, new, jnp.where(stay, old, e))

        def move(v, _, here=here, d=d, settle=settle):
            cur = [a[_rows(v), :] for a in here]
            if d < SUBLANES:  # the rows d below: the rest of this vreg, the top of the next
                nxt = [a[_rows(v + 1), :] for a in here]
                up = SUBLANES - d
                incoming = [
                    jnp.where(sub < up, pltpu.roll(c, up, 0), pltpu.roll(x, up, 0)) for c, x in zip(cur, nxt)
                ]
            else:
                incoming = [a[_rows(v + d // SUBLANES), :] for a in here]
            settle(v, cur, incoming)
            return _

        def last(v, _, here=here, d=d, settle=settle):  # nothing below hi comes up into these
            cur = [a[_rows(v), :] for a in here]
            if d < SUBLANES:
                incoming = [
                    jnp.where(sub < SUBLANES - d, pltpu.roll(c, SUBLANES - d, 0), e)
                    for c, e in zip(cur, empty)
                ]
            else:
                incoming = empty
            settle(v, cur, incoming)
            return _

        split = jnp.maximum(hi - max(1, d // SUBLANES), 0)
        _each(0, split, move, unroll=unroll)  # in place: rows in order, row v from rows v and up
        _each(split, hi, last, unroll=1)
    nv = n // SUBLANES
    _each(jnp.minimum(hi, nv), nv, clear, unroll=1)

    values = [here[0]] + ([] if packed else [here[2]])

    def first(a, b):  # whether a ranks before b: the higher key, a tie to the lower index
        if packed:
            return a[0] > b[0]
        return (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))

    def over(count, body):  # body(i) for i < count: unrolled on the chip (static rows), a loop interpreted
        if unrolled:
            for i in range(count):
                body(i)
        else:
            jax.lax.fori_loop(0, count, lambda i, _: (body(i), _)[1], 0)

    size = 2
    while size <= n:  # bitonic: sorted runs of ``size``, alternately descending and ascending
        stride = size // 2
        while stride >= 1:
            if stride < nv:  # whole vregs v and v + stride

                def pair(i, size=size, stride=stride):
                    v = i // stride * 2 * stride + i % stride
                    a = [x[_rows(v), :] for x in values]
                    b = [x[_rows(v + stride), :] for x in values]
                    if size < nv:  # the run's direction is the vreg's
                        keep = first(a, b) == ((v & size) == 0)
                    else:  # the sublane's
                        keep = first(a, b) == ((sub & (size // nv)) == 0)
                    for x, aa, bb in zip(values, a, b):
                        x[_rows(v), :] = jnp.where(keep, aa, bb)
                        x[_rows(v + stride), :] = jnp.where(keep, bb, aa)

                over(nv // 2, pair)
            else:  # within a vreg: sublane s and s ^ (stride / nv)

                def within(v, size=size, apart=stride // nv):
                    lower = (sub & apart) == 0
                    own = [x[_rows(v), :] for x in values]
                    other = [
                        jnp.where(lower, pltpu.roll(x, SUBLANES - apart, 0), pltpu.roll(x, apart, 0))
                        for x in own
                    ]
                    keep = first(own, other) == (lower == ((sub & (size // nv)) == 0))
                    for x, o, q in zip(values, own, other):
                        x[_rows(v), :] = jnp.where(keep, o, q)

                over(nv, within)
            stride //= 2
        size *= 2
    _put_ranked(values, outs, n, packed)


def _put_ranked(values, outs, n, packed):
    """The sorted rows ``values`` (row ``8 v + s``: sort position ``s * n / 8 + v`` of each lane's row)
    into the outputs' rows, [128, width]: the indices (-1 past a row's visible blocks) and the scores
    there (``MASKED_VALUE`` past them), in the scores' dtype. A [128, 128] tile of sort positions a
    transpose: stride-8 loads of the rows holding them, then one XLU transpose (of the packed word, or
    of the key and the index), so no XLA copy transposes or decodes the result."""
    per = n // SUBLANES  # sort positions a sublane holds
    rows = min(per, ROWS)  # of them a strided load takes
    width = outs[0].shape[1]
    for c in range(-(-width // ROWS)):
        parts = []
        for at in range(c * ROWS, min((c + 1) * ROWS, n), rows):
            s, v = divmod(at, per)
            parts.append([x[pl.ds(SUBLANES * v + s, rows, stride=SUBLANES), :] for x in values])
        tiles = [jnp.concatenate(p, axis=0) if len(p) > 1 else p[0] for p in zip(*parts)]
        if tiles[0].shape[0] < ROWS:  # fewer than 128 positions (n 64): padded, then cut
            tiles = [jnp.pad(t, ((0, ROWS - t.shape[0]), (0, 0)), constant_values=INT_MIN) for t in tiles]
        tiles = [t.T for t in tiles]  # [128 rows, 128 positions]
        if packed:  # the key's top 16 bits, the complement of the index: the low bits ``int_keys`` leaves
            (p,) = tiles
            index = jnp.where(p != INT_MIN, 0xFFFF - (p & 0xFFFF), -1)
            key = (p & jnp.int32(-65536)) | jnp.where(p < 0, 0xFFFF, 0)
        else:
            key, index = tiles
            index = jnp.where(key != INT_MIN, index, -1)
        scores = jnp.where(index >= 0, _key_floats(key), _kernel_ops.MASKED_VALUE)
        cols = pl.ds(c * ROWS, min(ROWS, width - c * ROWS))
        outs[0][:, cols] = index[:, : cols.size]
        outs[1][:, cols] = scores[:, : cols.size].astype(outs[1].dtype)


def visible_range(kv_start, kv_end, width: int, block_rows: int):
    """Per block of ``block_rows`` rows (``kv_start``, ``kv_end``: [rows], numpy or jax): (lo, hi), the
    blocks any of its rows sees (lo >= hi where none does; the rows padding the last block see nothing)."""
    xp = np if isinstance(kv_start, np.ndarray) else jnp
    lo, hi = xp.clip(kv_start, 0, width), xp.clip(kv_end, 0, width)
    seen = hi > lo
    pad = [(0, -lo.shape[0] % block_rows)]
    lo = xp.pad(xp.where(seen, lo, width), pad, constant_values=width).reshape(-1, block_rows).min(axis=1)
    hi = xp.pad(xp.where(seen, hi, 0), pad).reshape(-1, block_rows).max(axis=1)
    return lo, hi


def spans(kv_start, kv_end, width: int):
    """Per block of ``ROWS`` rows, flat: the vregs [first, end) holding any block one of its rows sees,
    whole counting trips (0, 0 where none). numpy or jax, as ``kv_start`` is."""
    xp = np if isinstance(kv_start, np.ndarray) else jnp
    lo, hi = visible_range(kv_start, kv_end, width, ROWS)
    trip = SUBLANES * COUNT_UNROLL
    first = xp.where(hi > lo, lo // trip * COUNT_UNROLL, 0)
    end = xp.where(hi > lo, -(-hi // trip) * COUNT_UNROLL, 0)
    return xp.stack([first, end], 1).reshape(-1).astype(xp.int32)


def select(scores, top_k, interpret=False, name="topk_select", kv_start=None, kv_end=None, transposed=False):
    """(int32 [R, k] indices, [R, k] scores) of each row of ``scores`` [R, W] (``k`` = min(top_k, n)):
    highest first, a tie to the lower index; index -1 and ``MASKED_VALUE`` past the row's visible
    entries. ``kv_start``, ``kv_end`` [R]: the rows' visible blocks (the passes skip the others).
    ``transposed``: ``scores`` is [B, W, R / B], a row down the sublanes as the kernel reads it (the
    dense forward's ``transposed``), so no XLA copy transposes it."""
    if not transposed:
        scores = scores.T[None]
    batch, width, per_batch = scores.shape
    rows = batch * per_batch
    padded, n, steps, packed = geometry(width, top_k, scores.dtype)
    blocks = -(-per_batch // ROWS)  # of a batch's rows
    total = blocks * ROWS
    widths = ((0, 0), (0, padded - width), (0, total - per_batch))
    if widths != ((0, 0),) * 3:
        scores = jnp.pad(scores, widths, constant_values=-jnp.inf)
    if kv_start is None:
        kv_start, kv_end = jnp.zeros(rows, jnp.int32), jnp.full(rows, width, jnp.int32)
    # a batch's rows padded to whole blocks, seeing nothing
    kv = [
        jnp.pad(x.reshape(batch, per_batch), ((0, 0), (0, total - per_batch))).reshape(-1)
        for x in (kv_start, kv_end)
    ]
    bounds = spans(*kv, width)
    arrays, height = _buffers(padded, n, packed)
    bits = _PACKED_BITS if jnp.dtype(scores.dtype) == jnp.bfloat16 else 32
    need = vmem_bytes(width, top_k, scores.dtype)
    call = pl.pallas_call(
        functools.partial(
            _kernel, top_k=top_k, bits=bits, packed=packed, n=n, steps=steps, unrolled=not interpret
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch * blocks,),
            in_specs=[pl.BlockSpec((None, padded, ROWS), lambda i, s: (i // blocks, 0, i % blocks))],
            out_specs=[pl.BlockSpec((ROWS, n), lambda i, s: (i, 0))] * 2,
            scratch_shapes=[pltpu.VMEM((height, ROWS), jnp.int32)] * arrays,
        ),
        out_shape=[
            _mesh.out_struct((batch * total, n), dtype, scores) for dtype in (jnp.int32, scores.dtype)
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=_geometry.vmem_limit(need, 0),
        ),
        interpret=interpret,
        name=name,
    )
    index, values = _mesh.interpretable(lambda a: call(*a), (bounds, scores), interpret)
    if need > XLA_FUSION_VMEM_BYTES:
        index, values = jax.lax.optimization_barrier((index, values))
    k = min(top_k, n)
    if (total, n) != (per_batch, k):
        index, values = (
            x.reshape(batch, total, n)[:, :per_batch, :k].reshape(rows, k) for x in (index, values)
        )
    return index, values


def _key_floats(key):
    """The float32 scores whose int32 keys are ``key`` (``int_keys`` undone; INT_MIN: any value)."""
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)
