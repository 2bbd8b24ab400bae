"""Cost of each pallas_call of a variant at a problem shape: VMEM footprint, HBM traffic, work, roofline.

Everything is read off the kernel plan (``codegen.plan``): the grid, each block's shape and the axes
its index follows, scratch and temporaries, and the work model. Without visibility bounds every
compute block is assumed to do work, unmasked (as the kernels' ``pl.CostEstimate`` says); with them
(``block_kinds``), each (q block, compute block) is classified by the kernels' own rule
(``codegen/shipped/_geometry.py``) and only what the kernels execute is counted: no work for an empty block, the
the mask for every one with work, and no DMA for a skipped tile. The scalar-prefetched ranges (four int32 per q
block, two per w tile, in SMEM) are left out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from codegen import plan as plan_module
from codegen.plan import Block, KernelPlan, VariantPlan
from codegen.shipped import _geometry as geometry

if TYPE_CHECKING:
    from codegen.chips import Chip


class Shape(NamedTuple):
    """A problem: q [B, H, S, D] (either layout), k [B, W, D]."""

    batch: int
    num_heads: int
    seq_len: int
    head_dim: int
    num_blocks: int


@dataclasses.dataclass(frozen=True)
class Tiling:
    """One call's effective tiling, as the generated ``tiles`` and ``prepare`` compute it."""

    shape: Shape
    block_q: int
    block_w: int
    compute_w: int
    heads: int  # per grid step
    seq_pad: int
    blocks_pad: int

    @property
    def extents(self) -> dict[str, int]:
        """Grid extent of each axis."""
        return {
            "b": self.shape.batch,
            "i": self.seq_pad // self.block_q,
            "j": self.blocks_pad // self.block_w,
            "c": self.shape.num_heads // self.heads,
        }

    def dims(self, symbolic: tuple) -> tuple[int, ...]:
        """A plan's block shape in numbers; squeezed (None) dimensions dropped."""
        sizes = {
            "block_q": self.block_q,
            "block_w": self.block_w,
            "compute_w": self.compute_w,
            "head_dim": self.shape.head_dim,
            "heads": self.heads,
            "num_heads": self.shape.num_heads,
            "num_chunks": self.shape.num_heads // self.heads,
            "grad_heads": min(self.heads, geometry.GRAD_HEAD_GROUP),
        }
        return tuple(sizes.get(d, d) for d in symbolic if d is not None)


def tiling(
    plan: VariantPlan, shape: tuple[int, int, int, int, int], kernel: KernelPlan | None = None
) -> Tiling:
    """Blocks shrink to the problem: rows to the plan's sublane granule, columns to whole compute blocks
    of every pass. The compute width is ``kernel``'s (the forward's where None)."""
    p = Shape(*shape)
    heads = plan.head_chunk or p.num_heads
    if p.num_heads % heads:
        raise ValueError(f"head_chunk {heads} does not divide num_heads {p.num_heads}")
    block_q, block_w = geometry.tiles(
        p.seq_len,
        p.num_blocks,
        plan.block_q,
        plan.block_w,
        (plan.compute_w, plan.fused_compute_w),
        plan.sublanes,
    )
    return Tiling(
        p,
        block_q,
        block_w,
        geometry.call_compute_w(block_w, getattr(plan, kernel.width if kernel else "compute_w")),
        heads,
        geometry.round_up(p.seq_len, block_q),
        geometry.round_up(p.num_blocks, block_w),
    )


