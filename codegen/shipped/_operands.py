"""What happens to a checked call's inputs before a dense kernel sees them: the variant as the kernels
see it (``Config``), padding to whole tiles, the tile ranges every kernel skips by (``prepare``), and
the ``pallas_call`` that hands them to a kernel, with its index-map helpers and cost estimate."""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _geometry
from ._mesh import out_struct


class Config(NamedTuple):
    """A variant as the shared kernel modules see it: the spec's parameters (its module's ``VARIANT``)
    and the kernel plan's facts that codegen rendered into the module beside them."""

    variant: dict
    sublanes: int  # row granule of a shrunk q block: the native tiling of the narrowest q-row dtype
    precision: jax.lax.Precision  # of the logits matmuls
    grad_matmul: str  # float32 dlogits meet the MXU "split" (two passes), "bf16" (one) or "plain" (float32)
    exact_cotangent: bool  # the cotangent is exact in the MXU type: dk transposes it, masked, in that type
    # MXU passes of dq's masked cotangent by k: 1 (exact, or rounded) or 2 (a head and a tail, each exact)
    cotangent_parts: int
    # kernel -> (MXU passes of a logits-sized matmul, elementwise ops) per (head, query, block), (mask
    # ops per (query, block), whether per head chunk)
    work: dict
    vmem_limit_bytes: dict  # kernel -> the scoped VMEM it is compiled with (None: the chip's default)
    # how the forward walks a tile: "visible_pieces" (``_kernel_ops.each_visible_piece``) or
    # "compute_blocks" (``_kernel_ops.each_compute_block``)
    forward_walk: str
    # The forward writes its score transposed, [B, W, S]: ``score_topk``'s selection kernel reads a
    # query's scores down the sublanes of one lane, so no XLA copy transposes them (``forward``'s
    # ``transposed``; the kernels' tiles go through ``_kernel_ops.store_scores``).
    transposed_out: bool = False

    @property
    def name(self):
        return self.variant["name"]

    @property
    def compute_w(self):
        """Compressed blocks per compute step: the forward's pieces, the split backward's blocks."""
        return self.variant["compute_w"]

    @property
    def fused_compute_w(self):
        """The fused backward kernel's compressed blocks per compute step (dq_dk's)."""
        return self.variant["fused_compute_w"]

    @property
    def head_major(self):
        return self.variant["q_layout"] == "head_major"

    def dtype(self, key):
        """The variant's dtype called ``key`` ("q", "qk_grad", "out", ...)."""
        return jnp.dtype(self.variant[f"{key}_dtype"])


def pad_to(x, axis, size):
    """Zero-pads ``axis`` of ``x`` up to ``size``; returns ``x`` itself (no copy) when it fits already."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def score_shape(x, cfg):
    """The score's shape, [B, S, W], or [B, W, S] where ``cfg.transposed_out``."""
    return (x.batch, x.num_blocks, x.seq_len) if cfg.transposed_out else (x.batch, x.seq_len, x.num_blocks)


def crop_to(x, shape):
    """Slices the padding back off; returns ``x`` itself when there is none."""
    if tuple(x.shape) == tuple(shape):
        return x
    return x[tuple(slice(0, n) for n in shape)]


class TileRanges(NamedTuple):
    """What the kernels skip and mask by: a few int32 per q block and per w tile, scalar-prefetched
    into SMEM, each flattened over the batch (row ``b * num_q_blocks + i``, or ``b * num_w_blocks +
    j``; a 2-D SMEM array could be padded to whole (8, 128) tiles). In all 4 * B * (6 * S_pad /
    block_q + 2 * W_pad / block_w) bytes: 194 KiB of SMEM's 1 MiB at B = 1, S = 1M tokens, W = 262144
    with the production 128 x 1024 tiling. No table per (q block, compute block) is stored."""

    w_lo: jax.Array  # [B * q blocks]: first w tile any query of the q block sees
    w_hi: jax.Array  # one past the last; w_lo == w_hi when it sees none
    any_lo: jax.Array  # [B * q blocks]: no query of the q block sees a block outside [any_lo, any_hi)
    any_hi: jax.Array
    all_lo: jax.Array  # [B * q blocks]: every query of the q block sees all of [all_lo, all_hi)
    all_hi: jax.Array
    q_lo: jax.Array  # [B * w tiles]: first q block that sees the w tile
    q_hi: jax.Array  # one past the last


