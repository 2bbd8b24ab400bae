"""What every variant of a family shares, written once: the call contract (input checks), padding
and tile ranges, the pieces of kernel bodies and wrappers that do not depend on a variant, the cost
estimate, meshes, and the family's public helpers. Like the variant modules, it needs only JAX.

``codegen render`` copies this file into every family package as it is (from
``codegen/shipped/_runtime.py``); its few family constants come from the rendered ``_family``.
"""

import difflib
import functools
import inspect
import math
import operator
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _family
from . import _geometry

COMPRESS_RATE = _family.COMPRESS_RATE  # tokens per compressed block in this family's spec
MASKED_VALUE = _family.MASKED_VALUE  # every entry a query may not see
DEFAULT_SOFTMAX_SCALE = _family.DEFAULT_SOFTMAX_SCALE  # None: head_dim ** -0.5, taken from q at call time
ACCUM_DTYPE = jnp.float32  # every dtype policy accumulates in float32
SPARSE_BLOCK_Q = _geometry.SPARSE_BLOCK_Q  # queries per grid step of the sparse kernels
GRAD_HEAD_GROUP = _geometry.GRAD_HEAD_GROUP  # heads per matmul of the backward kernels
tiles = _geometry.tiles  # a call's (block_q, block_w), shrunk to the problem
# q_h [rows, D] . k [cols, D]^T: contract the last dimension of both.
CONTRACT_LAST = (((1,), (1,)), ((), ()))
# lhs [m, n] . rhs [n, p]: an ordinary matmul.
CONTRACT_INNER = (((1,), (0,)), ((), ()))


# The call contract: every check runs on shapes and dtypes, before anything is traced.


def q_dims(q, q_layout):
    """(batch, num_heads, seq_len, head_dim) of q in ``q_layout``."""
    if q_layout == "head_major":
        batch, num_heads, seq_len, head_dim = q.shape
    else:
        batch, seq_len, num_heads, head_dim = q.shape
    return batch, num_heads, seq_len, head_dim


