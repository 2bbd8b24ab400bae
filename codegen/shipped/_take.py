"""The dense route's last step: each query's selected slots taken from its row of ``[B, S, W]`` scores
(``take``), and, for the gradient, each slot's cotangent put back at its block (the transpose). Two
Pallas kernels, because XLA's take and its transpose on a TPU move one element at a time: on a v5e
(JAX 0.10.2, S 8192, W 2048, top_k 512) XLA took 44.6 ms and 40.7 ms, these 0.20 ms and 0.92 ms.

- The take: a row block's scores stay in VMEM, 128 blocks (one lane group) at a time; every slot
  reads its lane of that group by a lane gather (``tpu.dynamic_gather``) and keeps it where its
  index falls in the group.
- The transpose: for 8 rows at once, one matmul of one-hots, exact:
  ``A [(group c, row r), (row r', slot j)] = g[r', j] if r == r' and index[r', j] // 128 == c`` against
  ``L [lane l, (r', j)] = index[r', j] % 128 == l``, which gives ``[(c, r), l]``: row r's cotangent at
  block ``128 c + l``, a block selected twice getting both slots'. The one-hots are exact in bfloat16,
  and a float32 cotangent is split into three bfloat16 pieces (24 bits), one pass each.

An index outside ``[0, W)`` takes nothing (0; the caller masks it) and puts nothing back.

Both skip the w tiles a row block selects nothing from (``_tile_spans``, by scalar prefetch, as the
dense kernels skip masked tiles): a causal selection at S 16384 / W 8192 never selects past block
4096, and a row block's selection ends at its queries' causal frontier.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _geometry, _operands
from ._kernel_ops import CONTRACT_LAST
from ._mesh import interpretable, out_struct

LANES = _geometry.LANES
ROWS = 64  # queries a grid step, where S allows (else 8)
GROUP = 8  # rows a transpose matmul: one sublane group
TAKE_LANE_GROUPS = 16  # lane groups of scores a take step reads: 2048 blocks
# The transpose's A is [8 x lane groups, 8 x top_k] float32: a step puts back at most this many
# (lane groups x top_k), so that A stays within [128, 4096] (2 MiB): 16 lane groups at top_k 512, 4 at 2048.
PUT_SLOT_GROUPS = 16 * 512
VMEM_LIMIT_BYTES = 48 * 2**20


def span(indices, width):
    """Each query's span of selected blocks, ``(lowest, highest + 1)`` int32 ``[B, S]`` over its indices
    in ``[0, width)``; ``(width, 0)``, empty, where it selects none: the ``kv_start``, ``kv_end`` the
    dense route scores, and what the kernels' w tile spans follow from."""
    picked = (indices >= 0) & (indices < width)
    lowest = jnp.min(jnp.where(picked, indices, width), axis=2)
    return lowest.astype(jnp.int32), jnp.max(jnp.where(picked, indices + 1, 0), axis=2).astype(jnp.int32)


