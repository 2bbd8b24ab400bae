"""TPU tile geometry, each fact written once: the generator (cost model, VMEM budget, validation) and
the generated runtime both import this file, and ``codegen render`` copies it into every family
package as it is. It needs only ``jax.numpy`` and ``jax.lax``, on arrays or on scalars read from
SMEM alike.

A vreg holds 8 sublanes x 128 lanes of 32 bits, so a narrower dtype packs more rows into one tile:
Mosaic lays out a VMEM block's last dimension in 128 lanes and the one before it in rows of that
granule. Blocks shrunk to a small problem are rounded to it; the cost model pads every VMEM block to it.
"""

import math

import jax.numpy as jnp
from jax import lax

KIB, MIB = 2**10, 2**20
LANES = 128
SUBLANES_BY_ITEMSIZE = {4: 8, 2: 16, 1: 32}
# Mosaic's legality rule: a block's last two dimensions are multiples of (8, 128) or span the array.
MIN_SUBLANES = SUBLANES_BY_ITEMSIZE[4]
# A kernel over the default scoped VMEM asks for its footprint plus this share for Mosaic's own
# scratch, in whole MiB (the dense kernels at render time, the sparse ones at call time).
VMEM_HEADROOM = 1.25


def round_up(x, multiple):
    return -(-x // multiple) * multiple


def itemsize(dtype):
    """Bytes per element of ``dtype``: a dtype or a name ("float32", "bfloat16", "float8_e4m3fn", ...)."""
    return jnp.dtype(dtype).itemsize


def sublanes(dtype):
    """Rows of one native tile of ``dtype``."""
    return SUBLANES_BY_ITEMSIZE[itemsize(dtype)]


# Heads the backward kernels stack against one key block per matmul. The gradient matmul contracts
# dlogits over the compute block, so a group's logits are held whole: [16 * 128, 1024] float32 is
# 8 MiB at the production tiling, where all 64 heads would not fit 7x's VMEM beside the blocks. The
# keys are pushed into the MXU once per group: 4 times a step for 64 heads, not 64.
GRAD_HEAD_GROUP = 16


def vmem_limit(need, scoped_default):
    """The ``vmem_limit_bytes`` a kernel needing ``need`` bytes asks for: None when the default scope holds it."""
    return None if need <= scoped_default else round_up(int(need * VMEM_HEADROOM), MIB)


def tiles(seq_len, num_blocks, block_q, block_w, compute_ws, sublanes):
    """A call's (block_q, block_w): the variant's, shrunk when the problem is smaller than a tile (rows
    to the ``sublanes`` granule of the narrowest q-row dtype, columns to whole compute blocks of every
    width in ``compute_ws``, the forward's and the fused backward's, which are whole 128-lane groups; a width
    that is the whole tile shrinks to whole lane groups with it: ``call_compute_w``)."""
    granule = math.lcm(LANES, *(w for w in compute_ws if w < block_w))
    return min(block_q, round_up(seq_len, sublanes)), min(block_w, round_up(num_blocks, granule))


def call_compute_w(block_w, compute_w):
    """A call's compute width: the variant's, or the whole tile where ``tiles`` shrank it below that."""
    return min(compute_w, block_w)


def block_fetches(grid, moving):
    """DMAs of a block whose index follows the grid positions ``moving``, in a row-major walk that
    re-fetches only on change: the last step that changes the index is the one that moves the
    innermost such axis m of size > 1, so it changes at every step of the grid cut after m,
    prod(grid[:m + 1]) fetches (1 when no axis moves). Outputs are written back as often."""
    moving = [a for a in moving if grid[a] > 1]
    return math.prod(grid[: max(moving) + 1]) if moving else 1


# Which compute blocks a q block's queries may see: the rule the kernels skip and mask by. The kernels
# classify every (q block, compute block) as empty, full or partial from four int32 per q block; the
# cost model (``codegen explain --causal``) and the tests run the same functions on whole problems.


def query_block_bounds(kv_start, kv_end, block_q):
    """What the queries of each q block see, in four int32 per q block, flattened to ``[B * S // block_q]``.

    ``kv_start``, ``kv_end``: int32 [B, S], S a multiple of ``block_q``; query (b, s) sees the
    compressed blocks ``[kv_start, kv_end)`` (empty when ``kv_start >= kv_end``). Returns
    (any_lo, any_hi, all_lo, all_hi): no query of the q block sees a block outside
    ``[any_lo, any_hi)`` (0, 0 when none sees any), and every query sees all of ``[all_lo, all_hi)``
    (empty, ``all_lo >= all_hi``, when some query sees nothing).
    """
    batch, seq_len = kv_start.shape
    start, end = (x.reshape(batch * (seq_len // block_q), block_q) for x in (kv_start, kv_end))
    nonempty = end > start
    seen = jnp.any(nonempty, axis=1)
    any_lo = jnp.where(seen, jnp.min(jnp.where(nonempty, start, jnp.iinfo(jnp.int32).max), axis=1), 0)
    any_hi = jnp.where(seen, jnp.max(jnp.where(nonempty, end, 0), axis=1), 0)
    all_lo, all_hi = jnp.max(start, axis=1), jnp.min(end, axis=1)
    return tuple(x.astype(jnp.int32) for x in (any_lo, any_hi, all_lo, all_hi))


def block_kind(any_lo, any_hi, all_lo, all_hi, lo, hi):
    """(empty, full) of the compressed blocks ``[lo, hi)`` for a q block with these bounds.

    Empty: no query of the q block may see any of them, so they do no work at all. Full: every
    query sees every one of them. Neither: partial. The kernels branch on empty only and mask every
    block with work; the cost model and ``explain`` report all three.
    """
    full = (all_lo <= lo) & (hi <= all_hi)
    return block_empty(any_lo, any_hi, lo, hi), full


def block_empty(any_lo, any_hi, lo, hi):
    """Whether no query of a q block with these bounds may see any of the compressed blocks ``[lo, hi)``."""
    return (hi <= any_lo) | (any_hi <= lo)


def visible_pieces(any_lo, any_hi, tile_lo, block_w, compute_w):
    """How the forward walks the compressed blocks a q block with bounds (any_lo, any_hi) may see in
    the w tile starting at ``tile_lo`` (``_kernel_ops.each_visible_piece``): ``(start, big, rest)``.

    From column ``start`` of the tile (the first such block's, aligned down to a lane group), ``big``
    pieces of ``compute_w`` columns, then ``rest`` columns (a multiple of 128 below ``compute_w``) in
    the pieces of ``tail_widths`` that its bits name; (start, 0, 0) where it may see none. A band of
    width b computes about b plus a lane group at each end, where aligned compute blocks compute up to a
    compute block more at each end."""
    # lax.div, not //: on non-negative int32 the same, and inside a kernel one instruction, where //
    # rounds toward minus infinity through a sign Mosaic lowers only for a known TPU generation
    lo = jnp.clip(any_lo - tile_lo, 0, block_w)
    hi = jnp.clip(any_hi - tile_lo, 0, block_w)
    start = lax.div(lo, LANES) * LANES
    covered = jnp.where(lo < hi, lax.div(hi - start + LANES - 1, LANES) * LANES, 0)
    return start, lax.div(covered, compute_w), lax.rem(covered, compute_w)


def tail_widths(compute_w):
    """The widths of the pieces the forward's walk ends on, widest first: every lane group times a
    power of two below ``compute_w``, so that any multiple of 128 below it is a sum of distinct ones:
    those of its set bits (``rest & width``)."""
    widths = []
    while LANES * 2 ** len(widths) < compute_w:
        widths.append(LANES * 2 ** len(widths))
    return widths[::-1]


# The sparse kernels (``sparse_score``): grid (batch, q block of SPARSE_BLOCK_Q queries), k of one batch
# element resident in VMEM as float32 rows (16- and 8-bit k upcast exactly), each query's top_k rows
# gathered into a float32 scratch.

SPARSE_BLOCK_Q = 8  # queries per grid step of the sparse kernels
# Slots a gather or scatter loop trip moves, unrolled: the longest of these that divides top_k_pad
# (``sparse_trip``). A row is an SMEM index load, an address, and a one-row load and store: the scalar
# unit's work, two scalar slots a bundle. Unrolled, the compiler overlaps the rows, but each trip starts
# on its index loads and ends on its last stores (the TPU compiler's schedule, v5e, S 16384 / W 8192 /
# top_k 512, bundles a float32 row: gather 1.94 at 16 slots a trip, 1.75 at 32, 1.63 at 64; the
# backward's scatter-add 2.6, 2.3, 2.3), against ~8 for the aligned 16-row group reads of bfloat16 k
# that resident float32 rows replace. top_k is padded to whole trips of the shortest.
SPARSE_SLOT_TRIPS = (64, 16)
# dk rows added, slot after slot, in turn into SPARSE_DK_COPIES float32 dk accumulators: a row's load waits
# on the stores to its accumulator before it (the compiler cannot tell two dynamic rows apart), so one
# accumulator chains every slot (~5 bundles a slot by the TPU compiler's schedule) and four overlap
# four chains (~2.6), at the cost of three more dk's of VMEM: taken where they leave the windows of k
# as few as one accumulator does (``_gather.sparse_key_windows``).
SPARSE_DK_COPIES = 4


def sparse_top_k_pad(top_k):
    """top_k rounded up to whole slot trips (whatever the rows are gathered as: the scratch is float32)."""
    return round_up(top_k, min(SPARSE_SLOT_TRIPS))


def sparse_trip(top_k_pad):
    """Slots a gather or scatter loop trip moves at ``top_k_pad`` slots: the longest of SPARSE_SLOT_TRIPS
    that divides it (64 at every top_k DeepSeek-V4 uses)."""
    return next(t for t in SPARSE_SLOT_TRIPS if top_k_pad % t == 0)


def sparse_windows(num_blocks, most_rows):
    """(rows per window, windows) of k when at most ``most_rows`` rows fit VMEM: all W in one window
    when they fit (today's resident route, unchanged), else as few windows as that allows, of equal
    whole sublane tiles of float32 rows (the last one padded with rows no slot selects)."""
    if num_blocks <= most_rows:
        return num_blocks, 1
    windows = -(-num_blocks // most_rows)
    return round_up(-(-num_blocks // windows), SUBLANES_BY_ITEMSIZE[4]), windows


def sparse_vmem_bytes(num_blocks, head_dim, num_heads, top_k_pad, gather_dtype, q_dtype, dk_copies=1):
    """VMEM the sparse backward kernel (the larger of the two) holds: k of one batch element as float32
    rows and its ``dk_copies`` float32 dk accumulators resident (one buffer each: their block changes
    only with the batch element), the gathered float32 rows, their copy in ``gather_dtype`` and their
    float32 dk, the query blocks, and the in-flight [top_k, H] float32 tiles. k's own dtype does not
    matter: it is resident as float32 whatever it arrives as."""
    lanes = lambda n: round_up(n, LANES)
    resident = (1 + dk_copies) * round_up(num_blocks, SUBLANES_BY_ITEMSIZE[4]) * lanes(head_dim) * 4
    gathered = top_k_pad * lanes(head_dim) * (4 + itemsize(gather_dtype) + 4)
    queries = 2 * SPARSE_BLOCK_Q * num_heads * lanes(head_dim) * (itemsize(q_dtype) + 4)
    slots = 2 * 3 * SPARSE_BLOCK_Q * lanes(top_k_pad) * 4 + 2 * 2 * SPARSE_BLOCK_Q * lanes(num_heads) * 4
    in_flight = 6 * top_k_pad * lanes(num_heads) * 4
    return resident + gathered + queries + slots + in_flight
