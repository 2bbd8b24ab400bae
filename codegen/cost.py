"""Cost model of each pallas_call of a generated variant: VMEM footprint, HBM traffic, FLOPs, roofline.

It mirrors the templates' grids and BlockSpecs (see any ``generated/csa_v4`` module) in plain Python, so
specs can be validated and variants compared without JAX or a device. Every tile is assumed active: the
kernels' tile skipping under kv_start/kv_end masks is not modelled, so for a masked call the numbers are
an upper bound. The scalar-prefetched tile ranges (a few int32 per q or w block) are left out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, NamedTuple

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    from codegen.chips import Chip

LANES = 128
# Rows of one TPU vreg tile by itemsize: a vreg is 8 sublanes of 32 bits, so narrower types pack more rows.
# The templates round shrunk q blocks to this granule; here it also pads every VMEM block's row dimension.
SUBLANES_BY_ITEMSIZE = {4: 8, 2: 16, 1: 32}
F32 = INT32 = 4
BF16 = 2
# Grid axes, outermost first: b batch, i q block, j w block, c head chunk (the templates' grid orders).
GRID_AXES = {"forward": "bijc", "dq_dweights": "bicj", "dk": "bjic"}
# Elementwise FLOPs per (head, query, block) entry besides the matmuls. forward: relu, weight multiply, head
# sum. dq_dweights: relu, g * relu, row sum (dweights); g * weight, relu' select (dlogits). dk: the dlogits 2,
# plus relu, weight multiply and head sum again when keys carry a scale (for dk_scale).
ELEMENTWISE_FLOPS = {"forward": 3, "dq_dweights": 5, "dk": 2}
K_SCALE_DK_FLOPS = 3


class Problem(NamedTuple):
    batch: int
    num_heads: int
    seq_len: int
    head_dim: int
    num_blocks: int


def itemsize(dtype: str) -> int:
    """Bytes per element of a numpy or ml_dtypes name ("float32", "bfloat16", "float8_e4m3fn", ...)."""
    return np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def padded_bytes(shape: tuple[int, ...], nbytes: int) -> int:
    """VMEM bytes of a block: last dim padded to 128 lanes, the one before to the dtype's row granule."""
    *lead, rows, cols = shape
    rows, cols = _round_up(rows, SUBLANES_BY_ITEMSIZE[nbytes]), _round_up(cols, LANES)
    return math.prod(lead) * rows * cols * nbytes


def block_fetches(grid: tuple[int, ...], axes: tuple[int, ...]) -> int:
    """DMAs of a block whose index follows grid ``axes``, in a row-major walk that re-fetches only on change.

    A step changes the block index iff it moves one of ``axes``; the last step that does is the one that
    moves the innermost such axis m of size > 1, so the index changes at every step of the grid cut after
    m: prod(grid[:m + 1]) fetches (1 when no axis moves). Outputs are written back as often.
    """
    moving = [a for a in axes if grid[a] > 1]
    return math.prod(grid[: max(moving) + 1]) if moving else 1


def mxu_itemsize(variant: dict) -> int:
    """Bytes of the type the MXU multiplies in: 4 only for float32 q/k at highest precision; the templates
    upcast float8 q/k to bfloat16 in VMEM, and float32 at default precision takes one bfloat16 pass."""
    qk = itemsize(variant["q_dtype"])
    return F32 if qk == F32 and variant.get("matmul_precision", "highest") == "highest" else BF16


_Buffer = tuple[tuple[int, ...], int]  # (shape, itemsize) of a single-buffered VMEM array


@dataclasses.dataclass(frozen=True)
class _Block:
    shape: tuple[int, ...]
    nbytes: int  # itemsize
    axes: str  # grid axes its block index follows, of "bijc"


@dataclasses.dataclass(frozen=True)
class Tiling:
    """One call's effective tiling, as the generated ``_tiles`` and ``_prepare`` compute it."""

    problem: Problem
    block_q: int
    block_w: int
    head_chunk: int
    seq_pad: int
    blocks_pad: int

    @property
    def sizes(self) -> dict[str, int]:
        """Grid extent of each axis."""
        p = self.problem
        return {
            "b": p.batch,
            "i": self.seq_pad // self.block_q,
            "j": self.blocks_pad // self.block_w,
            "c": p.num_heads // self.head_chunk,
        }


