"""Each query's top_k compressed blocks and their scores, without the [B, S, W] score array and without
sorting W entries: what every variant's ``score_topk`` runs.

The queries are scored a chunk at a time by the variant's own dense forward (``queries_per_chunk``:
the chunk's scores and the selection's working arrays stay within ``working_bytes``, 512 MiB unless
told), and each chunk is cut down to top_k at once, exactly, by ``select``:

- rows that fit VMEM whole (W up to about 30K blocks: ``_select.fits``) by one Pallas kernel,
  ``_select.select``: threshold, compaction and a sort of top_k, all in VMEM, no gather;
- wider rows (a context-parallel shard of a 1M-token context) streamed from HBM:

  1. ``_keys``: each score's float32 bits as a uint32 in the scores' total order (0: not visible);
  2. ``threshold``: a radix search for the top_k-th largest key, a counting pass per bit that can
     differ (16 for bfloat16 scores), by a Pallas kernel (``_threshold_kernel``) that reads a block
     of rows from HBM once; ``_threshold`` is the same search in XLA;
  3. the blocks above it and the lowest-indexed ties kept as bits of uint32 words (``_kept_words``);
  4. ``_compact``: slot j takes the block where the running count of kept blocks reaches j + 1 (a
     binary search of the words' running count: log2(W / 32) gathers of top_k entries);
  5. only those top_k are sorted into score order: highest first, a tie to the lower block.

Either way the result is ``topk_indices(score(...), top_k)`` and ``score(...)`` there, bit for bit:
selected on the values ``score`` returns, in its output dtype. The scores are differentiable: the
gradient is ``sparse_score``'s at the selected blocks (computed from q and k again, never as [B, S, W]).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _checks, _gather, _geometry, _kernel_ops, _mesh, _operands, _select

DEFAULT_WORKING_BYTES = 512 * 2**20  # the working set of a chunk of queries, scores included
# 32-bit words held per score of a chunk while it is selected: the score, its key, the two running
# counts and the masks (a bound, not a count of XLA's buffers).
WORDS_PER_SCORE = 6
QUERY_GRANULE = 8  # a chunk is a multiple of this many queries (when S allows): whole sublane rows


def queries_per_chunk(batch, seq_len, num_blocks, working_bytes=DEFAULT_WORKING_BYTES, block_q=QUERY_GRANULE):
    """Queries scored and selected at once: as many as ``working_bytes`` holds (``WORDS_PER_SCORE``
    words per score of the chunk), at most S, a multiple of the variant's ``block_q`` where that fits
    (so its kernels pad nothing), else of ``QUERY_GRANULE``; a divisor of S where one of those is
    within twice the chunks, so that the chunks' results are [B, S, top_k] as they stand (an overlapping
    last chunk cost about 1 ms a call of slicing, padding and concatenation at S 32768, B 1 on a v5e).
    ValueError when it holds not even one query's."""
    per_query = batch * num_blocks * 4 * WORDS_PER_SCORE
    chunk = working_bytes // per_query
    if chunk < 1:
        raise ValueError(
            f"working_bytes={working_bytes} holds less than one query's working set ({per_query} bytes at "
            f"B={batch}, W={num_blocks}: {WORDS_PER_SCORE} words per score)"
        )
    chunk = min(chunk, seq_len)
    granule = block_q if chunk >= block_q else QUERY_GRANULE
    chunk = chunk if chunk < granule else chunk // granule * granule
    steps = -(-seq_len // chunk)
    for even in range(steps, 2 * steps + 1):  # S in equal chunks, if at most twice the steps do it
        if seq_len % even == 0 and (seq_len // even) % granule == 0:
            return seq_len // even
    return chunk


# Top bits of a score's float32 bits that can differ between scores of its dtype: bfloat16 is float32's
# top 16 bits. (float16's 10-bit mantissa lands in 13 of float32's, with its own exponent: all 32.)
SIGNIFICANT_BITS = {jnp.dtype(jnp.bfloat16): 16}


def _keys(scores):
    """uint32 keys in the total order of the float32 ``scores`` (-0.0 below +0.0, as ``lax.top_k``
    orders them); 0 for a non-finite score (masked, NaN, inf: never a visible block), below every other."""
    bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.uint32)
    keys = jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))
    return jnp.where(jnp.isfinite(scores), keys, jnp.uint32(0))