@dataclasses.dataclass(frozen=True)
class BlockKinds:
    """The (q block, compute block) pairs of a call, over its batch, by what every kernel does with
    them; and its (q block, w tile) DMA tiles, by whether any of their compute blocks has work."""

    empty: int  # no query of the q block sees any of it: no matmul, no elementwise op
    full: int  # every query sees all of it: work, no mask
    partial: int  # work, and a mask built and applied
    tiles_with_work: int
    tiles: int
    # (batch, q block) and (batch, w tile) pairs with some work, and of all; 0 where not counted (every
    # one has work: ``unmasked_kinds``)
    q_blocks_with_work: int = 0
    q_blocks: int = 0
    w_tiles_with_work: int = 0
    w_tiles: int = 0
    # (q block, compressed block) pairs the forward's pieces cover (``_geometry.visible_pieces``); every
    # tile whole in ``unmasked_kinds``
    visible_columns: int = 0

    def by_ratio(self, axis: str) -> float:
        """The share of q blocks (``axis`` i) or w tiles (j) with work: their blocks alone are fetched
        (``_operands.park``); 1 where the counts were not given."""
        done, of = (
            (self.q_blocks_with_work, self.q_blocks)
            if axis == "i"
            else (self.w_tiles_with_work, self.w_tiles)
        )
        return done / of if of else 1.0

    @property
    def work(self) -> int:
        return self.full + self.partial

    @property
    def total(self) -> int:
        return self.empty + self.full + self.partial