class Variants(dict):
    """The family's variant modules by name; an unknown name is a KeyError that suggests close ones."""

    def __missing__(self, name):
        close = difflib.get_close_matches(str(name), self.keys(), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"the {len(self)} names are VARIANTS.keys()"
        raise KeyError(f"no variant named {name!r}; {hint}")


def check_inputs(q, k, weights, variant):
    """Raises ValueError naming the argument whose rank, shape or dtype does not fit ``variant``."""
    q_layout = "[B, H, S, D]" if variant["q_layout"] == "head_major" else "[B, S, H, D]"
    for name, array, layout in (("q", q, q_layout), ("k", k, "[B, W, D]"), ("weights", weights, "[B, S, H]")):
        if not hasattr(array, "shape") or not hasattr(array, "dtype"):
            raise ValueError(f"{name} must be an array {layout}, got {type(array).__name__}")
        if array.ndim != layout.count(",") + 1:
            raise ValueError(
                f"{name} must have rank {layout.count(',') + 1} {layout}, got shape {tuple(array.shape)}"
            )
    for name, array in (("q", q), ("k", k), ("weights", weights)):
        dtype = variant[f"{name}_dtype"]
        if array.dtype != jnp.dtype(dtype):
            raise ValueError(f"{name} must be {dtype} for variant {variant['name']}, got {array.dtype}")
    batch, num_heads, seq_len, head_dim = q_dims(q, variant["q_layout"])
    if seq_len < 1 or num_heads < 1 or head_dim < 1:
        raise ValueError(f"q must have at least one query, head and feature, got shape {tuple(q.shape)}")
    if k.shape[0] != batch or k.shape[2] != head_dim or k.shape[1] < 1:
        raise ValueError(
            f"k must be [B={batch}, W>=1, D={head_dim}] to match q {tuple(q.shape)}, got shape {tuple(k.shape)}"
        )
    if tuple(weights.shape) != (batch, seq_len, num_heads):
        other = "seq_major" if variant["q_layout"] == "head_major" else "head_major"
        b, h, s, _ = q_dims(q, other)
        if tuple(weights.shape) == (b, s, h):  # q fits the other layout: say so, not that weights is wrong
            raise ValueError(
                f"q {tuple(q.shape)} looks {other}, but variant {variant['name']} is {variant['q_layout']}: it "
                f"takes q as {q_layout}; transpose q (jnp.swapaxes(q, 1, 2)) or use a {other} variant"
            )
        raise ValueError(
            f"weights must be [B={batch}, S={seq_len}, H={num_heads}] to match q {tuple(q.shape)}, "
            f"got shape {tuple(weights.shape)}"
        )
    chunk = variant["head_chunk"]
    if chunk and num_heads % chunk:
        raise ValueError(
            f"q has {num_heads} heads, which head_chunk {chunk} of variant {variant['name']} does not divide"
        )


def check_scale(softmax_scale):
    """The scale is static (it is baked into the kernel): a positive, finite Python number."""
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise ValueError(f"softmax_scale must be a positive Python float, got {softmax_scale!r}") from None
    if not 0.0 < scale < float("inf"):
        raise ValueError(f"softmax_scale must be positive and finite, got {scale}")
    return scale


def check_kv_bound(name, bound, shape, default):
    """An integer [B, S] visibility bound as int32; ``default`` everywhere when None."""
    if bound is None:
        return jnp.full(shape, default, jnp.int32)
    if not hasattr(bound, "shape") or not hasattr(bound, "dtype"):
        raise ValueError(f"{name} must be an integer array [B, S], got {type(bound).__name__}")
    if tuple(bound.shape) != shape:
        raise ValueError(
            f"{name} must be [B={shape[0]}, S={shape[1]}] to match q, got shape {tuple(bound.shape)}"
        )
    if not jnp.issubdtype(bound.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array (int32), got {bound.dtype}")
    return jnp.asarray(bound, jnp.int32)


def check_k_scale(k_scale, shape, variant):
    """float32 [B, W] per-token key scales, required by variants whose keys carry one and refused by
    the others (passing one there is a mistake, not something to ignore)."""
    if not variant["k_scale"]:
        if k_scale is not None:
            raise ValueError(
                f"k_scale applies to float8 variants only; variant {variant['name']} stores k as {variant['k_dtype']}"
            )
        return None
    if k_scale is None:
        raise ValueError(
            f"k_scale is required by variant {variant['name']}: its float8 keys carry a per-token scale"
        )
    if not hasattr(k_scale, "shape") or tuple(k_scale.shape) != tuple(shape) or k_scale.dtype != jnp.float32:
        raise ValueError(
            f"k_scale must be float32 [B={shape[0]}, W={shape[1]}] to match k, got "
            f"{getattr(k_scale, 'dtype', type(k_scale).__name__)} {tuple(getattr(k_scale, 'shape', ()))}"
        )
    return k_scale


def check_call(variant, q, k, weights, kv_start, kv_end, k_scale, softmax_scale):
    """Raises ValueError naming the argument that does not fit ``variant``; returns ``(kv_start, kv_end,
    k_scale, softmax_scale)`` completed: int32 bounds (the defaults filled in) and the scale as a float."""
    check_inputs(q, k, weights, variant)
    batch, _, seq_len, _ = q_dims(q, variant["q_layout"])
    kv_start = check_kv_bound("kv_start", kv_start, (batch, seq_len), 0)
    kv_end = check_kv_bound("kv_end", kv_end, (batch, seq_len), k.shape[1])
    k_scale = check_k_scale(k_scale, k.shape[:2], variant)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5 if DEFAULT_SOFTMAX_SCALE is None else DEFAULT_SOFTMAX_SCALE
    return kv_start, kv_end, k_scale, check_scale(softmax_scale)


# The variant as the shared kernels see it.


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

    @property
    def name(self):
        return self.variant["name"]

    @property
    def compute_w(self):
        """Compressed blocks per compute step: the granule of skipping and masking."""
        return self.variant["compute_w"]

    @property
    def head_major(self):
        return self.variant["q_layout"] == "head_major"

    def dtype(self, key):
        """The variant's dtype called ``key`` ("q", "qk_grad", "out", ...)."""
        return jnp.dtype(self.variant[f"{key}_dtype"])


# Padding and tiles.


def pad_to(x, axis, size):
    """Zero-pads ``axis`` of ``x`` up to ``size``; returns ``x`` itself (no copy) when it fits already."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


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

    q: jax.Array  # head-major [B, H, S_pad, D]; sequence-major [B, S_pad, H * D], a head per D lanes
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
    compute_w: int  # compressed blocks per compute step inside a block_w tile
    heads: int  # heads per grid step

    @property
    def num_q_blocks(self):
        return self.seq_pad // self.block_q

    @property
    def num_w_blocks(self):
        return self.blocks_pad // self.block_w

    @property
    def num_chunks(self):
        return self.num_heads // self.heads


def prepare(cfg, q, k, weights, kv_start, kv_end, k_scale):
    """The kernel-ready ``Operands`` of a checked call to the variant ``cfg``: padded to whole tiles,
    with tile ranges."""
    variant = cfg.variant
    # An input upcast to float32 (to have its gradient summed over mesh axes in float32: see
    # vary_together) goes back to the variant's dtype, exactly; otherwise these do nothing.
    q, k, weights = q.astype(cfg.dtype("q")), k.astype(cfg.dtype("k")), weights.astype(cfg.dtype("weights"))
    batch, num_heads, seq_len, head_dim = q_dims(q, variant["q_layout"])
    num_blocks = k.shape[1]
    block_q, block_w = _geometry.tiles(
        seq_len, num_blocks, variant["block_q"], variant["block_w"], cfg.compute_w, cfg.sublanes
    )
    seq_pad, blocks_pad = _geometry.round_up(seq_len, block_q), _geometry.round_up(num_blocks, block_w)
    if cfg.head_major:
        q = pad_to(q, 2, seq_pad)
    else:
        q = pad_to(q, 1, seq_pad).reshape(batch, seq_pad, num_heads * head_dim)  # a free reshape
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
        _geometry.call_compute_w(block_w, cfg.compute_w),
        chunk,
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


# Pieces of kernel bodies.


class ComputeBlock(NamedTuple):
    """``compute_w`` compressed blocks of a w tile, seen from the grid step's q block."""

    cols: slice  # its columns in the tile (static)
    lo: jax.Array  # its first compressed block
    work: jax.Array  # bool: some query of the q block may see some of it (else: no matmul, no elementwise op)
    opens: jax.Array  # bool, with work: the first such block of the q block's row (any_lo falls in it)

    @property
    def width(self):
        """Its compressed blocks: the call's compute width (``_geometry.call_compute_w``)."""
        return self.cols.stop - self.cols.start


def compute_blocks(bounds_refs, row, j, block_w, compute_w):
    """The compute blocks of w tile ``j``, each with work unless ``_geometry.block_empty`` by the bounds of
    the q block at ``row`` of the flattened per-q-block arrays: (any_lo, any_hi) refs. Only an empty
    block is branched on: a block with work is masked whether or not it needs it (a select per entry
    costs fewer bundles than the branch that would skip it)."""
    any_lo, any_hi = bounds_refs[0][row], bounds_refs[1][row]
    compute_w = _geometry.call_compute_w(block_w, compute_w)
    for n in range(block_w // compute_w):
        lo = j * block_w + n * compute_w
        empty = _geometry.block_empty(any_lo, any_hi, lo, lo + compute_w)
        yield ComputeBlock(slice(n * compute_w, (n + 1) * compute_w), lo, jnp.logical_not(empty), lo <= any_lo)


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


# float8 q and k meet the MXU as bfloat16. v5e, v5p and v6e unpack float8 only as e4m3b11fnuz (exponent
# bias 11, no infinities, its one NaN at 0x80), so Mosaic lowers an e4m3fn convert to that unpack and
# seven float32 operations a vreg that fix it up (scale, zero, NaN). Read as e4m3b11fnuz, e4m3fn's bits
# are x / 16 (the same mantissa, the exponent 4 lower, subnormals included) once the two codes that
# differ are moved in the packed bytes (-0, NaN there, to +0; NaN, a finite 30 there, to 0x80), and a
# multiply by 16 is exact: 43% fewer vector operations (compiled, v6e: 2,176 against 3,840 per 512K
# elements). 7x unpacks e4m3fn to bfloat16 itself, so it and unknown chips keep astype.
E4M3B11_UNPACK_CHIPS = frozenset({"TPU_V5E", "TPU_V5P", "TPU_V6E"})


def upcast(x, dtype):
    """``x`` in the wider ``dtype``, exactly: float8_e4m3fn in the operations the chip being compiled
    for unpacks fastest (see E4M3B11_UNPACK_CHIPS; NaN stays NaN, -0 becomes +0), any other by astype."""
    if x.dtype != jnp.float8_e4m3fn or not unpacks_e4m3b11():
        return x.astype(dtype)
    bits = jax.lax.bitcast_convert_type(x, jnp.int8)
    bits = jnp.where(bits == -128, jnp.int8(0), bits)  # -0
    bits = jnp.where((bits & 0x7F) == 0x7F, jnp.int8(-128), bits)  # NaN
    sixteenth = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3b11fnuz).astype(jnp.float32)
    return (sixteenth * 16.0).astype(dtype)


def unpacks_e4m3b11():
    """Whether the chip being traced for is one of E4M3B11_UNPACK_CHIPS. Off a TPU (interpret mode)
    too, so that the CPU checks run the route three of the four target chips compile."""
    try:
        return pltpu.get_tpu_info().chip_version.name in E4M3B11_UNPACK_CHIPS
    except ValueError:  # not a TPU
        return True


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
    compute blocks): dq = w_h * u (a head's weight is constant along its rows; ``weights`` is
    ``[n, block_q, 1]``, or already broadcast along D) and, since relu(logit) g = relu'(logit) g
    (q . k_w), dweights = sum_d q * u. ``[n * block_q, D]`` and ``[n, block_q, 1]`` (each head's
    column, as the lane sum leaves it) float32, before the softmax scale."""
    n, block_q = weights.shape[:2]
    u = u.reshape(n, block_q, -1)
    dweights = jnp.sum(upcast(q, jnp.float32).reshape(u.shape) * u, axis=2, keepdims=True)
    return (u * weights).reshape(n * block_q, -1), dweights


def lane_broadcast(x, column, width):
    """``x[:, column]`` broadcast across ``width`` lanes, ``[rows, width]`` float32, by the MXU (x times a
    one-hot ``[columns, width]``, exact): a lane broadcast costs the XLU an operation per vreg."""
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


# Meshes: what makes a variant's score work inside jax.shard_map, and sharded_score.


def differentiable_score(variant, forward, backward):
    """A variant's ``score_as(out_dtype, q, k, weights, *, kv_start, kv_end, k_scale, softmax_scale,
    interpret)``: ``score`` with its output in ``out_dtype`` (float32 for partial sums over a sharded
    head axis), a ``jax.custom_vjp`` over the variant's ``forward`` and ``backward`` whose residuals
    are the inputs only (the backward recomputes logits rather than saving [B, H, S, W])."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
    def core(q, k, weights, kv_start, kv_end, k_scale, softmax_scale, interpret, out_dtype):
        arrays = (q, k, weights, kv_start, kv_end, k_scale)
        return interpretable(lambda a: forward(*a, softmax_scale, interpret, out_dtype), arrays, interpret)

    def core_fwd(q, k, weights, kv_start, kv_end, k_scale, softmax_scale, interpret, out_dtype):
        residuals = (q, k, weights, kv_start, kv_end, k_scale)
        out = interpretable(lambda a: forward(*a, softmax_scale, interpret, out_dtype), residuals, interpret)
        return out, residuals

    def core_bwd(softmax_scale, interpret, out_dtype, residuals, g):
        return interpretable(
            lambda a: backward(softmax_scale, interpret, out_dtype, *a), (residuals, g), interpret
        )

    core.defvjp(core_fwd, core_bwd)
    grad_dtypes = [jnp.dtype(variant[key]) for key in ("qk_grad_dtype", "qk_grad_dtype", "weights_dtype")]

    def score_as(out_dtype, q, k, weights, *, kv_start=None, kv_end=None, k_scale=None, softmax_scale=None,
                 interpret=False):  # fmt: skip
        checked = check_call(variant, q, k, weights, kv_start, kv_end, k_scale, softmax_scale)
        kv_start, kv_end, k_scale, softmax_scale = checked
        # Inside jax.shard_map, every input varies over the mesh axes any of them does: the kernels'
        # outputs and gradients declare that, and autodiff sums the gradient of an input replicated
        # over some of them (k over a context or head axis) over those axes, once, in float32.
        # Outside shard_map this does nothing.
        q, k, weights, kv_start, kv_end, k_scale = vary_together(
            (q, k, weights, kv_start, kv_end, k_scale), (*grad_dtypes, None, None, jnp.float32)
        )
        with jax.named_scope(variant["name"]):
            return core(q, k, weights, kv_start, kv_end, k_scale, softmax_scale, interpret, out_dtype)

    return score_as