class Operands(NamedTuple):
    """Kernel-ready operands: padded to whole tiles, laid out so every block is legal on TPU, and the
    visible range of every query, q block and tile."""

    q: jax.Array  # head-major [B, H, S_pad, D]; sequence-major [B, S_pad, H, D]
    k: jax.Array  # [B, W_pad, D]
    weights: (
        jax.Array
    )  # [B, S_pad, H]; head-chunked: [B, H // chunk, S_pad, chunk], a full-width block per chunk
    kv_bounds: jax.Array  # [B, S_pad, 2] int32: each query's visible [kv_start, kv_end); padding sees nothing
    k_scale: jax.Array | None  # [B, 1, W_pad] float32: one row of per-key scales per w block; None: unscaled
    ranges: TileRanges
    batch: int
    num_heads: int
    seq_len: int
    num_blocks: int
    head_dim: int
    seq_pad: int  # S rounded up to whole q tiles
    blocks_pad: int  # W rounded up to whole w tiles
    block_q: int
    block_w: int
    heads: int  # heads per grid step
    # None, or int32 [1]: the q block of ``q`` at which this call's queries start. ``q`` then holds more
    # queries than the call scores and is read in place (``score_topk``'s chunks: no slice of q copied).
    q_at: jax.Array | None = None

    @property
    def num_q_blocks(self):
        return self.seq_pad // self.block_q

    @property
    def num_w_blocks(self):
        return self.blocks_pad // self.block_w

    @property
    def num_chunks(self):
        return self.num_heads // self.heads


def tiles(cfg, seq_len, num_blocks):
    """A call's (block_q, block_w): the variant's, shrunk when the problem is smaller than a tile (to
    whole compute blocks of its forward's and its fused backward's widths)."""
    widths = (cfg.compute_w, cfg.fused_compute_w)
    return _geometry.tiles(
        seq_len, num_blocks, cfg.variant["block_q"], cfg.variant["block_w"], widths, cfg.sublanes
    )


def reads_in_place(variant, seq_len, queries):
    """Whether calls of ``queries`` queries at a time, tiling ``seq_len``, read q in place (``prepare``'s
    ``q_at``): calls that start at whole q blocks and pad nothing. Either layout reads its q blocks
    from the caller's array as it lies in HBM."""
    return queries % variant["block_q"] == 0 and seq_len % queries == 0


