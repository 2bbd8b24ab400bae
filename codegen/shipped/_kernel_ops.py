"""Pieces of the dense kernel bodies that no variant changes: the compute blocks (the backward) and
visible pieces (the forward) a tile is worked in, and its masks, the matmul policies (plain, split
into a head and a tail, rounded), and the backward's gradient arithmetic (cotangents, dq and
dweights from u, dk). They run on VMEM values and SMEM scalars inside a kernel; the sparse kernels
share the matmul pieces."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _family
from . import _geometry
from ._fp8 import upcast

MASKED_VALUE = _family.MASKED_VALUE  # every entry a query may not see
ACCUM_DTYPE = jnp.float32  # every dtype policy accumulates in float32
GRAD_HEAD_GROUP = _geometry.GRAD_HEAD_GROUP  # heads per matmul of the backward kernels
# q_h [rows, D] . k [cols, D]^T: contract the last dimension of both.
CONTRACT_LAST = (((1,), (1,)), ((), ()))
# lhs [m, n] . rhs [n, p]: an ordinary matmul.
CONTRACT_INNER = (((1,), (0,)), ((), ()))
# lhs [n, m] . rhs [n, p] -> [m, p]: contract the first dimension of both (dlogitsᵀ . k, no transpose).
# Mosaic's TPU lowering accepts it (and the one-deep g wᵀ of the sparse backward) for [top_k, H] and
# [top_k, D] operands: verified by lowering on a CPU only, as are the sparse kernels.
CONTRACT_FIRST = (((0,), (0,)), ((), ()))


class ComputeBlock(NamedTuple):
    """Compressed blocks of a w tile computed together, seen from the grid step's q block: a compute
    block (``each_compute_block``) or a piece of the forward's walk (``each_visible_piece``)."""

    cols: slice | pl.Slice  # its columns in the tile: static, or an aligned dynamic slice
    width: int  # its compressed blocks: the call's compute width (``_geometry.call_compute_w``), or a tail's
    lo: jax.Array  # its first compressed block
    work: jax.Array  # bool: some query of the q block may see some of it (else: no matmul, no elementwise op)
    opens: jax.Array  # bool, with work: the first such block of the q block's row (any_lo falls in it)