def _chunk_score(q_chunk, k, weights_chunk, softmax_scale):
    """The reference score of one head chunk: q [B, C, S, D], k [B, W, D], weights [B, S, C], all float32."""
    logits = jnp.einsum("bhsd,bwd->bhsw", q_chunk, k, precision=jax.lax.Precision.HIGHEST)
    return softmax_scale * jnp.einsum(
        "bsh,bhsw->bsw", weights_chunk, jnp.maximum(logits, 0.0), precision=jax.lax.Precision.HIGHEST
    )


def reference_backward(cfg, softmax_scale, interpret, out_dtype, residuals, g):
    """The reference VJP in float32, scanned over head chunks so at most [B, chunk, S, W] is live: the
    backward of the variants whose spec asks for ``backward: reference``."""
    del interpret, out_dtype  # plain XLA: nothing to interpret; g arrives in out_dtype
    q, k, weights, kv_start, kv_end, k_scale = residuals
    del k_scale  # only float8 variants take one, and they use the fused backward
    batch, num_heads, seq_len, head_dim = q_dims(q, cfg.variant["q_layout"])
    chunk = cfg.variant["head_chunk"] or num_heads
    num_chunks = num_heads // chunk
    q32 = (
        q.astype(ACCUM_DTYPE) if cfg.head_major else jnp.swapaxes(q, 1, 2).astype(ACCUM_DTYPE)
    )  # [B, H, S, D]
    q_chunks = jnp.swapaxes(q32.reshape(batch, num_chunks, chunk, seq_len, head_dim), 0, 1)
    weights_chunks = (
        weights.astype(ACCUM_DTYPE).reshape(batch, seq_len, num_chunks, chunk).transpose(2, 0, 1, 3)
    )
    k32 = k.astype(ACCUM_DTYPE)
    # Masked entries get no gradient, whatever the cotangent holds there.
    blocks = jnp.arange(k.shape[1], dtype=jnp.int32)
    visible = (kv_start[..., None] <= blocks) & (blocks < kv_end[..., None])
    g32 = jnp.where(visible, g.astype(ACCUM_DTYPE), 0.0)

    def step(dk, chunk_inputs):
        q_chunk, weights_chunk = chunk_inputs
        _, vjp = jax.vjp(
            functools.partial(_chunk_score, softmax_scale=softmax_scale), q_chunk, k32, weights_chunk
        )
        dq_chunk, dk_chunk, dweights_chunk = vjp(g32)
        return dk + dk_chunk, (dq_chunk, dweights_chunk)

    dk, (dq, dweights) = jax.lax.scan(step, jnp.zeros_like(k32), (q_chunks, weights_chunks))
    dq = jnp.swapaxes(dq, 0, 1).reshape(batch, num_heads, seq_len, head_dim)
    if not cfg.head_major:
        dq = jnp.swapaxes(dq, 1, 2)
    dweights = dweights.transpose(1, 2, 0, 3).reshape(batch, seq_len, num_heads)
    return dq.astype(q.dtype), dk.astype(k.dtype), dweights.astype(weights.dtype), None, None, None