def _threshold(keys, wanted, bits=32):
    """Per row, the largest key t with at least ``wanted`` keys >= t: the wanted-th largest key, found
    bit by bit from the top, one counting pass over the row per bit.

    ``bits`` < 32: every key's low 32 - bits bits are all 0 (a positive score's) or all 1 (a negative
    one's: the key is its complement), so only the top ``bits`` are searched and the low ones follow:
    those of the key found (all 1 where its top bit is clear), or all 1 where ``wanted`` is 0 (every
    candidate then has enough keys), as the full search would set them."""

    def step(bit, t):
        candidate = t | jax.lax.shift_left(jnp.uint32(1), (31 - bit).astype(jnp.uint32))
        enough = jnp.sum(keys >= candidate, axis=-1, keepdims=True, dtype=jnp.int32) >= wanted
        return jnp.where(enough, candidate, t)

    start = keys[..., :1] & jnp.uint32(0)  # zeros that vary over a shard_map's axes as keys do
    t = jax.lax.fori_loop(0, bits, step, start)
    return _fill_low_bits(t, t >> 31 == 0, wanted, bits)


def _fill_low_bits(t, top_bit_clear, wanted, bits):
    """A threshold found on the top ``bits`` of the keys with its low bits as the 32-bit search sets
    them (see ``_threshold``): all 1 where the key's top bit is clear or ``wanted`` is 0, else all 0.
    ``top_bit_clear`` is given by the caller, which holds the keys unsigned or shifted to signed."""
    if bits == 32:
        return t
    low = jnp.asarray((1 << (32 - bits)) - 1, t.dtype)
    return jnp.where((wanted == 0) | top_bit_clear, t | low, t)


# The threshold kernel: a block of rows of a chunk's scores, read once; its counting passes over
# THRESHOLD_LANES-wide slices of the keys it keeps in VMEM, in int32 (a key's unsigned order is its
# signed order with the top bit flipped). A pass waits on the one before (it refines the threshold),
# so a block holds as many rows as THRESHOLD_BLOCK_BYTES of keys allows, up to THRESHOLD_MAX_ROWS: at
# 8 rows of 2048 blocks a pass is latency, ~43 bundles for 16 vregs of keys.
THRESHOLD_LANES = 2048
THRESHOLD_UNROLL = 4  # lane slices a loop trip, where the row has that many
THRESHOLD_BLOCK_BYTES = 4 * 2**20
THRESHOLD_MIN_ROWS, THRESHOLD_MAX_ROWS = 8, 64
_INT_MIN = _select.INT_MIN