def tiling(variant: dict, shape: tuple[int, int, int, int, int]) -> Tiling:
    """Blocks shrink to the problem: rows to the narrowest q-row dtype's granule, columns to 128 lanes."""
    p = Problem(*shape)
    if variant["backend"] != "tpu":
        raise ValueError(f"the cost model covers the TPU kernels only, got backend {variant['backend']!r}")
    if variant["q_layout"] not in ("head_major", "seq_major"):
        raise ValueError(f"unknown q_layout {variant['q_layout']!r}; expected 'head_major' or 'seq_major'")
    chunk = variant["head_chunk"] or p.num_heads
    if p.num_heads % chunk:
        raise ValueError(f"head_chunk {chunk} does not divide num_heads {p.num_heads}")
    narrowest = min(itemsize(variant[k]) for k in ("q_dtype", "weights_dtype", "out_dtype"))
    block_q = min(variant["block_q"], _round_up(p.seq_len, SUBLANES_BY_ITEMSIZE[narrowest]))
    block_w = min(variant["block_w"], _round_up(p.num_blocks, LANES))
    return Tiling(p, block_q, block_w, chunk, _round_up(p.seq_len, block_q), _round_up(p.num_blocks, block_w))


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """One pallas_call at one problem shape. Bytes are HBM bytes unless named vmem."""

    kernel: str  # "forward" | "dq_dweights" | "dk"
    grid: tuple[int, ...]
    blocks: dict[str, tuple[int, ...]]  # operand -> block shape in VMEM
    fetches: dict[str, int]  # operand -> DMAs of its block (reads for inputs, write-backs for outputs)
    vmem_bytes: int  # double-buffered blocks + scratch + intermediates, padded to (rows, 128) tiles
    vmem_bytes_unpadded: int  # the same, logical sizes
    hbm_bytes: int  # every fetch and write-back
    hbm_bytes_by_operand: dict[str, int]  # the same, per operand
    min_hbm_bytes: int  # each input read once, each output written once, unpadded arrays
    flops: int  # executed: padded shapes, every MXU pass
    matmul_flops: int  # the MXU part of flops
    useful_flops: int  # unpadded, one pass per matmul
    mxu_itemsize: int  # see mxu_itemsize(): picks the chip's matmul rate
    transcendentals: int = 0

    def intensity(self) -> float:
        """Executed FLOPs per HBM byte moved."""
        return self.flops / self.hbm_bytes

    def compute_seconds(self, chip: Chip) -> float:
        """MXU work at its type's peak (float32 at highest precision: the chip's f32 rate, 1/6 of bf16 on
        TPU), elementwise work at the bf16 peak: the VPU's own rate is not a fact JAX exposes."""
        mxu_rate, bf16_rate = (chip.matmul_flops_per_second(n) for n in (self.mxu_itemsize, BF16))
        return self.matmul_flops / mxu_rate + (self.flops - self.matmul_flops) / bf16_rate

    def memory_seconds(self, chip: Chip) -> float:
        return self.hbm_bytes / chip.hbm_bytes_per_second_per_device()

    def roofline_seconds(self, chip: Chip) -> float:
        """Lower bound on the time on one device of ``chip``: compute and HBM traffic fully overlapped."""
        return max(self.compute_seconds(chip), self.memory_seconds(chip))


def _blocks(variant: dict, t: Tiling, kernel: str) -> tuple[dict[str, _Block], list[_Buffer]]:
    """The pipelined blocks, and the (shape, itemsize) of single-buffered scratch and intermediates."""
    bq, bw, hc, d = t.block_q, t.block_w, t.head_chunk, t.problem.head_dim
    q_shape = (hc, bq, d) if variant["q_layout"] == "head_major" else (bq, hc * d)
    qb, kb, wb, ob = (itemsize(variant[k]) for k in ("q_dtype", "k_dtype", "weights_dtype", "out_dtype"))
    grad = itemsize(variant.get("q_grad_dtype", variant["q_dtype"]))  # dq and dk
    k_scale = bool(variant.get("k_scale"))
    tile = (bq, bw)
    blocks = {
        "q": _Block(q_shape, qb, "bci"),
        "k": _Block((bw, d), kb, "bj"),
        "weights": _Block((bq, hc), wb, "bci"),
        "kv_bounds": _Block((bq, 2), INT32, "bi"),
    }
    if k_scale:
        blocks["k_scale"] = _Block((1, bw), F32, "bj")
    # float8 q/k: the bf16 copies of one q head and of the k tile that feed the MXU.
    upcast = [((bq, d), BF16), ((bw, d), BF16)] if qb == 1 else []
    if kernel == "forward":
        blocks["out"] = _Block(tile, ob, "bij")
        # The chunk accumulator when heads are chunked; one head's logits and relu'd term.
        scratch = [tile] * (2 + bool(variant["head_chunk"]))
    elif kernel == "dq_dweights":
        blocks["g"] = _Block(tile, ob, "bij")
        blocks["dq"] = _Block(q_shape, grad, "bci")
        blocks["dweights"] = _Block((bq, hc), wb, "bci")
        # dq and dweights accumulators; logits, g in f32, dlogits.
        scratch = [q_shape, (bq, hc)] + [tile] * 3
    else:
        blocks["g"] = _Block(tile, ob, "bij")
        blocks["dk"] = _Block((bw, d), grad, "bj")
        # dk accumulator; logits, g in f32, dlogits, and dlogits transposed for the dk matmul.
        scratch = [(bw, d)] + [tile] * 3 + [(bw, bq)]
        if k_scale:
            blocks["dk_scale"] = _Block((1, bw), F32, "bj")
            scratch += [(1, bw), tile]  # dk_scale accumulator; the running weighted relu sum
    return blocks, [(s, F32) for s in scratch] + upcast


