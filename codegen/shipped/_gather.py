"""What every sparse kernel module (``_sparse_*``) shares: k's windows sized to VMEM, the kernel-ready
``SparseOperands`` (slots padded, sorted by window where there are several), the slot loops that
gather k rows and scatter-add dk rows, and the ``pallas_call`` over (batch, q block).

DeepSeek's sparse stage scores, per query, only the top_k compressed blocks the indexer selected;
the sparse kernels' MXU work is B * S * top_k * H * D, never W."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _family
from . import _geometry
from ._checks import q_dims
from ._kernel_ops import ACCUM_DTYPE, CONTRACT_LAST, matmul, split, split_matmul
from ._mesh import out_struct
from ._operands import pad_to

SPARSE_BLOCK_Q = _geometry.SPARSE_BLOCK_Q  # queries per grid step of the sparse kernels
# VMEM of the sparse kernels' resident route, from the spec's TPU targets: the smallest chip's
# capacity bounds the W it supports, the smallest default scoped limit decides when to ask for more.
SPARSE_VMEM_CAPACITY_BYTES = _family.SPARSE_VMEM_CAPACITY_BYTES
SPARSE_DK_COPIES = _geometry.SPARSE_DK_COPIES  # the backward's most dk accumulators (see there)
SPARSE_SCOPED_VMEM_DEFAULT_BYTES = _family.SPARSE_SCOPED_VMEM_DEFAULT_BYTES


def sparse_vmem_rows(head_dim, num_heads, top_k_pad, gather_dtype, q_dtype, dk_copies=1):
    """The most k rows (a multiple of the float32 sublane tile) the sparse backward kernel, the larger
    of the two, keeps resident as float32 rows beside their float32 dk on the smallest target's VMEM
    (``SPARSE_VMEM_CAPACITY_BYTES``), with the compiler's headroom: ~47000 at H = 64, D = 128,
    top_k = 1024 with one dk. With one dk, raises ValueError, before anything is traced, when not even
    one tile of rows fits beside one query block's slots (top_k too large for VMEM); with more, returns
    0 then."""
    rows = 1024  # the resident blocks are whole sublane tiles: a per-row cost over many rows
    size = lambda n, pad: _geometry.sparse_vmem_bytes(
        n, head_dim, num_heads, pad, gather_dtype, q_dtype, dk_copies
    )
    per_row = (size(rows, 0) - size(0, 0)) / rows
    fixed = size(0, top_k_pad)
    most = int((SPARSE_VMEM_CAPACITY_BYTES / _geometry.VMEM_HEADROOM - fixed) // per_row)
    most -= most % _geometry.MIN_SUBLANES
    if most < _geometry.MIN_SUBLANES and dk_copies > 1:
        return 0  # no room for more accumulators: see sparse_key_windows
    if most < _geometry.MIN_SUBLANES:
        raise ValueError(
            f"sparse_score gathers each query's top_k={top_k_pad} rows into VMEM: with D={head_dim}, "
            f"H={num_heads} that leaves no room for k in the {SPARSE_VMEM_CAPACITY_BYTES >> 20} MiB of the "
            "smallest target; use a smaller top_k"
        )
    return most


def sparse_key_windows(num_blocks, head_dim, num_heads, top_k, gather_dtype, q_dtype, most_dk_copies=0):
    """(rows per window, windows, dk accumulators) of k for a sparse kernel gathering in ``gather_dtype``
    with up to ``most_dk_copies`` float32 dk accumulators (0: the forward, which holds none; else a
    power of two): as few windows as one accumulator allows (none, for the forward), then as many
    accumulators as keep that many. Each kernel runs once per window (``over_key_windows``), so this is
    also its calls (what ``codegen explain --compiled`` multiplies a call's cost by)."""
    top_k_pad = _geometry.sparse_top_k_pad(top_k)
    rows = lambda copies: sparse_vmem_rows(head_dim, num_heads, top_k_pad, gather_dtype, q_dtype, copies)
    window_rows, windows = _geometry.sparse_windows(num_blocks, rows(min(most_dk_copies, 1)))
    copies = most_dk_copies
    while copies > 1:
        most = rows(copies)
        if most and _geometry.sparse_windows(num_blocks, most)[1] == windows:
            break
        copies //= 2
    return window_rows, windows, copies


def sparse_vmem_limit(window_rows, head_dim, num_heads, top_k_pad, gather_dtype, q_dtype, dk_copies):
    """The ``vmem_limit_bytes`` of the sparse kernels over a window of ``window_rows`` k rows and
    ``dk_copies`` dk accumulators (None: the default scoped limit is enough)."""
    need = _geometry.sparse_vmem_bytes(
        window_rows, head_dim, num_heads, top_k_pad, gather_dtype, q_dtype, dk_copies
    )
    return _geometry.vmem_limit(need, SPARSE_SCOPED_VMEM_DEFAULT_BYTES)


class SparseOperands(NamedTuple):
    """Kernel-ready operands of the sparse kernels: queries padded to whole q blocks of
    ``_geometry.SPARSE_BLOCK_Q``, slots to ``top_k_pad``, k cut into windows that fit VMEM."""

    q: jax.Array  # [B, S_pad, H, D] (head-major q is transposed: a copy of q, nothing of W)
    # One window: [B, W, D] float32 (16- and 8-bit k upcast: exact), one block per batch element,
    # resident. Several: [B, windows * window_rows, D] in k's own dtype, each window upcast as it is used.
    # Float8 k with its per-token scale: k times the scale, float32, either way.
    k: jax.Array
    weights: jax.Array  # [B, S_pad, H] float32
    rows: jax.Array  # [B, S_pad, top_k_pad] int32: the block each slot gathers; 0 for an empty slot
    in_range: jax.Array  # [B, S_pad, top_k_pad] bool: the slot's index lies in [0, W)
    # Several windows: each query's slots in the order the kernels take them, by block (in_range
    # first), and its inverse; None with one window (the kernels take the slots as given).
    order: jax.Array | None
    unorder: jax.Array | None
    valid: jax.Array  # [B, S, top_k] bool: the same, unpadded
    batch: int
    num_heads: int
    seq_len: int
    num_blocks: int
    head_dim: int
    top_k: int
    seq_pad: int
    top_k_pad: int
    window_rows: int  # k rows resident in VMEM per call: W when they all fit
    num_windows: int  # calls of each kernel, one a window of k
    dk_copies: int  # the backward's float32 dk accumulators (0 for the forward)
    vmem_limit_bytes: int | None

    @property
    def num_q_blocks(self):
        return self.seq_pad // _geometry.SPARSE_BLOCK_Q

    def in_call_order(self, slots):
        """A ``[B, S_pad, top_k_pad]`` slot array (the cotangent) in the order the kernels take the slots."""
        return slots if self.order is None else jnp.take_along_axis(slots, self.order, axis=2)

    def in_slot_order(self, slots):
        """A slot array the kernels wrote (the score) back in the order of ``indices``."""
        return slots if self.unorder is None else jnp.take_along_axis(slots, self.unorder, axis=2)


def flat_rows(rows):
    """``rows`` ``[B, S_pad, top_k_pad]`` as one flat ``[B * S_pad * top_k_pad]`` array: a q block's indices
    one flat SMEM block, whose addresses are a base plus the slot (a 2-D SMEM block costs address
    arithmetic per slot, and Mosaic takes an SMEM block of one batch row of a 2-D array only at B = 1)."""
    return rows.reshape(-1)


def sparse_prepare(variant, q, k, weights, indices, k_scale, gather_dtype, most_dk_copies=0):
    """The ``SparseOperands`` of a checked call (see a variant's ``sparse_score``), for a kernel
    gathering in ``gather_dtype`` with up to ``most_dk_copies`` dk accumulators (0: the forward)."""
    # An input upcast to float32 (for a float32 sum of its gradient over mesh axes: see vary_together)
    # goes back to the variant's dtype, exactly; otherwise these do nothing.
    q, k = q.astype(variant["q_dtype"]), k.astype(variant["k_dtype"])
    batch, num_heads, seq_len, head_dim = q_dims(q, variant["q_layout"])
    num_blocks, top_k = k.shape[1], indices.shape[2]
    seq_pad = _geometry.round_up(seq_len, _geometry.SPARSE_BLOCK_Q)
    top_k_pad = _geometry.sparse_top_k_pad(top_k)
    window_rows, num_windows, dk_copies = sparse_key_windows(
        num_blocks, head_dim, num_heads, top_k, gather_dtype, q.dtype, most_dk_copies
    )
    vmem_limit = sparse_vmem_limit(
        window_rows, head_dim, num_heads, top_k_pad, gather_dtype, q.dtype, dk_copies
    )
    if variant["q_layout"] == "head_major":
        q = jnp.swapaxes(q, 1, 2)  # [B, S, H, D]: one query's heads are one [H, D] block
    valid = (indices >= 0) & (indices < num_blocks)
    rows = jnp.where(valid, indices, 0)  # an empty slot gathers block 0; its score is masked after
    pad_slots = lambda a: pad_to(pad_to(a, 2, top_k_pad), 1, seq_pad)
    padded_rows, in_range = pad_slots(rows), pad_slots(valid)
    order = unorder = None
    if k_scale is not None:  # float8 keys: the rows gathered are k times its scale, in float32
        k = k.astype(ACCUM_DTYPE) * k_scale[:, :, None]
    if num_windows == 1:
        k = k.astype(ACCUM_DTYPE)
    else:  # a window's slots together in each query's row: its calls visit those only
        k = pad_to(k, 1, num_windows * window_rows)
        order, unorder = slot_orders(block_keys(padded_rows, in_range, num_blocks), num_blocks)
    return SparseOperands(
        pad_to(q, 1, seq_pad), k, pad_to(weights.astype(ACCUM_DTYPE), 1, seq_pad),
        padded_rows, in_range, order, unorder, valid,
        batch, num_heads, seq_len, num_blocks, head_dim, top_k, seq_pad, top_k_pad, window_rows, num_windows,
        dk_copies, vmem_limit,
    )  # fmt: skip


def block_keys(rows, in_range, num_blocks):
    """Each slot's block to sort the slots by: ``num_blocks`` for an empty or padding slot, so those
    come last (``slot_orders``, ``window_spans``)."""
    return jnp.where(in_range, rows, num_blocks)


def slot_orders(key, num_blocks):
    """(order, unorder), int32: each query's slots (the last axis) sorted by ``key`` (a block, or
    ``num_blocks`` for none), a tie to the lower slot, and the inverse permutation. Where a block and a
    slot fit one int32 key, unique per slot, both are unstable sorts: a stable argsort makes XLA add a
    two-key comparator (v6e, [8192, 512]: 0.67 Mcycles for both, against 0.29)."""
    slots = key.shape[-1]
    slot = jax.lax.broadcasted_iota(jnp.int32, key.shape, key.ndim - 1)
    if (num_blocks + 1) * slots <= jnp.iinfo(jnp.int32).max:
        unique = key * slots + slot
        _, order = jax.lax.sort((unique, slot), dimension=key.ndim - 1, num_keys=1, is_stable=False)
    else:
        order = jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)
    _, unorder = jax.lax.sort((order, slot), dimension=key.ndim - 1, num_keys=1, is_stable=False)
    return order, unorder