def unmasked_kinds(t: Tiling) -> BlockKinds:
    """Every compute block doing unmasked work, every tile fetched: what a ``pl.CostEstimate`` assumes."""
    tiles_ = t.shape.batch * (t.seq_pad // t.block_q) * (t.blocks_pad // t.block_w)
    return BlockKinds(
        empty=0,
        full=tiles_ * (t.block_w // t.compute_w),
        partial=0,
        tiles_with_work=tiles_,
        tiles=tiles_,
        visible_columns=tiles_ * t.block_w,
    )


def _q_block_bounds(t: Tiling, kv_start, kv_end) -> list[np.ndarray]:
    """(any_lo, any_hi, all_lo, all_hi) of every q block, ``[B * q blocks, 1]``, as the kernels get them."""
    p = t.shape

    def padded(bound):  # clipped to the blocks that exist; padding queries see nothing
        bound = np.clip(np.asarray(bound, np.int64), 0, p.num_blocks).astype(np.int32)
        return np.pad(bound, ((0, 0), (0, t.seq_pad - p.seq_len)))

    return [
        np.asarray(b)[:, None]
        for b in geometry.query_block_bounds(padded(kv_start), padded(kv_end), t.block_q)
    ]


def walk_tails(t: Tiling, walk: str) -> list[int]:
    """The widths of the tail pieces a kernel walking its tiles by ``walk`` runs after its loop (widest
    first; none for compute blocks)."""
    return geometry.tail_widths(t.compute_w) if walk == plan_module.VISIBLE_PIECES else []


def _pieces(t: Tiling, bounds: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(big, rest) of the forward's walk (``_geometry.visible_pieces``) for every (q block, w tile),
    ``[B * q blocks, w tiles]``, from ``_q_block_bounds``."""
    tile_lo = np.arange(0, t.blocks_pad, t.block_w, dtype=np.int32)[None]
    _, big, rest = geometry.visible_pieces(*bounds[:2], tile_lo, t.block_w, t.compute_w)
    return np.asarray(big), np.asarray(rest)


def kind_matrix(t: Tiling, kv_start=None, kv_end=None, walk: str = plan_module.COMPUTE_BLOCKS) -> np.ndarray:
    """Every (q block, compute block) of a call as a kernel walking its tiles by ``walk`` classifies it:
    int8 [B * q blocks, pieces of the padded W], 0 empty, 1 full, 2 partial; without bounds, every
    compute block full. A walk of visible pieces has, per w tile, its loop's trips (partial up to
    ``big``, then empty) and then its tails (partial where taken), as ``_kernel_ops.each_visible_piece``
    runs them; unbounded, every trip full and no tail."""
    p = t.shape
    rows, n_blocks = p.batch * (t.seq_pad // t.block_q), t.block_w // t.compute_w
    tiles_ = t.blocks_pad // t.block_w
    tails = walk_tails(t, walk)
    if kv_start is None:
        per_tile = np.array([1] * n_blocks + [0] * len(tails), np.int8)
        return np.tile(per_tile, (rows, tiles_))
    bounds = _q_block_bounds(t, kv_start, kv_end)
    if walk == plan_module.VISIBLE_PIECES:
        big, rest = _pieces(t, bounds)
        trips = np.arange(n_blocks)[None, None] < big[:, :, None]
        taken = [(rest & w != 0)[:, :, None] for w in tails]
        return (2 * np.concatenate([trips, *taken], axis=2)).astype(np.int8).reshape(rows, -1)
    lo = np.arange(0, t.blocks_pad, t.compute_w, dtype=np.int32)[None]
    empty, full = (np.asarray(x) for x in geometry.block_kind(*bounds, lo, lo + t.compute_w))
    return np.where(empty, 0, np.where(full, 1, 2)).astype(np.int8)


def visible_columns(t: Tiling, kv_start, kv_end) -> int:
    """(q block, compressed block) pairs the forward's pieces cover over a call."""
    big, rest = _pieces(t, _q_block_bounds(t, kv_start, kv_end))
    return int((big * t.compute_w + rest).sum())


def block_kinds(t: Tiling, kv_start, kv_end) -> BlockKinds:
    """Classifies a call's compute blocks as its kernels do, from integer [B, S] visibility bounds."""
    kinds = kind_matrix(t, kv_start, kv_end)
    empty, full = kinds == 0, kinds == 1
    # A w tile has work iff one of its compute blocks has: its DMAs are the ones the index maps keep.
    tile_work = ~empty.reshape(empty.shape[0], -1, t.block_w // t.compute_w).all(axis=2)
    per_batch = tile_work.reshape(t.shape.batch, -1, tile_work.shape[1])  # [B, q blocks, w tiles]
    return BlockKinds(
        empty=int(empty.sum()),
        full=int(full.sum()),
        partial=int((~empty & ~full).sum()),
        tiles_with_work=int(tile_work.sum()),
        tiles=int(tile_work.size),
        q_blocks_with_work=int(per_batch.any(axis=2).sum()),
        q_blocks=per_batch.shape[0] * per_batch.shape[1],
        w_tiles_with_work=int(per_batch.any(axis=1).sum()),
        w_tiles=per_batch.shape[0] * per_batch.shape[2],
        visible_columns=visible_columns(t, kv_start, kv_end),
    )


def causal_bounds(shape: Shape, compress_rate: int) -> tuple[np.ndarray, np.ndarray]:
    """(kv_start, kv_end) of causal CSA from position 0: query p sees blocks w < (p + 1) // r, every sequence."""
    kv_end = np.broadcast_to((np.arange(shape.seq_len) + 1) // compress_rate, (shape.batch, shape.seq_len))
    return np.zeros_like(kv_end), kv_end


def causal_kinds(t: Tiling, compress_rate: int) -> BlockKinds:
    """``block_kinds`` of causal CSA from position 0."""
    return block_kinds(t, *causal_bounds(t.shape, compress_rate))


def padded_bytes(shape: tuple[int, ...], nbytes: int) -> int:
    """VMEM bytes of a block: last dim padded to 128 lanes, the one before to the dtype's row granule."""
    *lead, rows, cols = shape
    rows, cols = geometry.round_up(rows, geometry.SUBLANES_BY_ITEMSIZE[nbytes]), geometry.round_up(
        cols, geometry.LANES
    )
    return math.prod(lead) * rows * cols * nbytes


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """One pallas_call at one problem shape. Bytes are HBM bytes unless named vmem."""

    kernel: str
    grid: tuple[int, ...]
    blocks: dict[str, tuple[int, ...]]  # operand -> block shape in VMEM
    fetches: dict[str, int]  # operand -> DMAs of its block (reads for inputs, write-backs for outputs)
    vmem_bytes: int  # double-buffered blocks + scratch + temporaries, padded to (rows, 128) tiles
    vmem_bytes_unpadded: int  # the same, logical sizes
    hbm_bytes_by_operand: dict[str, int]  # every fetch and write-back, per operand
    min_hbm_bytes: int  # each input read once, each output written once, unpadded arrays
    mxu_flops: int  # executed: padded shapes, every MXU pass
    vpu_ops: int  # executed elementwise operations
    useful_flops: int  # unpadded, the matmuls the math needs, plus the elementwise work
    mxu_itemsize: int  # the type the MXU multiplies in: picks the chip's matmul rate
    kinds: BlockKinds  # the call's compute blocks (at the kernel's width) and tiles, as counted here

    @property
    def hbm_bytes(self) -> int:
        return sum(self.hbm_bytes_by_operand.values())

    @property
    def flops(self) -> int:
        """Every operation executed, MXU and VPU: what a ``pl.CostEstimate`` reports."""
        return self.mxu_flops + self.vpu_ops

    def intensity(self) -> float:
        """Executed operations per HBM byte moved."""
        return self.flops / self.hbm_bytes

    def compute_seconds(self, chip: Chip) -> float:
        """MXU work at its type's peak (float32 at highest precision: the chip's f32 rate, 1/6 of bf16 on
        TPU); elementwise work at the bf16 peak too, as the VPU's own rate is not a fact JAX exposes, so
        this is a lower bound."""
        mxu_rate, vpu_rate = (chip.matmul_flops_per_second(n) for n in (self.mxu_itemsize, 2))
        return self.mxu_flops / mxu_rate + self.vpu_ops / vpu_rate

    def memory_seconds(self, chip: Chip) -> float:
        return self.hbm_bytes / chip.hbm_bytes_per_second_per_device()

    def roofline_seconds(self, chip: Chip) -> float:
        """Lower bound on the time on one device of ``chip``: compute and HBM traffic fully overlapped."""
        return max(self.compute_seconds(chip), self.memory_seconds(chip))

    def bound(self, chip: Chip) -> str:
        return "compute" if self.compute_seconds(chip) >= self.memory_seconds(chip) else "memory"


def _min_bytes(block: Block, t: Tiling, nbytes: int) -> int:
    """Bytes of the whole unpadded array a block tiles: the padded array, less its padding rows/columns."""
    total = math.prod(t.dims(block.shape)) * nbytes * math.prod(t.extents[a] for a in block.follows)
    if "i" in block.follows:
        total = total // t.seq_pad * t.shape.seq_len
    if "j" in block.follows:
        total = total // t.blocks_pad * t.shape.num_blocks
    return total


def _vmem(buffers: list[tuple[tuple[int, ...], int]], padded: bool) -> int:
    return sum(padded_bytes(s, n) if padded else math.prod(s) * n for s, n in buffers)


def kernel_cost(
    plan: VariantPlan,
    kernel: KernelPlan,
    shape: tuple[int, int, int, int, int],
    bounds: tuple[np.ndarray, np.ndarray] | None = None,
) -> KernelCost:
    """The cost of one of the variant's pallas_calls at problem ``shape`` (B, H, S, D, W): every compute
    block doing unmasked work, or, given ``bounds`` (kv_start, kv_end [B, S]), exactly what the kernel
    executes under that mask (its compute blocks, of its own width: ``block_kinds``)."""
    t = tiling(plan, shape, kernel)
    p = t.shape
    grid = tuple(t.extents[a] for a in kernel.axes)
    blocks = {b.name: (t.dims(b.shape), geometry.itemsize(b.dtype)) for b in kernel.blocks}
    fetches = {
        b.name: geometry.block_fetches(
            grid, tuple(kernel.axes.index(a) for a in b.follows if a in kernel.axes)
        )
        for b in kernel.blocks
    }
    single: list[tuple[tuple[int, ...], int]] = [
        (t.dims(s.shape), geometry.itemsize(s.dtype)) for s in kernel.scratch + kernel.temporaries
    ]
    kinds = unmasked_kinds(t) if bounds is None else block_kinds(t, *bounds)
    # (query, compressed block) entries computed: of every compute block with work, or of every piece
    columns = kinds.work * t.compute_w if kernel.walk == plan_module.COMPUTE_BLOCKS else kinds.visible_columns
    pair_entries = t.block_q * columns
    entries = pair_entries * p.num_heads  # per head
    useful_entries = p.batch * p.num_heads * p.seq_len * p.num_blocks
    work = kernel.work
    masks_built = t.extents["c"] if work.mask_per_chunk else 1  # the mask over those entries, this often
    moved = {name: fetches[name] * math.prod(s) * n for name, (s, n) in blocks.items()}
    # A skipped tile's DMAs are those of the operands whose blocks hold still on it.
    skipped = kernel.skipped_operands()
    moved = {n: b * kinds.tiles_with_work // kinds.tiles if n in skipped else b for n, b in moved.items()}
    # A q block (w tile) with no work at all parks its own blocks on block 0's: fetched once, not again.
    parked = kernel.parked_operands()
    moved = {n: int(b * kinds.by_ratio(kernel.skip.by)) if n in parked else b for n, b in moved.items()}
    # (head, query, d) of q, every q block's last step
    finished = p.batch * t.seq_pad * p.num_heads * p.head_dim
    return KernelCost(
        kernel=kernel.name,
        grid=grid,
        blocks={name: s for name, (s, _) in blocks.items()},
        fetches=fetches,
        vmem_bytes=2 * _vmem(list(blocks.values()), True) + _vmem(single, True),
        vmem_bytes_unpadded=2 * _vmem(list(blocks.values()), False) + _vmem(single, False),
        hbm_bytes_by_operand=moved,
        min_hbm_bytes=sum(_min_bytes(b, t, blocks[b.name][1]) for b in kernel.blocks),
        mxu_flops=2 * entries * p.head_dim * work.mxu_passes
        + finished * t.heads * work.finish_mxu_per_head
        + p.batch * t.blocks_pad * p.head_dim * work.finish_mxu_per_key,
        vpu_ops=entries * work.vpu_ops
        + masks_built * pair_entries * work.mask_ops
        + finished * work.finish_vpu_ops,
        useful_flops=useful_entries * (2 * p.head_dim * work.useful_passes + work.vpu_ops),
        mxu_itemsize=plan.mxu_itemsize,
        kinds=kinds,
    )


def variant_costs(
    plan: VariantPlan,
    shape: tuple[int, int, int, int, int],
    bounds: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[KernelCost]:
    """Every pallas_call of the variant at shape (B, H, S, D, W) (under the mask of ``bounds``)."""
    return [kernel_cost(plan, kernel, shape, bounds) for kernel in plan.kernels]


def call_kernels(plan: VariantPlan, shape: tuple[int, int, int, int, int]) -> tuple[KernelPlan, ...]:
    """The kernels a forward and gradient call at ``shape`` runs: the forward, and the fused backward
    kernel where one w tile covers W, else the two (``plan.grad_kernels``)."""
    names = ("forward", *plan_module.grad_kernels(plan, tiling(plan, shape).extents["j"]))
    return tuple(k for k in plan.kernels if k.name in names)


def vmem_footprints(plan: VariantPlan, num_heads: int, head_dim: int) -> dict[str, int]:
    """Padded VMEM bytes of each pallas_call at full (block_q, block_w) tiles: the worst case over shapes,
    for validating a spec before any problem shape is known."""
    shape = (1, num_heads, plan.block_q, head_dim, plan.block_w)
    return {cost.kernel: cost.vmem_bytes for cost in variant_costs(plan, shape)}