# Inside ``jax.shard_map(..., check_vma=True)`` (the default) the type of every array records the
# manual mesh axes it varies over. A pallas_call cannot infer that for its outputs, so each out_shape
# must declare it; a custom_vjp must return each gradient varying exactly as its input does. The
# spelling moved between JAX releases, and these three functions are the only code that names it:
#   JAX 0.10 .. 0.12 (run on 0.10.2 and 0.12.0.1): jax.typeof(x).manual_axis_type.varying,
#     jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes)),
#     jax.lax.pcast(x, axes, to="varying") (jax.lax.pvary was removed in 0.10.0).
#   JAX 0.6.1 .. 0.9 (not run here): jax.typeof(x).vma, jax.ShapeDtypeStruct(shape, dtype, vma=axes),
#     jax.lax.pvary(x, axes) (jax.lax.pcast from 0.8.2).
_SDS_TAKES_MANUAL_AXIS_TYPE = "manual_axis_type" in inspect.signature(jax.ShapeDtypeStruct).parameters


def varying_axes(x):
    """The manual mesh axes ``x`` varies over: empty outside ``jax.shard_map`` (and with check_vma=False)."""
    aval = jax.typeof(x)
    manual_axis_type = getattr(aval, "manual_axis_type", None)
    if manual_axis_type is not None:
        return frozenset(manual_axis_type.varying)
    return frozenset(getattr(aval, "vma", ()))