def _min_bytes(block: _Block, t: Tiling) -> int:
    """Bytes of the whole unpadded array a block tiles: the padded array, less its padding rows/columns."""
    total = math.prod(block.shape) * block.nbytes * math.prod(t.sizes[a] for a in block.axes)
    if "i" in block.axes:
        total = total // t.seq_pad * t.problem.seq_len
    if "j" in block.axes:
        total = total // t.blocks_pad * t.problem.num_blocks
    return total


def flop_model(variant: dict) -> dict[str, tuple[int, int]]:
    """Per kernel of the variant: (MXU passes per logits-sized matmul, elementwise FLOPs per entry).

    The generated modules compute their ``pl.CostEstimate`` from these, so this model is their source.
    """
    split = 1 if itemsize(variant["q_dtype"]) == F32 else 2
    k_scale_flops = K_SCALE_DK_FLOPS if variant.get("k_scale") else 0
    model = {"forward": (1, ELEMENTWISE_FLOPS["forward"])}
    model["dq_dweights"] = (1 + split, ELEMENTWISE_FLOPS["dq_dweights"])
    model["dk"] = (1 + split, ELEMENTWISE_FLOPS["dk"] + k_scale_flops)
    return {kernel: model[kernel] for kernel in kernels(variant)}


def _flops(variant: dict, kernel: str, t: Tiling) -> tuple[int, int, int]:
    """(executed, executed matmul, useful) FLOPs.

    One logits matmul is 2 * B * H * S * W * D. The backward kernels recompute logits and run one gradient
    matmul; for q/k narrower than float32 that matmul splits the float32 gradient tile into a head and a
    tail of the MXU type (the templates' ``_matmul_f32``), so it executes twice.
    """
    p = t.problem
    entries = p.batch * p.num_heads * t.seq_pad * t.blocks_pad
    useful_entries = p.batch * p.num_heads * p.seq_len * p.num_blocks
    passes, elementwise = flop_model(variant)[kernel]
    useful_passes = 1 if kernel == "forward" else 2
    matmul = 2 * entries * p.head_dim * passes
    useful = useful_entries * (2 * p.head_dim * useful_passes + elementwise)
    return matmul + entries * elementwise, matmul, useful


def kernel_cost(variant: dict, shape: tuple[int, int, int, int, int], kernel: str) -> KernelCost:
    """The cost of one of the variant's pallas_calls at problem ``shape`` (B, H, S, D, W)."""
    t = tiling(variant, shape)
    order = GRID_AXES[kernel]
    if not variant["head_chunk"]:
        order = order.replace("c", "")  # all heads in one step: the templates drop the chunk axis
    grid = tuple(t.sizes[a] for a in order)
    blocks, scratch = _blocks(variant, t, kernel)
    fetches = {
        name: block_fetches(grid, tuple(order.index(a) for a in b.axes if a in order))
        for name, b in blocks.items()
    }
    block_bytes = {name: math.prod(b.shape) * b.nbytes for name, b in blocks.items()}
    flops, matmul, useful = _flops(variant, kernel, t)
    return KernelCost(
        kernel=kernel,
        grid=grid,
        blocks={name: b.shape for name, b in blocks.items()},
        fetches=fetches,
        vmem_bytes=2 * sum(padded_bytes(b.shape, b.nbytes) for b in blocks.values())
        + sum(padded_bytes(s, n) for s, n in scratch),
        vmem_bytes_unpadded=2 * sum(block_bytes.values()) + sum(math.prod(s) * n for s, n in scratch),
        hbm_bytes=sum(fetches[name] * block_bytes[name] for name in blocks),
        hbm_bytes_by_operand={name: fetches[name] * block_bytes[name] for name in blocks},
        min_hbm_bytes=sum(_min_bytes(b, t) for b in blocks.values()),
        flops=flops,
        matmul_flops=matmul,
        useful_flops=useful,
        mxu_itemsize=mxu_itemsize(variant),
    )


def kernels(variant: dict) -> tuple[str, ...]:
    """The variant's pallas_calls: the forward, and the fused backward's two (a reference backward is XLA)."""
    if variant["backward"] == "fused":
        return ("forward", "dq_dweights", "dk")
    if variant["backward"] == "reference":
        return ("forward",)
    raise ValueError(f"unknown backward {variant['backward']!r}; expected 'fused' or 'reference'")


def variant_costs(variant: dict, shape: tuple[int, int, int, int, int]) -> list[KernelCost]:
    """Every pallas_call of ``variant`` (a generated module's VARIANT dict) at shape (B, H, S, D, W)."""
    return [kernel_cost(variant, shape, kernel) for kernel in kernels(variant)]


def vmem_footprints(variant: dict, num_heads: int, head_dim: int) -> dict[str, int]:
    """Padded VMEM bytes of each pallas_call at full (block_q, block_w) tiles: the worst case over shapes,
    for validating a spec before any problem shape is known."""
    shape = (1, num_heads, variant["block_q"], head_dim, variant["block_w"])
    return {cost.kernel: cost.vmem_bytes for cost in variant_costs(variant, shape)}