def take(scores, indices, interpret=False):
    """``scores[b, s, indices[b, s, j]]`` [B, S, top_k] in scores' dtype (0 where the index is outside
    [0, W)); differentiable in ``scores``."""
    return _take(scores, indices, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take(scores, indices, interpret):
    return interpretable(lambda a: _take_call(*a, interpret), (scores, indices), interpret)


def _take_fwd(scores, indices, interpret):
    return _take(scores, indices, interpret), (indices, scores.shape[2])


def _take_bwd(interpret, residual, cotangent):
    indices, width = residual
    put = interpretable(lambda a: _put_call(*a, width, interpret), (cotangent, indices), interpret)
    return put, None


_take.defvjp(_take_fwd, _take_bwd)


def _rows(seq_len):
    return ROWS if seq_len % ROWS == 0 else GROUP


def _padded(x, rows, lanes, fill):
    """``x`` [B, S, n] padded to whole row blocks and lane groups."""
    pad_s, pad_n = -x.shape[1] % rows, -x.shape[2] % lanes
    if pad_s or pad_n:
        x = jnp.pad(x, ((0, 0), (0, pad_s), (0, pad_n)), constant_values=fill)
    return x


def _lane_groups(width, most):
    """Lane groups a step covers: the most, up to ``most``, that divide W's lane groups."""
    groups = width // LANES
    return max(d for d in range(1, min(groups, most) + 1) if groups % d == 0)


def _tile_spans(indices, width, rows, tile):
    """The w tiles each row block selects from, ``(first, end)`` int32 ``[B * S / rows]``: its queries'
    spans bounded as the dense kernels bound a q block's, in tiles; ``(0, 0)`` where it selects none in
    ``[0, width)``. In XLA, before the kernels."""
    any_lo, any_hi, _, _ = _geometry.query_block_bounds(*span(indices, width), rows)
    return any_lo // tile, -(-any_hi // tile)


def _selects(first_ref, end_ref, b, i, j):
    """Whether step (b, i, j)'s row block selects some block of its w tile ``j``."""
    row = b * pl.num_programs(1) + i
    return (first_ref[row] <= j) & (j < end_ref[row])


def _selected_tile(num_row_blocks, b, i, j, first_ref, end_ref):
    """The w tile step (b, i, j) reads: j clamped into the row block's span, so a step that selects
    nothing keeps its neighbour's tile and no DMA is issued."""
    row = b * num_row_blocks + i
    return _operands.clamp(j, first_ref[row], end_ref[row])


def _take_kernel(first_ref, end_ref, indices_ref, scores_ref, out_ref, *, tile):
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    @pl.when(_selects(first_ref, end_ref, b, i, j))
    def _():
        at = indices_ref[...] - j * tile
        group, lane = at >> 7, at & (LANES - 1)
        out = out_ref[...].astype(jnp.float32)
        for c in range(tile // LANES):
            values = scores_ref[:, c * LANES : (c + 1) * LANES].astype(jnp.float32)
            got = jnp.take_along_axis(values, lane, axis=1, mode="promise_in_bounds")
            out = jnp.where(group == c, got, out)
        out_ref[...] = out.astype(out_ref.dtype)


def _take_call(scores, indices, interpret):
    batch, seq_len, scores_width = scores.shape
    top_k = indices.shape[2]
    rows = _rows(seq_len)
    scores = _padded(scores, rows, LANES, 0)
    indices = _padded(indices, rows, LANES, -1)
    width = scores.shape[2]
    tile = LANES * _lane_groups(width, TAKE_LANE_GROUPS)
    num_row_blocks = scores.shape[1] // rows
    by_rows = pl.BlockSpec((None, rows, indices.shape[2]), lambda b, i, j, *_: (b, i, 0))
    tile_at = functools.partial(_selected_tile, num_row_blocks)
    out = pl.pallas_call(
        functools.partial(_take_kernel, tile=tile),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, num_row_blocks, width // tile),
            in_specs=[
                by_rows,
                pl.BlockSpec((None, rows, tile), lambda b, i, j, *s: (b, i, tile_at(b, i, j, *s))),
            ],
            out_specs=by_rows,
        ),
        out_shape=out_struct(indices.shape, scores.dtype, scores),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=VMEM_LIMIT_BYTES
        ),
        cost_estimate=pl.CostEstimate(
            flops=0,
            transcendentals=0,
            bytes_accessed=scores.size * scores.dtype.itemsize + 2 * indices.size * 4,
        ),
        interpret=interpret,
        name="take_slots",
    )(*_tile_spans(indices, scores_width, rows, tile), indices, scores)
    return out[:, :seq_len, :top_k]


def _passes(dtype):
    """bfloat16 pieces a cotangent of ``dtype`` is put back in: itself, or three of a float32 (24 bits)."""
    return 1 if dtype == jnp.bfloat16 else 3