def _lane_sum(x):
    """int32 [rows, n * 128] summed into [rows, 128]: whole lane groups added as a tree, no relayout."""
    return _select.tree_sum([x[:, j * 128 : (j + 1) * 128] for j in range(x.shape[1] // 128)])


def _threshold_kernel(spans_ref, scores_ref, out_ref, keys_ref, *, top_k, bits, lanes, unroll):
    """Per row of the block: the visible count and the threshold ``_threshold`` finds (its bits as
    int32), in lanes 1 and 0 of the output row. ``lanes``: the width of a counting slice; ``unroll``:
    slices a group. ``spans_ref``: per block of rows, flat, the groups [first, end) with a column any
    of its rows may see; the others hold only masked scores, so no pass reads them (their keys are
    never written)."""
    width = keys_ref.shape[1]
    rows = keys_ref.shape[0]
    block = pl.program_id(0)
    first, end = spans_ref[2 * block], spans_ref[2 * block + 1]
    groups = width // (lanes * unroll)

    def over_groups(visit, n):
        """``visit(slice, n)`` over every slice of every group in [first, end), ``n`` carried: a loop of
        as many trips as the block has groups to read."""

        def group(g, n):
            for u in range(unroll):
                n = visit(g * unroll + u, n)
            return n

        if groups == 1:  # nothing to skip but a block no row sees: no branch (~9% of a pass)
            return group(0, n)
        return jax.lax.fori_loop(first, end, group, n)

    def to_keys(c, visible):
        key = _select.int_keys(
            scores_ref[:, pl.ds(pl.multiple_of(c * lanes, lanes), lanes)].astype(jnp.float32)
        )
        keys_ref[:, pl.ds(pl.multiple_of(c * lanes, lanes), lanes)] = key
        return visible + _lane_sum((key != _INT_MIN).astype(jnp.int32))

    zeros = jnp.zeros((rows, 128), jnp.int32)
    visible = jnp.sum(over_groups(to_keys, zeros), axis=1, keepdims=True)
    wanted = jnp.minimum(visible, top_k)

    def step(bit, t):  # t: the unsigned threshold's bits
        candidate = t | jax.lax.shift_left(jnp.int32(1), 31 - bit)
        signed = candidate ^ _INT_MIN

        def count(c, n):
            keys = keys_ref[:, pl.ds(pl.multiple_of(c * lanes, lanes), lanes)]
            return n + _lane_sum((keys >= signed).astype(jnp.int32))

        n = jnp.sum(over_groups(count, zeros), axis=1, keepdims=True)
        return jnp.where(n >= wanted, candidate, t)

    t = jax.lax.fori_loop(0, bits, step, jnp.zeros((rows, 1), jnp.int32))
    t = _fill_low_bits(t, t >= 0, wanted, bits)  # t holds the unsigned bits: >= 0 is a clear top bit
    lane = jax.lax.broadcasted_iota(jnp.int32, (rows, 128), 1)
    out_ref[...] = jnp.where(lane == 0, t, jnp.where(lane == 1, visible, 0))


def threshold_geometry(width):
    """(padded W, slice lanes, slices a group, rows a block) of the threshold kernel for rows of W."""
    padded = _geometry.round_up(width, _geometry.LANES)
    lanes = math.gcd(padded, THRESHOLD_LANES)  # a slice width dividing the row: whole lane groups
    unroll = math.gcd(padded // lanes, THRESHOLD_UNROLL)  # slices a group: loads and compares to overlap
    fit = THRESHOLD_BLOCK_BYTES // (4 * padded) // THRESHOLD_MIN_ROWS * THRESHOLD_MIN_ROWS
    return padded, lanes, unroll, min(THRESHOLD_MAX_ROWS, max(THRESHOLD_MIN_ROWS, fit))


def threshold_spans(kv_start, kv_end, width):
    """Per block of the threshold kernel's rows (``kv_start``, ``kv_end``: [rows], the rows' visible
    blocks, numpy or jax), the slice groups [first, end) holding any block one of its rows sees
    (0, 0 for a block none of whose rows sees any; the rows padding the last block see nothing)."""
    _, lanes, unroll, block_rows = threshold_geometry(width)
    xp = np if isinstance(kv_start, np.ndarray) else jnp
    lo, hi = _select.visible_range(kv_start, kv_end, width, block_rows)
    group = lanes * unroll
    first = xp.where(hi > lo, lo // group, 0)
    end = xp.where(hi > lo, -(-hi // group), 0)
    return xp.stack([first, end], axis=1).astype(xp.int32)


def threshold(scores, top_k, interpret=False, name="topk_threshold", kv_start=None, kv_end=None):
    """(threshold key [..., 1] uint32, visible count [..., 1] int32) of each row of ``scores`` [..., W]:
    ``_threshold(_keys(scores), min(visible, top_k))`` and the row's finite entries, from one Pallas
    kernel that reads each block of rows from HBM once and makes every counting pass in VMEM.
    ``kv_start``, ``kv_end`` ([...]): the rows' visible blocks, where the scores are masked outside
    them: the passes skip the slices no row of a block sees (default: none skipped)."""
    *lead, width = scores.shape
    rows = scores.reshape(-1, width)
    padded, lanes, unroll, block_rows = threshold_geometry(width)
    if padded != width:  # -inf: not visible, counted nowhere
        rows = jnp.pad(rows, ((0, 0), (0, padded - width)), constant_values=-jnp.inf)
    if kv_start is None:
        kv_start, kv_end = jnp.zeros(rows.shape[0], jnp.int32), jnp.full(rows.shape[0], width, jnp.int32)
    spans = threshold_spans(kv_start.reshape(-1), kv_end.reshape(-1), width)
    spans = spans.reshape(-1)  # flat in SMEM: a [blocks, 2] array would be padded to 128 lanes
    block = (block_rows, padded)
    need = 2 * math.prod(block) * rows.dtype.itemsize + math.prod(block) * 4 + 2 * block[0] * 128 * 4
    call = pl.pallas_call(
        functools.partial(
            _threshold_kernel,
            top_k=top_k,
            bits=SIGNIFICANT_BITS.get(jnp.dtype(scores.dtype), 32),
            lanes=lanes,
            unroll=unroll,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(spans.shape[0] // 2,),
            in_specs=[pl.BlockSpec(block, lambda i, spans: (i, 0))],
            out_specs=pl.BlockSpec((block[0], 128), lambda i, spans: (i, 0)),
            scratch_shapes=[pltpu.VMEM(block, jnp.int32)],
        ),
        out_shape=_mesh.out_struct((rows.shape[0], 128), jnp.int32, rows),  # varies as the scores do
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=_geometry.vmem_limit(need, _gather.SPARSE_SCOPED_VMEM_DEFAULT_BYTES),
        ),
        interpret=interpret,
        name=name,
    )
    # interpreted inside shard_map, as the variants' kernels are (see _mesh.interpretable)
    out = _mesh.interpretable(lambda a: call(*a), (spans, rows), interpret)
    t = jax.lax.bitcast_convert_type(out[:, :1], jnp.uint32).reshape(*lead, 1)
    return t, out[:, 1:2].reshape(*lead, 1)


def _low_bits(n):
    """uint32 words with their low ``n`` bits set (``n`` int32, 0 to 32)."""
    shift = jnp.minimum(n, 31).astype(jnp.uint32)
    return jnp.where(n >= 32, jnp.uint32(0xFFFFFFFF), (jnp.uint32(1) << shift) - 1)


def _nth_bit(words, n):
    """The position of each word's ``n``-th lowest set bit (``n`` >= 1, at most its set bits): a binary
    search of the population count of its low bits, five steps."""
    at = jnp.zeros(words.shape, jnp.int32)
    for step in (16, 8, 4, 2, 1):
        below = jax.lax.population_count(words & _low_bits(at + step)).astype(jnp.int32) < n
        at = jnp.where(below, at + step, at)
    return at


def _pack(bits):
    """bool [..., W] as uint32 words [..., ceil(W / 32)]: entry 32 m + b is bit b of word m."""
    *lead, width = bits.shape
    padded = jnp.pad(bits, [(0, 0)] * len(lead) + [(0, -width % 32)])
    words = padded.reshape(*lead, -1, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    return jnp.sum(words, axis=-1, dtype=jnp.uint32)


def _kept_words(above, ties, wanted):
    """The kept blocks as words: every block above the threshold, and of those at it the lowest-indexed
    ones, as many as ``wanted`` leaves room for (each word keeps the lowest of its ties that the ties of
    the words before it leave room for)."""
    at = jax.lax.population_count(ties).astype(jnp.int32)
    room = wanted - jnp.sum(jax.lax.population_count(above), axis=-1, keepdims=True, dtype=jnp.int32)
    keep = jnp.clip(room - (jnp.cumsum(at, axis=-1) - at), 0, at)
    return above | jnp.where(keep > 0, ties & _low_bits(_nth_bit(ties, jnp.maximum(keep, 1)) + 1), 0)


def _compact(kept, slots, width):
    """Per row, for slot j < ``slots``, the index of the (j + 1)-th kept block (``width`` past the last),
    from the kept words [..., ceil(W / 32)]: a binary search of their running count for the word
    (log2(W / 32) gathers of ``slots`` entries, no scatter), then the bit inside it."""
    count = jax.lax.population_count(kept).astype(jnp.int32)
    running = jnp.cumsum(count, axis=-1)
    words = kept.shape[-1]
    target = jnp.broadcast_to(jnp.arange(1, slots + 1, dtype=jnp.int32), kept.shape[:-1] + (slots,))
    lo = jnp.zeros_like(target)
    hi = jnp.full_like(target, words)
    for _ in range(max(1, math.ceil(math.log2(words + 1)))):  # first word with running >= target
        mid = (lo + hi) // 2
        below = jnp.take_along_axis(running, jnp.minimum(mid, words - 1), axis=-1) < target
        lo, hi = jnp.where(below, mid + 1, lo), jnp.where(below, hi, mid)
    word = jnp.minimum(lo, words - 1)
    before = jnp.take_along_axis(running - count, word, axis=-1)
    bit = _nth_bit(jnp.take_along_axis(kept, word, axis=-1), target - before)
    return jnp.where(lo < words, 32 * lo + bit, width)


def _order_keys(key, dtype, top_k):
    """(order, unique): per slot a uint32 that sorts ascending into score order, the key descending and
    a tie to the lower slot (the slots are in block order, so to the lower block), and whether no two
    slots share one. Where the key's significant bits and the slot fit 32 bits (bfloat16 scores, top_k
    up to 65536) both go into one unique key: an unstable sort of it and the indices compiled to 0.29
    Mcycles against 0.79 for a stable sort, which adds an iota and a two-key comparator (v6e, [8192,
    512]). Else (float32 scores) it is the complement of the key, and ties need a stable sort."""
    bits, slot_bits = SIGNIFICANT_BITS.get(jnp.dtype(dtype), 32), _slot_bits(top_k)
    if bits + slot_bits > 32:
        return ~key, False
    slot = jnp.arange(top_k, dtype=jnp.uint32)
    return (~key >> (32 - bits)) << slot_bits | slot, True


def _slot_bits(top_k):
    """Bits of a slot of top_k in ``_order_keys``."""
    return max(1, (top_k - 1).bit_length())


def _scores_of_order_keys(order, dtype, top_k):
    """The scores (``dtype``) whose unique ``_order_keys`` are ``order``: the key's significant bits
    back from under the slot, the low bits as ``_keys`` leaves them (0 for a positive score, 1 for a
    negative one, whose key is its complement), then ``_keys`` undone."""
    bits = SIGNIFICANT_BITS[jnp.dtype(dtype)]
    key = ~(order >> _slot_bits(top_k)) << (32 - bits)
    key = jnp.where(key >> 31 == 1, key, key | jnp.uint32((1 << (32 - bits)) - 1))
    f32 = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(f32, jnp.float32).astype(dtype)


def selection_kernel(width, top_k, dtype):
    """The kernel ``select`` cuts rows of ``width`` scores of ``dtype`` with (its name's suffix)."""
    return "topk_select" if _select.fits(width, top_k, dtype) else "topk_threshold"


def select(scores, top_k, interpret=False, name="topk", kv_start=None, kv_end=None, transposed=False):
    """The top_k entries of each row of ``scores`` [..., W] (any float dtype): (int32 indices, scores
    there), highest first, a tie to the lower index, index -1 and ``MASKED_VALUE`` past the row's
    visible (finite) entries; exactly ``topk_indices``'s choice, with no sort wider than top_k.
    ``transposed``: ``scores`` is [B, W, R] (rows that fit VMEM only), the result [B, R, top_k].

    Rows that fit VMEM whole (``_select.fits``: W up to about 30K) are selected there, by one kernel
    (``{name}_select``); wider ones by the threshold kernel (``{name}_threshold``) and XLA's
    compaction of the kept blocks (its gathers), reading the row from HBM a pass."""
    if transposed:
        lead, width = (scores.shape[0], scores.shape[2]), scores.shape[1]
    else:
        *lead, width = scores.shape
        scores = scores.reshape(-1, width)
    if selection_kernel(width, top_k, scores.dtype) == "topk_select":
        flat = [None if x is None else x.reshape(-1) for x in (kv_start, kv_end)]
        index, values = _select.select(
            scores, top_k, interpret, f"{name}_select", *flat, transposed=transposed
        )
        short = top_k - index.shape[-1]  # top_k past the sorted rows (more than W): empty slots
        index = jnp.pad(index, ((0, 0), (0, short)), constant_values=-1)
        values = jnp.pad(values, ((0, 0), (0, short)), constant_values=_kernel_ops.MASKED_VALUE)
        return index.reshape(*lead, top_k), values.reshape(*lead, top_k)  # values: the scores' dtype
    return _select_streamed(
        scores.reshape(*lead, width), top_k, interpret, f"{name}_threshold", kv_start, kv_end
    )


def _select_streamed(scores, top_k, interpret, name, kv_start, kv_end):
    """``select`` for rows too wide for VMEM: the threshold kernel, then the kept blocks compacted and
    sorted in XLA."""
    width = scores.shape[-1]
    keys = _keys(scores)
    t, visible = threshold(scores, top_k, interpret, name, kv_start, kv_end)
    wanted = jnp.minimum(visible, top_k)
    kept = _kept_words(_pack(keys > t), _pack((keys == t) & (keys > 0)), wanted)
    index = _compact(kept, top_k, width)  # in block order; W in the slots past the kept ones
    filled = jnp.arange(top_k) < wanted
    # the kept blocks' keys from their gathered scores: the keys of the chunk are never held whole
    key = jnp.where(filled, _keys(jnp.take_along_axis(scores, jnp.minimum(index, width - 1), axis=-1)), 0)
    order, unique = _order_keys(key, scores.dtype, top_k)  # score order, a tie to the lower block
    order, index = jax.lax.sort((order, index), dimension=-1, num_keys=1, is_stable=not unique)
    if unique:  # the sorted keys hold the scores' bits: no gather
        values = _scores_of_order_keys(order, scores.dtype, top_k)
    else:
        values = jnp.take_along_axis(scores, jnp.minimum(index, width - 1), axis=-1)
    masked = jnp.asarray(_kernel_ops.MASKED_VALUE, scores.dtype)
    return jnp.where(filled, index, -1).astype(jnp.int32), jnp.where(filled, values, masked)


def _chunked(
    variant, forward, q, k, weights, kv_start, kv_end, k_scale, softmax_scale, interpret, top_k, chunk
):
    """(indices, scores) of every query, ``chunk`` queries at a time in a loop: only a chunk's
    [B, chunk, W] scores ever exist, made by ``forward`` (the variant's dense forward), which reads a
    chunk's queries from a head-major q in place where chunks tile S in whole q blocks
    (``_operands.reads_in_place``; else a slice of q), and writes them transposed, [B, W, chunk], as
    the selection kernel reads them, where its tiles are whole 128 x 128 transposes
    (``writes_transposed``). On a v5e at S 32768, each saved an XLA copy a chunk: 0.22 and 0.58 ms."""
    seq_axis = 2 if variant["q_layout"] == "head_major" else 1
    batch, _, seq_len, _ = _checks.q_dims(q, variant["q_layout"])
    steps = -(-seq_len // chunk)
    in_place = _operands.reads_in_place(variant, seq_len, chunk)
    transposed = writes_transposed(variant, k.shape[1], top_k, chunk)
    # every array varies alike, as the kernels' outputs say (``score`` does the same)
    q, k, weights, kv_start, kv_end, k_scale = _mesh.vary_together((q, k, weights, kv_start, kv_end, k_scale))
    out_dtype = jnp.dtype(variant["out_dtype"])

    def one(_, step):
        # the last chunk ends at S (overlapping the one before), so nothing is padded or copied
        at = jnp.minimum(step * chunk, seq_len - chunk)
        rows = [jax.lax.dynamic_slice_in_dim(x, at, chunk, 1) for x in (weights, kv_start, kv_end)]
        queries = q if in_place else jax.lax.dynamic_slice_in_dim(q, at, chunk, seq_axis)
        scores = _mesh.interpretable(
            lambda a: forward(*a, softmax_scale, interpret, out_dtype, q_at=at if in_place else None,
                              transposed=transposed),
            (queries, k, *rows, k_scale),
            interpret,
        )  # fmt: skip
        return None, select(scores, top_k, interpret, f"{variant['name']}_topk", rows[1], rows[2], transposed)

    _, chunks = jax.lax.scan(one, None, jnp.arange(steps))
    tail = seq_len - (steps - 1) * chunk  # rows of the last chunk not already in the one before

    def assemble(x):  # [steps, B, chunk, top_k] -> [B, S, top_k] (a bitcast at B 1 when chunks tile S)
        if tail == chunk:
            return jnp.moveaxis(x, 0, 1).reshape(batch, seq_len, top_k)
        head = jnp.moveaxis(x[:-1], 0, 1).reshape(batch, (steps - 1) * chunk, top_k)
        return jnp.concatenate([head, x[-1][:, chunk - tail :]], axis=1)

    return tuple(assemble(x) for x in chunks)


def writes_transposed(variant, width, top_k, chunk):
    """Whether ``score_topk``'s chunks of ``chunk`` queries are scored as [B, W, chunk]: where the
    selection kernel takes them (rows that fit VMEM) and the forward's tiles transpose whole, in q
    blocks of a multiple of 128 queries that tile the chunk."""
    block_q = variant["block_q"]
    return block_q % 128 == 0 and chunk % block_q == 0 and _select.fits(width, top_k, variant["out_dtype"])


def differentiable(variant, sparse_score, forward):
    """A variant's ``score_topk`` over its dense ``forward`` (which scores each chunk: see ``_chunked``)
    and ``sparse_score`` (whose gradient at the selected blocks is the scores')."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
    def core(q, k, weights, k_scale, kv_start, kv_end, softmax_scale, interpret, top_k, chunk):
        args = (q, k, weights, kv_start, kv_end, k_scale, softmax_scale, interpret, top_k, chunk)
        return _chunked(variant, forward, *args)

    def core_fwd(q, k, weights, k_scale, kv_start, kv_end, softmax_scale, interpret, top_k, chunk):
        out = core(q, k, weights, k_scale, kv_start, kv_end, softmax_scale, interpret, top_k, chunk)
        return out, (q, k, weights, k_scale, out[0])

    def core_bwd(softmax_scale, interpret, top_k, chunk, residuals, cotangents):
        q, k, weights, k_scale, index = residuals

        def scores(q, k, weights, k_scale):
            return sparse_score(
                q, k, weights, index, k_scale=k_scale, softmax_scale=softmax_scale, interpret=interpret
            )

        _, vjp = jax.vjp(scores, q, k, weights, k_scale)
        return (*vjp(cotangents[1]), None, None)

    core.defvjp(core_fwd, core_bwd)

    def score_topk(
        q, k, weights, top_k, *, kv_start=None, kv_end=None, k_scale=None, softmax_scale=None,
        interpret=False, working_bytes=DEFAULT_WORKING_BYTES,
    ):  # fmt: skip
        """Each query's ``top_k`` highest-scoring blocks and their scores, never holding the
        ``[B, S, W]`` score.

        Returns ``(indices, scores)``, int32 and the score dtype, ``[B, S, top_k]``: exactly
        ``topk_indices(score(...), top_k)`` and ``score(...)`` there, selected on the values ``score``
        returns (in its dtype): highest first, a tie to the lower block, -1 and the masked value past
        a row's visible blocks. Differentiable in the scores, as ``sparse_score`` is (its kernels give
        the gradient at the selected blocks).

        Args:
          q, k, weights, kv_start, kv_end, k_scale, softmax_scale, interpret: as for ``score``.
          top_k: blocks per query, a positive int (it may exceed W: the extra slots are -1).
          working_bytes: bound on a query chunk's scores and selection arrays (default 512 MiB).

        Works inside ``jax.shard_map`` on per-device shards, as ``score`` does.
        """
        kv_start, kv_end, k_scale, softmax_scale = _checks.check_call(
            variant, q, k, weights, kv_start, kv_end, k_scale, softmax_scale
        )
        top_k = _checks.check_top_k(top_k)
        batch, _, seq_len, _ = _checks.q_dims(q, variant["q_layout"])
        chunk = queries_per_chunk(batch, seq_len, k.shape[1], working_bytes, variant["block_q"])
        with jax.named_scope(f"{variant['name']}_topk"):
            return core(q, k, weights, k_scale, kv_start, kv_end, softmax_scale, interpret, top_k, chunk)

    return score_topk


def sharded(
    variant, score_topk, q, k, weights, top_k, *, mesh, batch_axes=_mesh.DEFAULT_BATCH_AXES, context_axis=None,
    kv_start=None, kv_end=None, k_scale=None, softmax_scale=None, interpret=False,
    working_bytes=DEFAULT_WORKING_BYTES,
):  # fmt: skip
    """``score_topk`` inside a ``jax.shard_map`` over ``mesh``: the global ``[B, S, top_k]`` indices and
    scores. B over the batch axes and S over ``context_axis`` as for ``_mesh.sharded_score``; a
    query's selection needs only its own scores, so nothing is exchanged but k's gradient (summed over
    the context axis). H is not sharded: a head axis would all-reduce the [B, S/cp, W] partial scores
    before any selection, the very array this avoids. ``working_bytes`` bounds each device's chunk."""
    softmax_scale = _checks.check_call(variant, q, k, weights, kv_start, kv_end, k_scale, softmax_scale)[3]
    top_k = _checks.check_top_k(top_k)
    arrays, specs, (b, s) = _mesh.mesh_operands(
        variant, mesh, q, k, weights, kv_start, kv_end, k_scale,
        batch_axes=batch_axes, context_axis=context_axis, head_axis=None,
    )  # fmt: skip

    def shard(arrays):
        return score_topk(
            arrays["q"], arrays["k"], arrays["weights"], top_k, kv_start=arrays.get("kv_start"),
            kv_end=arrays.get("kv_end"), k_scale=arrays.get("k_scale"), softmax_scale=softmax_scale,
            interpret=interpret, working_bytes=working_bytes,
        )  # fmt: skip

    out = jax.sharding.PartitionSpec(b, s, None)
    return jax.shard_map(shard, mesh=mesh, in_specs=(specs,), out_specs=(out, out))(arrays)