def over_key_windows(x, call):
    """``call(done, k, rows, in_window, spans, start)`` once per window of k (``SparseOperands``),
    returning what the last returns: ``k`` the window's float32 rows from block ``start`` on, ``rows``
    the slots' rows within it (0 outside it) and ``in_window`` which slots it holds, both in the order
    the kernels take the slots (``x.in_call_order``); ``spans`` each query's slots in the window (see
    ``window_spans``); ``done`` what the call before returned.

    One window (W fits VMEM): a single call with the whole resident k, ``done``, ``in_window`` and
    ``spans`` None. Several: the first window's call, then a ``lax.scan`` over the rest, whose carry is
    what a call returns (so it varies over a mesh's manual axes as the kernels' outputs do). A slot
    lies in one window: ``call`` keeps the results of its slots in the window and adds what sums over
    slots.
    """
    if x.num_windows == 1:
        return call(None, x.k, x.rows, None, None, 0)
    rows, in_range = x.in_call_order(x.rows), x.in_call_order(x.in_range)
    key = block_keys(rows, in_range, x.num_blocks)  # ascending along each query's slots

    def window(done, index):
        start = index * x.window_rows
        k = jax.lax.dynamic_slice_in_dim(x.k, start, x.window_rows, axis=1).astype(ACCUM_DTYPE)
        in_window = in_range & (rows >= start) & (rows < start + x.window_rows)
        spans = window_spans(key, start, start + x.window_rows)
        return call(done, k, jnp.where(in_window, rows - start, 0), in_window, spans, start)

    first = window(None, 0)
    done, _ = jax.lax.scan(lambda d, i: (window(d, i), None), first, jnp.arange(1, x.num_windows))
    return done