def vary(x, axes):
    """``x`` cast to vary over ``axes`` as well. Autodiff transposes the cast into a sum of the
    cotangent over the axes it added: the gradient of a replicated input is reduced there, once."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x), key=str))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def out_struct(shape, dtype, like):
    """The ``out_shape`` of a pallas_call output that varies over the manual axes ``like`` varies over."""
    axes = varying_axes(like)
    if _SDS_TAKES_MANUAL_AXIS_TYPE:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes))
    return jax.ShapeDtypeStruct(shape, dtype, vma=axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _upcast(x, cotangent_dtype):
    """``x`` as float32; its cotangent comes back as ``cotangent_dtype`` (float8 inputs have bfloat16 gradients)."""
    return x.astype(jnp.float32)


def _upcast_fwd(x, cotangent_dtype):
    return x.astype(jnp.float32), None


def _upcast_bwd(cotangent_dtype, _, cotangent):
    return (cotangent.astype(cotangent_dtype),)


_upcast.defvjp(_upcast_fwd, _upcast_bwd)


def vary_together(arrays, grad_dtypes):
    """``arrays`` (None passes through) cast to vary over every manual axis any of them varies over, so
    that the kernels' outputs and gradients, which declare that union, are right.

    The gradient of an input cast this way is summed over the axes it gained (k replicated over a
    context or head axis). That sum is done in float32: a narrower input is upcast first, the kernels
    (which compute in its own dtype; see a variant's ``prepare``) return its gradient in float32, and it is
    rounded to ``grad_dtypes[i]`` once, after the sum; summing bfloat16 partials would cost ~2e-3.
    """
    axes = frozenset().union(*(varying_axes(x) for x in arrays if x is not None))
    if not axes:
        return tuple(arrays)
    out = []
    for x, grad_dtype in zip(arrays, grad_dtypes):
        if x is not None and axes - varying_axes(x):
            if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.float32:
                x = _upcast(x, grad_dtype)
            x = vary(x, axes)
        out.append(x)
    return tuple(out)


def interpretable(fn, arrays, interpret):
    """``fn(arrays)``, where ``fn`` runs pallas_calls interpreted as ``interpret`` says.

    Pallas's HLO interpreter (``interpret=True``) cannot evaluate a kernel inside ``jax.shard_map``
    with check_vma=True once its inputs vary over a manual axis (JAX 0.10.2 and 0.12.0.1): every
    primitive it binds must see operands of one vma, and its loop indices and constants vary over
    none ("Primitive mul requires varying manual axes to match"). In that case only, ``fn`` runs in
    a nested ``jax.shard_map`` over no new axes with check_vma=False, on inputs that no longer
    record their axes, and its outputs are declared varying again over the axes the inputs varied
    over: the same values, no communication. That last cast has a transpose (a sum) that would be
    wrong here, so call this only where autodiff never sees it: inside a custom_vjp's rules.
    (The TPU interpreter, ``pltpu.InterpretParams``, runs under check_vma as it is; but its barriers
    across devices can deadlock against XLA collectives that another device runs in another order.)
    """
    axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(arrays)))
    if interpret is not True or not axes:
        return fn(arrays)
    forget = lambda x: jax.lax.mul(x, jnp.ones((), x.dtype))  # any primitive drops the vma without the check
    P = jax.sharding.PartitionSpec
    unchecked = jax.shard_map(
        lambda arrays: fn(jax.tree.map(forget, arrays)),
        in_specs=(P(),),
        out_specs=P(),
        axis_names=set(),
        check_vma=False,
    )
    # Under jax.jit: an eager shard_map refuses a nested one with another check_vma.
    return jax.tree.map(lambda y: vary(y, axes), jax.jit(unchecked)(arrays))


DEFAULT_BATCH_AXES = ("data", "fsdp", "fsdp_transpose", "expert")


def mesh_plan(mesh, batch, seq_len, num_heads, *, batch_axes, context_axis, head_axis, head_chunk):
    """Checks the mesh and the axis names against the problem; returns the axes to shard the batch over.

    Raises ValueError naming the axis (or the sizes) before anything is traced. Warns, and returns no
    batch axes, when the batch does not divide over them.
    """
    names = getattr(mesh, "axis_names", None)
    sizes = getattr(mesh, "shape", None)
    if names is None or not hasattr(sizes, "get"):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(names)
    if isinstance(batch_axes, str):
        batch_axes = (batch_axes,)
    try:
        batch_axes = tuple(batch_axes)
    except TypeError:
        raise ValueError(f"batch_axes must be a tuple of mesh axis names, got {batch_axes!r}") from None
    for role, axis in (("context_axis", context_axis), ("head_axis", head_axis)):
        if axis is not None and axis not in names:
            raise ValueError(f"{role} {axis!r} is not an axis of the mesh, whose axes are {names}")
    if context_axis is not None and context_axis == head_axis:
        raise ValueError(f"axis {context_axis!r} is used twice: as context_axis and as head_axis")
    for position, axis in enumerate(batch_axes):
        if axis in batch_axes[:position]:
            raise ValueError(f"axis {axis!r} is used twice in batch_axes {batch_axes}")
        for role, other in (("context_axis", context_axis), ("head_axis", head_axis)):
            if axis == other and axis in names:
                raise ValueError(
                    f"axis {axis!r} is used twice: in batch_axes {batch_axes} and as {role}; the batch is "
                    f"never sharded over the {role.split('_')[0]} axis, so leave it out of batch_axes"
                )
    if context_axis is not None and seq_len % sizes[context_axis]:
        raise ValueError(
            f"context_axis {context_axis!r} has {sizes[context_axis]} shards, which do not divide the "
            f"sequence length S={seq_len}"
        )
    if head_axis is not None:
        shards = sizes[head_axis]
        if num_heads % shards:
            raise ValueError(
                f"head_axis {head_axis!r} has {shards} shards, which do not divide the H={num_heads} heads"
            )
        if head_chunk is not None and (num_heads // shards) % head_chunk:
            raise ValueError(
                f"head_axis {head_axis!r} leaves {num_heads // shards} of the H={num_heads} heads on each of "
                f"its {shards} shards, which this variant's head chunk of {head_chunk} does not divide"
            )
    present = tuple(axis for axis in batch_axes if axis in names)
    shards = math.prod(sizes[axis] for axis in present)
    if batch % shards:
        warnings.warn(
            f"sharded_score: the batch B={batch} does not divide over the {shards} shards of the batch "
            f"axes {dict((axis, sizes[axis]) for axis in present)}; the batch is replicated instead "
            "(every device scores the whole batch)",
            stacklevel=4,
        )
        return ()
    return present


def place(x, mesh, spec):
    """``x`` laid out as ``spec`` on ``mesh``. ``jax.shard_map`` rejects inputs sharded otherwise on
    Explicit axes; ``jax.device_put`` reshards on Explicit and Auto axes alike, eagerly or under jit,
    and costs nothing when ``x`` is laid out so already."""
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))


def mesh_operands(
    variant, mesh, q, k, weights, kv_start, kv_end, k_scale, *, batch_axes, context_axis, head_axis
):
    """The call's arrays placed on ``mesh`` for a ``jax.shard_map`` over it, their PartitionSpecs, and the
    (batch, context) entries of a [B, S, ...] output's spec; the checks are ``mesh_plan``'s."""
    q_layout = variant["q_layout"]
    batch, num_heads, seq_len, _ = q_dims(q, q_layout)
    batch_axes = mesh_plan(
        mesh, batch, seq_len, num_heads, batch_axes=batch_axes, context_axis=context_axis,
        head_axis=head_axis, head_chunk=variant["head_chunk"] or None,
    )  # fmt: skip
    b = batch_axes[0] if len(batch_axes) == 1 else (batch_axes or None)
    s, h = context_axis, head_axis
    P = jax.sharding.PartitionSpec
    arrays = dict(q=q, k=k, weights=weights, kv_start=kv_start, kv_end=kv_end, k_scale=k_scale)
    specs = dict(
        q=P(b, h, s, None) if q_layout == "head_major" else P(b, s, h, None),
        k=P(b, None, None),  # replicated over the context and head axes
        weights=P(b, s, h),
        kv_start=P(b, s),  # global compressed-block indices: each shard masks its own queries right
        kv_end=P(b, s),
        k_scale=P(b, None),
    )
    arrays = {name: place(x, mesh, specs[name]) for name, x in arrays.items() if x is not None}
    return arrays, {name: specs[name] for name in arrays}, (b, s)


def sharded_score(
    variant, score_as, q, k, weights, *, mesh, batch_axes=DEFAULT_BATCH_AXES, context_axis=None, head_axis=None,
    kv_start=None, kv_end=None, k_scale=None, softmax_scale=None, interpret=False,
):  # fmt: skip
    """A variant's ``score`` inside a ``jax.shard_map`` over ``mesh``; returns the global ``[B, S, W]``.

    Args:
      variant: the variant's ``VARIANT``: its q layout, head chunk (which must divide each shard's
        heads) and output dtype (partial sums over a head axis are float32 until the end).
      score_as: the variant's ``score_as(out_dtype, q, k, weights, *, kv_start, kv_end, k_scale,
        softmax_scale, interpret)``, applied to each device's shard.
      mesh: a ``jax.sharding.Mesh`` with Auto or Explicit axes. Inputs laid out otherwise (or not on
        the mesh at all) are resharded to fit, eagerly or under ``jax.jit``.
      batch_axes: B is sharded over those of these axes that the mesh has (any may be missing). When
        B does not divide over them, the batch is replicated instead, with a warning naming the sizes.
      context_axis: None, or an axis to shard S over: q, weights, kv_start, kv_end and the output are
        split along S, while k (and k_scale) are replicated on it (their gradients are summed over it,
        once, in float32). The axis must divide S. Bounds stay global compressed-block indices, so
        every shard masks, and skips tiles, right; visibility is per query, so the queries may come in
        any order: for causal load balance give each shard a chunk from the start of the sequence and
        one from the end (both q and the bounds permuted), and the scores come back in that order.
      head_axis: None, or an axis to shard H over (q's and weights'). Each shard scores its heads; the
        float32 partial scores are summed over the axis, then cast to the output dtype; masked entries
        stay exactly masked. The axis must divide H, and the head chunk the heads per shard. Cost: an
        all-reduce of the float32 ``[B/dp, S/cp, W]`` partial scores in the forward, and of dk
        (``[B/dp, W, D]``) in the backward. Context parallelism moves only the latter (W x D floats
        against S x W per sequence: 64x fewer at S = 8192, D = 128), so prefer it; see
        ``python benchmarks/sharding.py``. Only the float32 summation order of the partials differs
        from the single-device score: an entry of a bfloat16 score can differ by one ulp (2**-8
        relative) where its sum lies at a rounding boundary, within the suite's bfloat16 tolerance.
    An axis the mesh does not have, or one used twice, is a ValueError naming it, raised before
    anything is traced; so is a size that does not divide.
    """
    # On the global shapes, before anything is traced; the scale resolved on the global q (D is never sharded).
    softmax_scale = check_call(variant, q, k, weights, kv_start, kv_end, k_scale, softmax_scale)[3]
    out_dtype = jnp.dtype(variant["out_dtype"])
    arrays, specs, (b, s) = mesh_operands(
        variant, mesh, q, k, weights, kv_start, kv_end, k_scale,
        batch_axes=batch_axes, context_axis=context_axis, head_axis=head_axis,
    )  # fmt: skip
    P = jax.sharding.PartitionSpec
    partial_dtype = out_dtype if head_axis is None else jnp.float32

    def shard(arrays):
        out = score_as(
            partial_dtype, arrays["q"], arrays["k"], arrays["weights"],
            kv_start=arrays.get("kv_start"), kv_end=arrays.get("kv_end"), k_scale=arrays.get("k_scale"),
            softmax_scale=softmax_scale, interpret=interpret,
        )  # fmt: skip
        if head_axis is not None:  # partial sums over this shard's heads; masked entries stay -inf
            out = jax.lax.psum(out, head_axis).astype(out_dtype)
        return out

    return jax.shard_map(shard, mesh=mesh, in_specs=(specs,), out_specs=P(b, s, None))(arrays)


# The family's helpers for callers.


def causal_kv_range(positions, compress_rate=COMPRESS_RATE, segment_starts=None):
    """The causal CSA visible range ``[kv_start, kv_end)`` of each query, for ``score``.

    Compressed block w summarises tokens ``[w * r, (w + 1) * r)`` and is complete only once
    position ``(w + 1) * r - 1`` has been seen, so a query at position p sees the blocks
    ``w < (p + 1) // r``: never the block it is still inside. With packed sequences, a query also
    sees only the blocks that start inside its own segment: ``w >= ceil(segment_start / r)``.

    Args:
      positions: integer [B, S] (or any shape) token positions, in the stream the blocks index.
      compress_rate: r, tokens per compressed block.
      segment_starts: optional integer array like ``positions``: the position of the first token
        of each query's segment. None: one segment from position 0.

    Returns:
      (kv_start, kv_end), int32 arrays shaped like ``positions``. A query that sees nothing has
      kv_start >= kv_end: its scores are all masked and it gets no gradient.
    """
    if compress_rate < 1:
        raise ValueError(f"compress_rate must be a positive integer, got {compress_rate}")
    positions = jnp.asarray(positions, jnp.int32)
    kv_end = (positions + 1) // compress_rate
    if segment_starts is None:
        return jnp.zeros_like(kv_end), kv_end
    segment_starts = jnp.asarray(segment_starts, jnp.int32)
    if segment_starts.shape != positions.shape:
        raise ValueError(
            f"segment_starts must be shaped like positions {positions.shape}, got {segment_starts.shape}"
        )
    return -(-segment_starts // compress_rate), kv_end


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_per_token(x):
    """Quantises ``x [..., D]`` to float8_e4m3fn with one float32 scale per token (the last axis).

    Returns ``(x_fp8, scale)`` with ``x ~= x_fp8 * scale[..., None]``: each token's largest magnitude
    maps to 448, so the relative error is at most 2**-4 per element (3 mantissa bits). Use it for
    keys (``k_scale`` of the float8 variants). For queries, quantise ``[B, S, H, D]`` the same way
    and fold the scale into the weights: ``weights * q_scale`` is exact for relu, as the scale is positive.
    An all-zero token gets scale 1.
    """
    x = jnp.asarray(x, jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    x_fp8 = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return x_fp8, scale


# Sparse selection: top-k, the sparse score, the indexer loss.
#
# DeepSeek's sparse stage scores, per query, only the top_k compressed blocks the indexer selected.
# ``topk_indices`` makes the selection; each variant module's ``sparse_score`` scores it with two
# Pallas kernels (in templates/tpu/sparse.py.j2) whose MXU work is B * S * top_k * H * D, never W;
# ``indexer_loss`` is the KL loss the indexer is trained with, dense (over every visible block) or
# sparse (over the selection). What every variant shares of that is here.

APPROX_RECALL_TARGET = 0.95  # topk_indices(method="approx"): jax.lax.approx_max_k's recall target
# VMEM of the sparse kernels' resident route, from the spec's TPU targets: the smallest chip's
# capacity bounds the W it supports, the smallest default scoped limit decides when to ask for more.
SPARSE_VMEM_CAPACITY_BYTES = _family.SPARSE_VMEM_CAPACITY_BYTES
SPARSE_DK_COPIES = _geometry.SPARSE_DK_COPIES  # the backward's most dk accumulators (see there)
SPARSE_SCOPED_VMEM_DEFAULT_BYTES = _family.SPARSE_SCOPED_VMEM_DEFAULT_BYTES


def topk_indices(scores, top_k, *, method="exact"):
    """The ``top_k`` highest-scoring compressed blocks of each query: int32 ``[B, S, top_k]``.

    Args:
      scores: ``[B, S, W]`` scores (any float dtype), e.g. a variant's ``score``; a non-finite entry
        (``-inf`` where masked, NaN, ``+inf``) is not a visible block and is never selected.
      top_k: blocks to select per query, ``>= 1``; it may exceed W (the extra slots are -1).
      method: ``"exact"``: ``jax.lax.top_k``, highest score first, equal scores in increasing block
        index (the lower block wins a tie). ``"approx"``: ``jax.lax.approx_max_k`` with recall target
        ``APPROX_RECALL_TARGET`` (0.95: the expected share of the true top_k that is selected, on TPU;
        on other backends it is exact), highest first; ties there are in no stated order.

    Returns:
      int32 ``[B, S, top_k]``: slot j of a row holds a block index while j is below the row's number
      of visible (finite) entries, and -1 ("no block") after. Deterministic: the same scores give
      the same indices.
    """
    if not hasattr(scores, "shape") or not hasattr(scores, "dtype") or scores.ndim != 3:
        raise ValueError(
            f"scores must be an array [B, S, W], got shape {tuple(getattr(scores, 'shape', ()))}"
        )
    if not jnp.issubdtype(scores.dtype, jnp.floating):
        raise ValueError(f"scores must be a float array [B, S, W], got {scores.dtype}")
    top_k = check_top_k(top_k)
    if method not in ("exact", "approx"):
        raise ValueError(f'method must be "exact" or "approx", got {method!r}')
    scores = scores.astype(jnp.float32)
    visible = jnp.isfinite(scores)
    scores = jnp.where(visible, scores, -jnp.inf)
    num_blocks = scores.shape[-1]
    if top_k > num_blocks:  # top_k and approx_max_k take at most W
        scores = pad_to(scores, 2, top_k) + jnp.where(jnp.arange(top_k) < num_blocks, 0.0, -jnp.inf)
    if method == "exact":
        _, indices = jax.lax.top_k(scores, top_k)
    else:
        _, indices = jax.lax.approx_max_k(scores, top_k, recall_target=APPROX_RECALL_TARGET)
    count = jnp.sum(visible, axis=-1, keepdims=True)
    return jnp.where(jnp.arange(top_k) < count, indices, -1).astype(jnp.int32)


def check_top_k(top_k):
    """top_k as a static positive int (a Python or NumPy integer, not a bool); ValueError otherwise."""
    try:
        value = operator.index(top_k)
    except TypeError:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}") from None
    if isinstance(top_k, bool) or value < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    return value


def check_indices(indices, batch, seq_len):
    """Integer ``[B, S, top_k]`` indices (top_k >= 1) as int32; ValueError naming what does not fit."""
    if not hasattr(indices, "shape") or not hasattr(indices, "dtype"):
        raise ValueError(f"indices must be an integer array [B, S, top_k], got {type(indices).__name__}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"indices must be an integer array (int32) [B, S, top_k], got {indices.dtype}")
    if indices.ndim != 3 or tuple(indices.shape[:2]) != (batch, seq_len) or indices.shape[2] < 1:
        raise ValueError(
            f"indices must be [B={batch}, S={seq_len}, top_k>=1] to match q, got shape {tuple(indices.shape)}"
        )
    return jnp.asarray(indices, jnp.int32)


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
    k: jax.Array
    weights: jax.Array  # [B, S_pad, H] float32
    rows: jax.Array  # [B, S_pad, top_k_pad] int32: the block each slot gathers; 0 for an empty slot
    in_range: jax.Array  # [B, S_pad, top_k_pad] bool: the slot's index lies in [0, W)
    # Several windows: each query's slots in the order the kernels take them, by block (in_range
    # first), and its inverse; None with one window (the kernels take the slots as given).
    order: jax.Array | None
    unorder: jax.Array | None
    valid: jax.Array  # [B, S, top_k] bool: the same, unpadded
    slot_scale: jax.Array | None  # [B, S, top_k] float32: k_scale of each slot's block (float8 variants)
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
    slot_scale = None
    if k_scale is not None:
        slot_scale = jnp.take_along_axis(k_scale, rows.reshape(batch, -1), axis=1).reshape(rows.shape)
    pad_slots = lambda a: pad_to(pad_to(a, 2, top_k_pad), 1, seq_pad)
    padded_rows, in_range = pad_slots(rows), pad_slots(valid)
    order = unorder = None
    if num_windows == 1:
        k = k.astype(ACCUM_DTYPE)
    else:  # a window's slots together in each query's row: its calls visit those only
        k = pad_to(k, 1, num_windows * window_rows)
        order, unorder = slot_orders(block_keys(padded_rows, in_range, num_blocks), num_blocks)
    return SparseOperands(
        pad_to(q, 1, seq_pad), k, pad_to(weights.astype(ACCUM_DTYPE), 1, seq_pad),
        padded_rows, in_range, order, unorder, valid, slot_scale,
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
    a vector gather does not), ``_geometry.SPARSE_GATHER_UNROLL`` slots a loop trip."""

    def visit(j, row, _):
        gathered_ref[pl.ds(j, 1), :] = k_ref[pl.ds(row, 1), :]

    for_each_slot(rows_ref, s, gathered_ref.shape[0], _geometry.SPARSE_GATHER_UNROLL, visit, spans_ref)