def each_compute_block(bounds_refs, row, j, block_w, compute_w):
    """Runs the decorated ``body(block)`` on each compute block of w tile ``j``, each with work unless
    ``_geometry.block_empty`` by the bounds of the q block at ``row`` of the flattened per-q-block
    arrays: (any_lo, any_hi) refs. Only an empty block is branched on: a block with work is masked
    whether or not it needs it (a select per entry costs fewer bundles than the branch that would skip it).

    Several compute blocks run as a loop, not unrolled: the kernel's code then holds one block's
    bundles, not one copy per block. On a v5e the unrolled forward (four blocks of 33,000 bundles)
    took 1.78 ms where the loop takes 1.52, and 0.89 ms for a call in which every block is masked, where
    the loop takes 0.27: the chip pays for code it jumps over, which the compiled schedule does not show."""
    any_lo, any_hi = bounds_refs[0][row], bounds_refs[1][row]
    compute_w = _geometry.call_compute_w(block_w, compute_w)

    def block(n, cols):
        lo = j * block_w + n * compute_w
        empty = _geometry.block_empty(any_lo, any_hi, lo, lo + compute_w)
        return ComputeBlock(cols, compute_w, lo, jnp.logical_not(empty), lo <= any_lo)

    def run(body):
        if block_w == compute_w:
            body(block(0, slice(0, compute_w)))
            return

        def step(n, carry):
            body(block(n, pl.ds(pl.multiple_of(n * compute_w, compute_w), compute_w)))
            return carry

        jax.lax.fori_loop(0, block_w // compute_w, step, 0)

    return run


def each_visible_piece(bounds_refs, row, j, block_w, compute_w):
    """Runs the decorated ``body(piece)`` on the pieces ``_geometry.visible_pieces`` covers the visible
    blocks of w tile ``j`` with, for the q block at ``row`` (any_lo, any_hi refs): a loop of
    ``block_w // compute_w`` trips whose first ``big`` have work (the rest none: the columns they
    would start at may lie past the tile), then one piece per ``_geometry.tail_widths``, with work
    where ``rest`` holds it. No piece overlaps another, and none reaches past the tile. The forward
    walks this way: its tile is stored masked first (``fill_masked``), so the columns no piece covers
    need no store.

    A band of an eighth of W computes 21% of each tile where whole compute blocks compute 39% (512) or
    27% (256); on a v5e (prototype, S 8192) its forward went from 0.32 to 0.22 x the stacked baseline,
    nothing else moving (docs/performance.md, "Covering the visible columns")."""
    any_lo, any_hi = bounds_refs[0][row], bounds_refs[1][row]
    compute_w = _geometry.call_compute_w(block_w, compute_w)
    tile_lo = j * block_w
    start, big, rest = _geometry.visible_pieces(any_lo, any_hi, tile_lo, block_w, compute_w)

    def piece(at, width, work):
        cols = slice(0, width) if width == block_w else pl.ds(pl.multiple_of(at, _geometry.LANES), width)
        return ComputeBlock(cols, width, tile_lo + at, work, tile_lo + at <= any_lo)

    def run(body):
        if block_w == compute_w:  # one piece of the whole tile, or none: then the tails cover it
            body(piece(0, compute_w, big > 0))
        else:

            def step(n, carry):
                body(piece(start + n * compute_w, compute_w, n < big))
                return carry

            jax.lax.fori_loop(0, block_w // compute_w, step, 0)
        at = start + big * compute_w
        for width in _geometry.tail_widths(compute_w):
            take = jnp.bitwise_and(rest, width) != 0
            body(piece(at, width, take))
            at = at + jnp.where(take, width, 0)

    return run


def forward_walk(cfg):
    """The forward's walk over a tile, as the variant's plan chose it (``cfg.forward_walk``)."""
    return each_visible_piece if cfg.forward_walk == "visible_pieces" else each_compute_block


def fill_masked(out_ref):
    """Stores the masked value into every entry of a score block."""
    out_ref[...] = jnp.full(out_ref.shape, MASKED_VALUE, out_ref.dtype)


def row_has_work(bounds_refs, row):
    """Whether some query of the q block at ``row`` may see some compressed block: (any_lo, any_hi) refs."""
    return bounds_refs[0][row] < bounds_refs[1][row]


def added(read, x, add):
    """``x`` plus what ``read()`` gives, as ``add`` says: False (no read), True, or a traced bool (a select,
    so that what is not added may be anything, never-written memory included)."""
    if add is False:
        return x
    if add is True:
        return read() + x
    return x + jnp.where(add, read(), 0.0)


def mask(block, x, kv_bounds_ref, fill):
    """``x`` [block_q, compute_w] where query row r may see compressed block ``block.lo + col``, ``fill``
    elsewhere."""
    bounds = kv_bounds_ref[...]  # kv_start, kv_end of each query
    blocks = block.lo + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.where((bounds[:, 0:1] <= blocks) & (blocks < bounds[:, 1:2]), x, fill)


def store_scores(cfg, out_ref, block, scores, kv_bounds_ref):
    """Stores ``block``'s float32 score tile ``scores`` [block_q, width], masked, at its columns of the
    out block, or (``cfg.transposed_out``) its transpose, by the XLU, at those rows of the
    [block_w, block_q] block."""
    scores = mask(block, scores, kv_bounds_ref, MASKED_VALUE)
    if cfg.transposed_out:
        out_ref[block.cols, :] = scores.T.astype(out_ref.dtype)
    else:
        out_ref[:, block.cols] = scores.astype(out_ref.dtype)


def head_groups(heads):
    """Static slices of ``heads`` heads, GRAD_HEAD_GROUP at a time: the backward kernels stack a group
    against the key block per matmul, so only a group's logits and dlogits are held at once."""
    for start in range(0, heads, GRAD_HEAD_GROUP):
        yield slice(start, min(start + GRAD_HEAD_GROUP, heads))


def matmul(lhs, rhs, precision, dimension_numbers=CONTRACT_INNER):
    """lhs . rhs in float32 (an ordinary lhs [m, n] . rhs [n, p] by default), both operands of one type."""
    return jax.lax.dot_general(
        lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=ACCUM_DTYPE
    )


def split_matmul(lhs, rhs, dimension_numbers=CONTRACT_INNER):
    """float32 lhs of a narrower MXU type's rhs, contracted as ``dimension_numbers`` say (an ordinary
    lhs [m, n] . rhs [n, p] by default), accurate to float32.

    Rounding the float32 lhs to rhs's type would cost up to 2**-8 relative per element (bfloat16);
    splitting it into a head and a tail of that type keeps ~16 bits for the price of a second MXU
    pass (rhs is exact).
    """
    head, tail = split(lhs, rhs.dtype)
    return matmul(head, rhs, None, dimension_numbers) + matmul(tail, rhs, None, dimension_numbers)


def split(x, dtype):
    """float32 ``x`` as a head and a tail of the narrower ``dtype`` whose sum keeps ~16 bits of it."""
    head = x.astype(dtype)
    return head, (x - head.astype(x.dtype)).astype(dtype)


def grad_matmul(cfg, lhs, rhs, dimension_numbers=CONTRACT_INNER):
    """float32 dlogits ``lhs`` against ``rhs`` (k, or the stacked q) in float32, as the variant's plan
    says: "split" into a head and a tail of the MXU type (two passes, float32-accurate), "bf16": rounded
    to it (one pass), or "plain": one pass at the variant's precision (float32 operands)."""
    if cfg.grad_matmul == "split":
        return split_matmul(lhs, rhs, dimension_numbers)
    if cfg.grad_matmul == "bf16":
        return matmul(lhs.astype(rhs.dtype), rhs, None, dimension_numbers)
    return matmul(lhs, rhs, cfg.precision, dimension_numbers)


def grad_matmul_rhs(cfg, lhs, rhs):
    """``lhs`` [m, n], exact in the MXU type, times float32 ``rhs`` [n, p], in float32, as the variant's
    plan says: rhs "split" into a head and a tail, side by side as one ``[n, 2 p]`` operand (two
    passes of work in one matmul: at p = 128 the tail fills the half of a 256-wide MXU's columns the
    head leaves idle), rounded ("bf16", one pass), or "plain"."""
    if cfg.grad_matmul == "split":
        width = rhs.shape[1]
        both = matmul(lhs, jnp.concatenate(split(rhs, lhs.dtype), axis=1), None)
        return both[:, :width] + both[:, width:]
    if cfg.grad_matmul == "bf16":
        return matmul(lhs, rhs.astype(lhs.dtype), None)
    return matmul(lhs, rhs, cfg.precision)


# The backward kernels' gradient arithmetic: a group of heads' logits [n, block_q, compute_w], the
# cotangent g [block_q, compute_w] and weights [n, block_q, 1], in float32.


def relu_grad(logits, g, dtype):
    """g where the logit is positive, else 0, ``[n * block_q, compute_w]`` in ``dtype`` (the MXU type: exact
    there when the cotangent is, ``Config.exact_cotangent``, or a part of it is, ``cotangent_parts``)."""
    return jnp.where(logits > 0.0, g, 0.0).reshape(-1, logits.shape[2]).astype(dtype)


def cotangent_parts(cfg, g, dtype):
    """The float32 cotangent ``g`` [block_q, compute_w] as the MXU takes it in ``dtype``, parts that sum to
    it: itself (exact there, or to be rounded), or a head and a tail each exact in ``dtype``
    (``cfg.cotangent_parts`` == 2: ~16 bits of a float32 g), split once for all heads of the block."""
    if cfg.cotangent_parts == 2:
        return tuple(part.astype(jnp.float32) for part in split(g, dtype))
    return (g,)


def masked_cotangent_by_k(cfg, logits, g, k):
    """u = (g where the logit is positive) . k of a group of heads, ``[n * block_q, D]`` float32 (rows
    stacked as the group's q is): one MXU pass per part of g (``cotangent_parts``), each exact in k's
    type or rounded to it. Only the select is done per (head, query, block) and part; the weights and q
    act on u, summed over the blocks (``dq_dweights_from_u``)."""
    u = [matmul(relu_grad(logits, part, k.dtype), k, cfg.precision) for part in g]
    return sum(u[1:], u[0])


def dq_dweights_from_u(u, q, weights):
    """dq and dweights of a group of heads from u (``masked_cotangent_by_k``, summed over any number of
    compute blocks): dq = w_h * u (a head's weight is constant along its rows; ``weights`` is shaped as
    the logits stack the heads, ``[n, block_q, 1]`` head-major or ``[block_q, n, 1]`` sequence-major,
    or already broadcast along D) and, since relu(logit) g = relu'(logit) g (q . k_w), dweights =
    sum_d q * u. ``[rows, D]`` (stacked as u) and ``weights.shape[:2] + (1,)`` (as the lane sum leaves
    it) float32, before the softmax scale."""
    u = u.reshape(*weights.shape[:2], -1)
    dweights = jnp.sum(upcast(q, jnp.float32).reshape(u.shape) * u, axis=2, keepdims=True)
    return (u * weights).reshape(-1, u.shape[2]), dweights


def lane_broadcast(x, column, width):
    """``x[:, column]`` broadcast across ``width`` lanes, ``[rows, width]`` float32, by the MXU (x times a
    one-hot ``[columns, width]``, exact): a lane broadcast costs the XLU an operation per vreg. (The
    head-major dq finish's weights; sequence-major has them along sublanes already.)"""
    one_hot = jax.lax.broadcasted_iota(jnp.int32, (x.shape[1], width), 0) == column
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return matmul(x, one_hot.astype(x.dtype), precision)


def rows_across(row, width):
    """A float32 row ``[1, n]`` as a column broadcast across ``width`` lanes, ``[n, width]``: each value
    times ones by the MXU (exact at HIGHEST), where moving it from lanes to sublanes costs the XLU."""
    ones = jnp.ones((1, width), jnp.float32)
    return jax.lax.dot_general(
        row, ones, CONTRACT_FIRST, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def row_sums(x):
    """The sums along the lanes of float32 ``x`` [n, d] as a lane-dense row ``[1, n]``: ones times xᵀ by
    the MXU at HIGHEST, which leaves the sums where a row of them is wanted."""
    ones = jnp.ones((1, x.shape[1]), jnp.float32)
    return jax.lax.dot_general(
        ones, x, CONTRACT_LAST, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def dlogits(logits, g, weights):
    """d score / d logits of a group of heads, ``[n * block_q, compute_w]`` float32: g * weights_h where
    the logit is positive (relu' = 1[x > 0]), else 0; rows stacked as the group's q is."""
    return jnp.where(logits > 0.0, g * weights, 0.0).reshape(-1, logits.shape[2])


def dk(cfg, logits, g, weights, q):
    """dk of one compute block from a group of heads before the softmax scale, ``[compute_w, D]`` float32:
    dlogits transposed times the stacked q. A head's weight is constant along a row of dlogits, so
    along the same row of q: where the cotangent is exact in the MXU type (``cfg.exact_cotangent``) the
    weights go onto q, and the masked g is transposed in the MXU type and meets the weighted q
    ``[rows, D]`` as ``cfg.grad_matmul`` says (the product and any split on [rows, D], not on
    [rows, compute_w]); else float32 dlogits are transposed once, before a split would make two tiles
    of them to transpose."""
    if cfg.exact_cotangent:
        weighted_q = (q.astype(jnp.float32).reshape(*weights.shape[:2], -1) * weights).reshape(q.shape)
        return grad_matmul_rhs(cfg, relu_grad(logits, g, q.dtype).T, weighted_q)
    return grad_matmul(cfg, dlogits(logits, g, weights).T, q)