def window_spans(key, lo, hi):
    """Per query, the slots ``[first, end)`` whose sorted ``key`` (``[B, S_pad, top_k_pad]``) lies in
    ``[lo, hi)``, as the kernels read them: int32 ``[B, S_pad / SPARSE_BLOCK_Q * 128]``, 128 words a q
    block, its ``(first, end)`` pairs in the first 2 * SPARSE_BLOCK_Q (one flat SMEM block a step), flat
    over the batch too (``flat_rows``)."""
    first = jnp.sum(key < lo, axis=2, dtype=jnp.int32)
    end = jnp.sum(key < hi, axis=2, dtype=jnp.int32)
    pairs = jnp.stack([first, end], axis=2).reshape(key.shape[0], -1, 2 * _geometry.SPARSE_BLOCK_Q)
    return pad_to(pairs, 2, _geometry.LANES).reshape(-1)


def span_trips(first, end, unroll):
    """(first, stop): the loop trips of ``unroll`` slots that cover the slots ``[first, end)``, none for
    an empty span (scalars in a kernel, arrays in ``codegen explain --compiled``)."""
    lo = first // unroll
    return lo, lo + (end > first) * ((end + unroll - 1) // unroll - lo)


def slot_rows(x, seq_pad, top_k_pad):
    """float32 ``[B, S, top_k]`` padded to ``[B, S_pad, top_k_pad]``: one lane-dense row of slots per query,
    as the kernels read the cotangent and write the score."""
    return pad_to(pad_to(x.astype(ACCUM_DTYPE), 1, seq_pad), 2, top_k_pad)


def sparse_block_specs(x):
    """BlockSpecs of the sparse kernels over the grid (batch b, q block i).

    The indices of one q block come in SMEM through the pipeline (``_geometry.SPARSE_BLOCK_Q * top_k_pad``
    words, flat, double-buffered: 64 KiB at top_k = 1024; an SMEM-space BlockSpec, which lowers for
    TPU), never the whole [B, S, top_k] array as scalar prefetch, which does not fit SMEM's 1 MiB. The
    call's window of k's float32 rows and its float32 dk accumulator are one block per batch element,
    fetched (written) once per b and single-buffered: a second buffer would hold the next batch
    element's, for a prefetch at most once per b, at the cost of half the rows that fit; everything
    else is one q block's.
    """
    qb, nq = _geometry.SPARSE_BLOCK_Q, x.num_q_blocks
    return dict(
        rows=pl.BlockSpec((qb * x.top_k_pad,), lambda b, i: (b * nq + i,), memory_space=pltpu.SMEM),
        q=pl.BlockSpec((None, qb, x.num_heads, x.head_dim), lambda b, i: (b, i, 0, 0)),
        k=pl.BlockSpec(
            (None, x.window_rows, x.head_dim), lambda b, i: (b, 0, 0), pipeline_mode=pl.Buffered(1)
        ),
        dk=pl.BlockSpec(
            (None, x.window_rows, x.head_dim), lambda b, i: (b, 0, 0), pipeline_mode=pl.Buffered(1)
        ),
        weights=pl.BlockSpec((None, qb, x.num_heads), lambda b, i: (b, i, 0)),
        slots=pl.BlockSpec((None, qb, x.top_k_pad), lambda b, i: (b, i, 0)),
        spans=pl.BlockSpec((_geometry.LANES,), lambda b, i: (b * nq + i,), memory_space=pltpu.SMEM),
    )


def for_each_slot(rows_ref, s, slots, unroll, visit, spans_ref=None):
    """``visit(j, row, t)`` for every slot j < ``slots`` of query ``s`` of the q block, in order, ``row``
    its index from the flat SMEM block ``rows_ref``, ``t`` its place in its loop trip (static):
    ``unroll`` slots a trip, statically unrolled so the compiler overlaps their index loads and
    addresses (``slots`` a multiple of it). With ``spans_ref`` (a window of k), only the trips that
    cover the query's span of slots in the window: a loop of as many trips as the indices say."""
    base = s * slots

    def body(c, carry):
        j = pl.multiple_of(c * unroll, unroll)
        for t in range(unroll):
            visit(j + t, rows_ref[base + j + t], t)
        return carry

    if spans_ref is None:
        first, stop = 0, slots // unroll
    else:
        first, stop = span_trips(spans_ref[2 * s], spans_ref[2 * s + 1], unroll)
    jax.lax.fori_loop(first, stop, body, 0)


def spans_kernel(kernel, spans):
    """``kernel(rows_ref, spans_ref, *refs)`` as the pallas_call's kernel: ``spans_ref`` None for a call
    without spans (one window: every slot in it, the loops' trips static)."""
    if spans is not None:
        return kernel
    return lambda rows_ref, *refs, **kw: kernel(rows_ref, None, *refs, **kw)


def spans_input(spans):
    """The ``spans`` operand of a sparse_call's inputs (``sparse_block_specs``): none for one window."""
    return {} if spans is None else {"spans": ("spans", spans)}


def gather_rows(rows_ref, k_ref, gathered_ref, s, spans_ref=None):
    """For every slot j of query ``s``: k's float32 row ``rows[s, j]`` as row j of ``gathered_ref``: one
    dynamic single-row read and one single-row store per slot (a 32-bit row at any dynamic row lowers;
    a vector gather does not), ``_geometry.sparse_trip`` slots a loop trip."""

    def visit(j, row, _):
        gathered_ref[pl.ds(j, 1), :] = k_ref[pl.ds(row, 1), :]

    slots = gathered_ref.shape[0]
    for_each_slot(rows_ref, s, slots, _geometry.sparse_trip(slots), visit, spans_ref)


def scatter_add_rows(rows_ref, dk_refs, dk_gathered_ref, s, spans_ref=None):
    """dk row ``rows[s, j]`` += row j of ``dk_gathered_ref``, slot by slot, into the accumulators
    ``dk_refs`` in turn (their sum is dk): duplicates add up; an empty slot's row is zero (its
    cotangent is) and adds nothing. A dynamic single-row read-modify-write of float32 VMEM per slot,
    ``_geometry.sparse_trip`` a loop trip: a row's load waits on the earlier stores to its
    accumulator, which the compiler orders; the accumulators' chains overlap."""

    def visit(j, row, t):
        dk_ref = dk_refs[t % len(dk_refs)]
        dk_ref[pl.ds(row, 1), :] += dk_gathered_ref[pl.ds(j, 1), :]

    slots = dk_gathered_ref.shape[0]
    for_each_slot(rows_ref, s, slots, _geometry.sparse_trip(slots), visit, spans_ref)


def sparse_call(kernel, x, *, inputs, outputs, scratch, semantics, work, name, interpret):
    """One pallas_call of a sparse kernel over the grid (batch, q block); returns its outputs.

    ``inputs``/``outputs``: operand name -> (spec name in ``sparse_block_specs``, array or
    (shape, dtype)); ``work``: MXU FLOPs of one call, for XLA's scheduling.
    """
    specs = sparse_block_specs(x)
    out_shape = [out_struct(shape, dtype, x.q) for _, (shape, dtype) in outputs.values()]
    moved = sum(a.size * a.dtype.itemsize for _, a in inputs.values())
    moved += sum(
        math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype in (o for _, o in outputs.values())
    )
    return pl.pallas_call(
        kernel,
        grid=(x.batch, x.num_q_blocks),
        in_specs=[specs[spec] for spec, _ in inputs.values()],
        out_specs=[specs[spec] for spec, _ in outputs.values()],
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=semantics, vmem_limit_bytes=x.vmem_limit_bytes
        ),
        cost_estimate=pl.CostEstimate(flops=work, transcendentals=0, bytes_accessed=moved),
        interpret=interpret,
        name=name,
    )(*(a for _, a in inputs.values()))