def scatter_add_rows(rows_ref, dk_refs, dk_gathered_ref, s, spans_ref=None):
    """dk row ``rows[s, j]`` += row j of ``dk_gathered_ref``, slot by slot, into the accumulators
    ``dk_refs`` in turn (their sum is dk): duplicates add up; an empty slot's row is zero (its
    cotangent is) and adds nothing. A dynamic single-row read-modify-write of float32 VMEM per slot,
    ``_geometry.SPARSE_SCATTER_UNROLL`` a loop trip: a row's load waits on the earlier stores to its
    accumulator, which the compiler orders; the accumulators' chains overlap."""

    def visit(j, row, t):
        dk_ref = dk_refs[t % len(dk_refs)]
        dk_ref[pl.ds(row, 1), :] += dk_gathered_ref[pl.ds(j, 1), :]

    for_each_slot(rows_ref, s, dk_gathered_ref.shape[0], _geometry.SPARSE_SCATTER_UNROLL, visit, spans_ref)


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


def differentiable_sparse_score(variant, forward, backward, gather_dtypes):
    """A variant's ``sparse_score`` over its two kernels: a ``jax.custom_vjp`` whose residuals are the
    inputs only (the backward gathers and recomputes the logits). ``gather_dtypes``: the dtypes the
    forward and the backward gather k rows in, for the VMEM check made before anything is traced."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
    def core(q, k, weights, indices, k_scale, softmax_scale, interpret):
        arrays = (q, k, weights, indices, k_scale)
        return interpretable(lambda a: forward(*a, softmax_scale, interpret), arrays, interpret)

    def core_fwd(q, k, weights, indices, k_scale, softmax_scale, interpret):
        residuals = (q, k, weights, indices, k_scale)
        return interpretable(lambda a: forward(*a, softmax_scale, interpret), residuals, interpret), residuals

    def core_bwd(softmax_scale, interpret, residuals, g):
        grads = interpretable(
            lambda a: backward(softmax_scale, interpret, *a[0], a[1]), (residuals, g), interpret
        )
        dq, dk, dweights, dk_scale = grads
        return dq, dk, dweights, None, dk_scale

    core.defvjp(core_fwd, core_bwd)
    grad_dtypes = [jnp.dtype(variant[key]) for key in ("qk_grad_dtype", "qk_grad_dtype", "weights_dtype")]

    def sparse_score(q, k, weights, indices, *, k_scale=None, softmax_scale=None, interpret=False):
        _, _, k_scale, softmax_scale = check_call(variant, q, k, weights, None, None, k_scale, softmax_scale)
        batch, _, seq_len, _ = q_dims(q, variant["q_layout"])
        indices = check_indices(indices, batch, seq_len)
        for dtype in gather_dtypes:  # raises ValueError when a query's gathered rows leave no room for k
            pad = _geometry.sparse_top_k_pad(indices.shape[2])
            sparse_vmem_rows(k.shape[2], q_dims(q, variant["q_layout"])[1], pad, dtype, q.dtype)
        # Inside jax.shard_map, as for score: every input varies over the axes any of them does, and the
        # gradient of one replicated over some (k over a sequence axis) is summed there, in float32.
        q, k, weights, indices, k_scale = vary_together(
            (q, k, weights, indices, k_scale), (*grad_dtypes, None, jnp.float32)
        )
        with jax.named_scope(f"{variant['name']}_sparse"):
            return core(q, k, weights, indices, k_scale, softmax_scale, interpret)

    return sparse_score


def indexer_loss(variant, score, sparse_score, q, k, weights, target, *, indices=None, kv_start=None,
                 kv_end=None, k_scale=None, softmax_scale=None, interpret=False):  # fmt: skip
    """A variant's ``indexer_loss`` over its ``score`` and ``sparse_score`` (see there). Every input,
    ``target`` included, is checked before anything is traced."""
    check_inputs(q, k, weights, variant)
    batch, _, seq_len, _ = q_dims(q, variant["q_layout"])
    if (
        not hasattr(target, "shape")
        or not hasattr(target, "dtype")
        or not jnp.issubdtype(target.dtype, jnp.floating)
    ):
        raise ValueError(
            f"target must be a float array, got {getattr(target, 'dtype', type(target).__name__)}"
        )
    if indices is None:
        want, like = (batch, seq_len, k.shape[1]), "[B, S, W] like the score"
    else:
        indices = check_indices(indices, batch, seq_len)
        want, like = tuple(indices.shape), "[B, S, top_k] like indices"
    if tuple(target.shape) != want:
        raise ValueError(f"target must be {like}, {want}, got {tuple(target.shape)}")
    kwargs = dict(k_scale=k_scale, softmax_scale=softmax_scale, interpret=interpret)
    if indices is None:
        logits = score(q, k, weights, kv_start=kv_start, kv_end=kv_end, **kwargs)
        in_set = jnp.isfinite(logits)  # the visible blocks
    else:
        logits = sparse_score(q, k, weights, indices, **kwargs)
        in_set = (indices >= 0) & (indices < k.shape[1])
        shape = indices.shape[:2]
        if kv_start is not None:
            in_set &= indices >= check_kv_bound("kv_start", kv_start, shape, 0)[..., None]
        if kv_end is not None:
            in_set &= indices < check_kv_bound("kv_end", kv_end, shape, k.shape[1])[..., None]
    return kl_over_sets(logits, target, in_set)


def kl_over_sets(logits, target, in_set):
    """The mean over rows with a non-empty set of KL(target || softmax(logits)), both restricted to the
    row's set, the target renormalised there; float32. A row whose target has no mass on its set adds
    0 (and is still one of the rows averaged over). Never NaN: entries outside the set are replaced
    before any arithmetic (their gradient is exactly 0), and with no non-empty set the loss is 0."""
    target = jax.lax.stop_gradient(jnp.where(in_set, target.astype(ACCUM_DTYPE), 0.0))
    logits = jnp.where(in_set, logits.astype(ACCUM_DTYPE), 0.0)  # -inf outside the set never reaches exp
    mass = jnp.sum(target, axis=-1, keepdims=True)
    nonempty = jnp.any(in_set, axis=-1, keepdims=True)
    counts = nonempty & (mass > 0)
    p = target / jnp.where(counts, mass, 1.0)
    top = jax.lax.stop_gradient(jnp.max(jnp.where(in_set, logits, -jnp.inf), axis=-1, keepdims=True))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jnp.sum(jnp.where(in_set, jnp.exp(logits - top), 0.0), axis=-1, keepdims=True)
    log_q = logits - top - jnp.log(jnp.where(counts, total, 1.0))
    positive = p > 0
    terms = jnp.where(positive, p * (jnp.log(jnp.where(positive, p, 1.0)) - log_q), 0.0)
    per_row = jnp.where(counts, jnp.sum(terms, axis=-1, keepdims=True), 0.0)
    return jnp.sum(per_row) / jnp.maximum(jnp.sum(nonempty), 1).astype(ACCUM_DTYPE)


# lhs [n, m] . rhs [n, p] -> [m, p]: contract the first dimension of both (dlogitsᵀ . k, no transpose).
# Mosaic's TPU lowering accepts it (and the one-deep g wᵀ of the sparse backward) for [top_k, H] and
# [top_k, D] operands: verified by lowering on a CPU only, as is everything in this section's kernels.
CONTRACT_FIRST = (((0,), (0,)), ((), ()))


def sparse_matmul(lhs, rhs, dimension_numbers, precision):
    """float32 ``lhs`` against ``rhs`` as ``dimension_numbers`` say, in float32: one MXU pass at
    ``precision`` when rhs is float32, else lhs split into a head and a tail of rhs's type, two
    passes (as ``split_matmul``: ~16 bits of lhs kept, rhs exact)."""
    if rhs.dtype == lhs.dtype:
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=ACCUM_DTYPE
        )
    return split_matmul(lhs, rhs, dimension_numbers)


def scatter_slots(values, rows, num_blocks):
    """float32 ``[B, W]``: per batch element, the sum of ``values [B, S, top_k]`` over the slots whose
    block is ``rows [B, S, top_k]`` (duplicates add up). An XLA scatter-add of B * S * top_k scalars."""
    batch = values.shape[0]
    add = lambda v, r: jnp.zeros((num_blocks,), ACCUM_DTYPE).at[r].add(v)
    return jax.vmap(add)(values.reshape(batch, -1), rows.reshape(batch, -1))


def slots_shape(x):
    """The ``[B, S_pad, top_k_pad]`` shape of a per-slot array of the call ``x`` (``SparseOperands``)."""
    return (x.batch, x.seq_pad, x.top_k_pad)


def sparse_flops(x, passes):
    """MXU FLOPs of a sparse kernel: per query ``passes`` [top_k_pad, D] x [D, H] matmuls."""
    return 2 * x.batch * x.seq_pad * x.top_k_pad * x.num_heads * passes * x.head_dim