def _pieces(g, dtype):
    """float32 ``g`` as the ``_passes(dtype)`` bfloat16 pieces that sum to it."""
    pieces = []
    for _ in range(_passes(dtype)):
        pieces.append(g.astype(jnp.bfloat16))
        g = g - pieces[-1].astype(jnp.float32)
    return pieces


def _put_kernel(first_ref, end_ref, g_ref, indices_ref, out_ref, *, tile):
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    selects = _selects(first_ref, end_ref, b, i, j)

    @pl.when(jnp.logical_not(selects))
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    @pl.when(selects)
    def _():
        _put_tile(g_ref, indices_ref, out_ref, j * tile, tile)


def _put_tile(g_ref, indices_ref, out_ref, tile_lo, tile):
    """The transpose of one [rows, tile] tile: 8 rows a matmul."""
    rows, slots = g_ref.shape
    groups = tile // LANES
    a_rows = jax.lax.broadcasted_iota(jnp.int32, (groups * GROUP, slots), 0)
    a_row, a_group = a_rows % GROUP, a_rows // GROUP
    lanes = jax.lax.broadcasted_iota(jnp.int32, (LANES, slots), 0)

    def eight_rows(t, carry):
        r0 = pl.multiple_of(t * GROUP, GROUP)
        g = g_ref[pl.ds(r0, GROUP), :].astype(jnp.float32)
        at = indices_ref[pl.ds(r0, GROUP), :] - tile_lo
        group, lane = at >> 7, at & (LANES - 1)
        a = jnp.concatenate(
            [
                jnp.where((a_row == r) & (a_group == group[r : r + 1]), g[r : r + 1], 0.0)
                for r in range(GROUP)
            ],
            axis=1,
        )  # [(c, r), (r', j)]
        one_hot = jnp.concatenate(
            [(lane[r : r + 1] == lanes).astype(jnp.bfloat16) for r in range(GROUP)], axis=1
        )  # [l, (r', j)]
        out = sum(
            jax.lax.dot_general(piece, one_hot, CONTRACT_LAST, preferred_element_type=jnp.float32)
            for piece in _pieces(a, g_ref.dtype)
        )
        for c in range(groups):
            out_ref[pl.ds(r0, GROUP), c * LANES : (c + 1) * LANES] = out[c * GROUP : (c + 1) * GROUP].astype(
                out_ref.dtype
            )
        return carry

    jax.lax.fori_loop(0, rows // GROUP, eight_rows, 0)


def _put_call(cotangent, indices, width, interpret):
    batch, seq_len, _ = cotangent.shape
    rows = _rows(seq_len)
    cotangent = _padded(cotangent, rows, LANES, 0)
    indices = _padded(indices, rows, LANES, -1)
    padded_width = _geometry.round_up(width, LANES)
    slots = indices.shape[2]
    tile = LANES * _lane_groups(padded_width, max(1, PUT_SLOT_GROUPS // slots))
    by_rows = pl.BlockSpec((None, rows, slots), lambda b, i, j, *_: (b, i, 0))
    out = pl.pallas_call(
        functools.partial(_put_kernel, tile=tile),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, cotangent.shape[1] // rows, padded_width // tile),
            in_specs=[by_rows, by_rows],
            out_specs=pl.BlockSpec((None, rows, tile), lambda b, i, j, *_: (b, i, j)),
        ),
        out_shape=out_struct((batch, cotangent.shape[1], padded_width), cotangent.dtype, cotangent),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel"), vmem_limit_bytes=VMEM_LIMIT_BYTES
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * _passes(cotangent.dtype) * batch * cotangent.shape[1] * GROUP * slots * padded_width,
            transcendentals=0,
            bytes_accessed=batch * cotangent.shape[1] * padded_width * cotangent.dtype.itemsize,
        ),
        interpret=interpret,
        name="put_slots",
    )(*_tile_spans(indices, width, rows, tile), cotangent, indices)
    return out[:, :seq_len, :width]