def sparse_matmul(lhs, rhs, dimension_numbers, precision):
    """``lhs`` against ``rhs`` as ``dimension_numbers`` say, in float32: one MXU pass at ``precision`` when
    both are of one type, save float32 ones at less than HIGHEST. Otherwise each float32 operand is split
    into a bfloat16 head and tail (as ``split_matmul``: ~16 bits kept), the tail against the other's head
    only: two passes with one float32 operand, three with two."""
    if rhs.dtype == lhs.dtype and (lhs.dtype != ACCUM_DTYPE or precision == jax.lax.Precision.HIGHEST):
        return matmul(lhs, rhs, precision, dimension_numbers)
    if rhs.dtype != ACCUM_DTYPE:
        return split_matmul(lhs, rhs, dimension_numbers)
    head, tail = split(rhs, jnp.bfloat16)
    return sparse_matmul(lhs, head, dimension_numbers, precision) + matmul(
        lhs.astype(jnp.bfloat16), tail, None, dimension_numbers
    )


def sparse_logits(q_s, gathered, precision):
    """q_s [H, D] . gathered [top_k, D]^T in float32: every head's logits of one query's selected blocks,
    heads on sublanes and slots on lanes, [H, top_k]: lane-dense (H = 64 as lanes would fill half of
    each vreg, twice the vregs for every elementwise step after it). Float32 rows against a narrower q
    (float8 keys times their scale) take two passes, float32-accurate (``sparse_matmul``)."""
    return sparse_matmul(q_s, gathered, CONTRACT_LAST, precision)


def slots_shape(x):
    """The ``[B, S_pad, top_k_pad]`` shape of a per-slot array of the call ``x`` (``SparseOperands``)."""
    return (x.batch, x.seq_pad, x.top_k_pad)


def sparse_flops(x, passes):
    """MXU FLOPs of a sparse kernel: per query ``passes`` [top_k_pad, D] x [D, H] matmuls."""
    return 2 * x.batch * x.seq_pad * x.top_k_pad * x.num_heads * passes * x.head_dim