def prepare(cfg, q, k, weights, kv_start, kv_end, k_scale, q_at=None):
    """The kernel-ready ``Operands`` of a checked call to the variant ``cfg``: padded to whole tiles,
    with tile ranges.

    ``q_at``: None, or (int32 scalar) the first of this call's queries in a ``q`` that holds
    more queries than ``weights`` and the bounds (the call's), read in place (``reads_in_place``)."""
    variant = cfg.variant
    # An input upcast to float32 (to have its gradient summed over mesh axes in float32: see
    # vary_together) goes back to the variant's dtype, exactly; otherwise these do nothing.
    q, k, weights = q.astype(cfg.dtype("q")), k.astype(cfg.dtype("k")), weights.astype(cfg.dtype("weights"))
    batch, seq_len, num_heads = weights.shape
    head_dim, num_blocks = k.shape[2], k.shape[1]
    block_q, block_w = tiles(cfg, seq_len, num_blocks)
    seq_pad, blocks_pad = _geometry.round_up(seq_len, block_q), _geometry.round_up(num_blocks, block_w)
    if q_at is not None:
        q_at = jnp.reshape(q_at // block_q, (1,)).astype(jnp.int32)
    else:  # the kernels read q's blocks as it lies in HBM: nothing is copied unless S is padded
        q = pad_to(q, 2 if cfg.head_major else 1, seq_pad)
    weights = pad_to(weights, 1, seq_pad)
    chunk = variant["head_chunk"] or num_heads
    if variant["head_chunk"]:
        # [B, S, H] -> [B, H // chunk, S, chunk]: a copy of S * H elements, far below S * W.
        weights = weights.reshape(batch, seq_pad, num_heads // chunk, chunk).transpose(0, 2, 1, 3)
    kv_start, kv_end = kv_bounds(kv_start, kv_end, num_blocks, seq_pad)
    ranges = tile_ranges(kv_start, kv_end, block_q, block_w, blocks_pad // block_w)
    bounds = jnp.stack([kv_start, kv_end], axis=-1)
    if k_scale is not None:  # one row of per-key scales per w tile
        k_scale = pad_to(k_scale, 1, blocks_pad)[:, None, :]
    return Operands(
        q, pad_to(k, 1, blocks_pad), weights, bounds, k_scale, ranges,
        batch, num_heads, seq_len, num_blocks, head_dim, seq_pad, blocks_pad, block_q, block_w,
        chunk,
        q_at,
    )  # fmt: skip


def grad_dtype(x, dtype):
    """The dtype of x's gradient: float32 when x arrived upcast to float32 (see ``vary_together``: its
    gradient is summed over mesh axes before it is rounded), else the variant's ``dtype`` for it."""
    return jnp.float32 if x.dtype == jnp.float32 else dtype


def tile_ranges(kv_start, kv_end, block_q, block_w, num_w_blocks):
    """``TileRanges`` of a call: which q blocks and w tiles have any work together, and each q block's
    bounds.

    ``kv_start``, ``kv_end``: int32 [B, S_pad], clipped to [0, W]. A q block's w tiles with work are
    contiguous (they cover [any_lo, any_hi)); a w tile's q blocks may have holes, so [q_lo, q_hi) only
    bounds them and the kernels classify every compute block exactly.
    """
    batch = kv_start.shape[0]
    any_lo, any_hi, all_lo, all_hi = _geometry.query_block_bounds(kv_start, kv_end, block_q)
    w_lo, w_hi = any_lo // block_w, -(-any_hi // block_w)  # 0, 0 for a q block that sees nothing
    w_tiles = jnp.arange(num_w_blocks, dtype=jnp.int32)
    active = (w_lo[:, None] <= w_tiles) & (w_tiles < w_hi[:, None])
    active = active.reshape(batch, -1, num_w_blocks)  # [B, q blocks, w tiles]
    any_active = jnp.any(active, axis=1)
    num_q_blocks = active.shape[1]
    q_lo = jnp.where(any_active, jnp.argmax(active, axis=1), 0).astype(jnp.int32)
    q_hi = jnp.where(any_active, num_q_blocks - jnp.argmax(active[:, ::-1], axis=1), 0).astype(jnp.int32)
    return TileRanges(w_lo, w_hi, any_lo, any_hi, all_lo, all_hi, q_lo.reshape(-1), q_hi.reshape(-1))


def kv_bounds(kv_start, kv_end, num_blocks, seq_pad):
    """Each query's [kv_start, kv_end) clipped to the blocks that exist, padding queries seeing nothing:
    (int32 [B, S_pad] start, end)."""
    clip = lambda bound: pad_to(jnp.clip(bound.astype(jnp.int32), 0, num_blocks), 1, seq_pad)
    return clip(kv_start), clip(kv_end)


# Index maps: a grid step whose tile no query may see points every block at one already in VMEM.


def clamp(x, lo, hi):
    """x clamped into the half-open [lo, hi) (to lo when it is empty)."""
    return jnp.minimum(jnp.maximum(x, lo), jnp.maximum(hi - 1, lo))


def park(x, lo, hi):
    """``x``, or 0 where ``[lo, hi)`` is empty: the q block (w tile) of a step has no work at all, so its
    tiles are never read, and naming block 0's lets a run of such steps fetch nothing. (On a v5e the
    forward's call with every block masked took 0.27 ms fetching each q block, 0.13 ms parked.)"""
    return jnp.where(lo < hi, x, 0)


def hold(c, x, lo, hi, num_chunks):
    """The head chunk a step keeps when ``x`` lies outside [lo, hi): that of the neighbouring step that
    does work (the first chunk before the range, the last after it)."""
    return jnp.where((lo <= x) & (x < hi), c, jnp.where(x < lo, 0, num_chunks - 1))


def kernel_call(kernel, x, cfg, *, name, grid_axes, grid, semantics, reads, writes, scalar_prefetch, inputs,
                outputs, scratch, block_specs, follows, interpret):  # fmt: skip
    """Runs one pallas_call of a dense kernel ``name`` of the variant ``cfg``; returns its outputs.

    ``grid``: the extents of the grid axes ``grid_axes`` (b batch, i q block, j w tile, c head chunk),
    outermost first. ``reads``, ``writes``: (*grid indices, *scalar-prefetch refs) -> the (b, c, i, j)
    whose tiles a grid step reads (a step with no work keeps its neighbour's, so nothing is fetched)
    and writes. ``block_specs(x, at)``: every operand's BlockSpec at those points. ``inputs``,
    ``outputs``: operand name -> array / ShapeDtypeStruct, in kernel argument order; ``follows``: the
    grid axes each operand's block index moves with, for the cost estimate.
    """
    in_specs, out_specs = block_specs(x, reads), block_specs(x, writes)
    if cfg.transposed_out:  # the score's tiles at (b, j, i) of [B, W, S]
        out_specs["out"] = _transposed(out_specs["out"])
        struct = outputs["out"]
        outputs = {
            **outputs,
            "out": jax.ShapeDtypeStruct((*struct.shape[:-2], *struct.shape[:-3:-1]), struct.dtype),
        }
    if x.q_at is not None:  # q read in place: its block index moves by q_at, a last scalar prefetch
        q_block = next(name for name, array in inputs.items() if array is x.q)  # "q" or "q_all_heads"
        in_specs[q_block] = _shifted(in_specs[q_block], 2 if cfg.head_major else 1)
        kernel = _without_last_prefetch(kernel, len(scalar_prefetch))
        scalar_prefetch = (*scalar_prefetch, x.q_at)
    operands = {**inputs, **outputs}
    blocks = [(out_specs[n], a, follows[n]) for n, a in operands.items()]
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_prefetch),
            grid=grid,
            in_specs=[in_specs[n] for n in inputs],
            out_specs=[out_specs[n] for n in outputs],
            scratch_shapes=scratch,
        ),
        # Inside jax.shard_map every output varies over the manual axes the (cast-together) inputs do.
        out_shape=[out_struct(o.shape, o.dtype, x.q) for o in outputs.values()],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=semantics, vmem_limit_bytes=cfg.vmem_limit_bytes[name]
        ),
        cost_estimate=cost_estimate(grid_axes, grid, blocks, cfg.work[name], x),
        interpret=interpret,
        name=f"{cfg.name}_{name}",
    )(*scalar_prefetch, *inputs.values())


def _shifted(spec, axis):
    """``spec`` with its block index along ``axis`` moved by the last scalar-prefetch ref's value."""

    def index(*grid_and_refs):
        at = list(spec.index_map(*grid_and_refs))
        at[axis] = at[axis] + grid_and_refs[-1][0]
        return tuple(at)

    return pl.BlockSpec(spec.block_shape, index)


def _transposed(spec):
    """``spec`` of the transposed array: its last two block dims and block indices swapped."""

    def index(*grid_and_refs):
        *lead, i, j = spec.index_map(*grid_and_refs)
        return (*lead, j, i)

    *lead, rows, cols = spec.block_shape
    return pl.BlockSpec((*lead, cols, rows), index)


def _without_last_prefetch(kernel, count):
    """``kernel`` called without the scalar-prefetch ref after its first ``count`` (the index maps' only)."""
    return functools.wraps(kernel)(lambda *refs: kernel(*refs[:count], *refs[count + 1 :]))


# Cost estimates, so XLA can schedule around each pallas_call.


def cost_estimate(grid_axes, grid, blocks, work, x):
    """pl.CostEstimate of one pallas_call: its work over every tile, and HBM bytes as the pipeline
    moves them (a block is fetched, or written back, whenever its index changes between grid steps).
    Compute blocks and tiles skipped under a mask are not discounted.

    ``blocks``: (BlockSpec, array or ShapeDtypeStruct, grid axes its index follows) per operand;
    ``work``: (MXU passes of a logits-sized matmul, elementwise operations) per entry, the mask's
    operations per (query, compressed block), built per head chunk or once, at each q block's last
    step, per (head, query, d) of q, elementwise operations and MXU FLOPs per head of the step, and at
    each w tile's last step MXU FLOPs per (compressed block, d) of k.
    """
    moved = 0
    for spec, array, follows in blocks:
        fetches = _geometry.block_fetches(grid, [grid_axes.index(a) for a in follows if a in grid_axes])
        block = [d for d in spec.block_shape if isinstance(d, int)]
        moved += fetches * math.prod(block) * jnp.dtype(array.dtype).itemsize
    mxu_passes, vpu_ops, mask_ops, mask_per_chunk, finish_vpu_ops, finish_mxu_per_head, finish_mxu_per_key = (
        work
    )
    entries = x.batch * x.num_heads * x.seq_pad * x.blocks_pad
    masks = x.batch * x.seq_pad * x.blocks_pad * mask_ops * (x.num_chunks if mask_per_chunk else 1)
    finished = x.batch * x.seq_pad * x.num_heads * x.head_dim
    flops = entries * (2 * x.head_dim * mxu_passes + vpu_ops) + masks
    flops += finished * (finish_vpu_ops + finish_mxu_per_head * x.heads)
    flops += x.batch * x.blocks_pad * x.head_dim * finish_mxu_per_key
    return pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=moved)
