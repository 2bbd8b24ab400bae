"""The kernel plan: every pallas_call of a variant, stated once.

Per kernel: the grid axes in order with their semantics, each operand's block (shape, and which
grid axes its block index follows), VMEM scratch, the scalar-prefetch operands, how a skipped step
holds its blocks still, and the work model. The templates render grids, semantics, index maps and
kernel signatures from it; ``cost`` counts bytes and FLOPs from it; ``budget`` sizes VMEM from it;
``explain``, the benchmarks and the tests read it. Nothing else describes a kernel's geometry.

Grid axes are single letters: ``b`` batch, ``i`` q block, ``j`` w block, ``c`` head chunk. Block
dimensions are symbols resolved per call (``block_q``, ``block_w``, ``compute_w``, ``head_dim``,
``heads``: heads per grid step, ``num_heads``: all of them), integers, or None (a squeezed dimension).

A grid step's blocks are one DMA's worth (``block_q x block_w``); inside it every kernel steps
through ``block_w // compute_w`` compute blocks (of its own width: ``KernelPlan.width``), each
classified from four int32 of its q block (``codegen/shipped/_geometry.py``) as empty (no work),
full or partial; only empty is branched on, and every block with work is masked.
"""

from __future__ import annotations

import dataclasses

from codegen.variants import Variant
from codegen.shipped import _geometry as geometry

PARALLEL, ARBITRARY = "parallel", "arbitrary"
AXES = "bcij"  # every block index is written over these: batch, head chunk, q block, w block
Dim = str | int | None


@dataclasses.dataclass(frozen=True)
class GridAxis:
    name: str  # one of AXES
    semantics: str  # PARALLEL, or ARBITRARY for an axis the kernel reduces over


@dataclasses.dataclass(frozen=True)
class Block:
    """One operand's VMEM block, by ``name`` the same in every kernel that has it. A kernel that takes
    an operand in another block names that block apart and says which operand it holds (``operand``):
    a head-chunked variant's forward reads every head of q and weights in one block."""

    name: str
    shape: tuple[Dim, ...]
    index: tuple[str | int, ...]  # per array dimension: the grid axis it follows, or a fixed block 0
    dtype: str
    # An output's whole array: its shape (symbols of the prepared operands ``x``, or the name of the
    # operand it mirrors), the variant dtype it takes ("out": the call's), and the input whose gradient
    # it is (float32 where that input arrived upcast; see _operands.grad_dtype).
    array: tuple[str, ...] | str = ()
    dtype_key: str = ""
    grad_of: str = ""
    operand: str = ""  # the operand it is a block of, where that is not ``name``

    @property
    def arg(self) -> str:
        """The operand it is a block of: the kernel's ref and the prepared array are named so."""
        return self.operand or self.name

    @property
    def follows(self) -> str:
        """The grid axes this block's index moves with."""
        return "".join(d for d in self.index if isinstance(d, str))


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A single-buffered VMEM array: a scratch accumulator, or an in-flight value of the kernel body."""

    name: str
    shape: tuple[Dim, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class Skip:
    """How a step that no query may see does nothing: ``axis`` is clamped into ``[lo, hi)``, two
    scalar-prefetch arrays indexed by (batch, ``by``), so the blocks that follow it name a block
    already in VMEM; the ``hold`` axes (inner to ``axis``) keep the value of the neighbouring step
    that does work, for the same reason."""

    axis: str
    by: str
    lo: str
    hi: str
    hold: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Work:
    """Per (head, query, compressed block) entry of a compute block with work: logits-sized MXU
    matmuls (2 * head_dim FLOPs each) and elementwise (VPU) operations; and per (query, compressed
    block) entry of a compute block with work, the operations that build and apply its mask, once per
    grid step over head chunks (``mask_per_chunk``) or once in all."""

    mxu_passes: int
    vpu_ops: int
    useful_passes: int  # the matmuls the math needs; the rest split a float32 operand for accuracy
    mask_ops: int = 6  # iota, its offset, two compares, their and, the select
    mask_per_chunk: bool = True
    # Once per q block (and head chunk), at the reduction's last step, per (head, query, d) of q:
    # elementwise operations, and MXU FLOPs per head of the step (each head's weights broadcast across
    # D by an exact matmul of the step's weights [block_q, heads] by a one-hot).
    finish_vpu_ops: int = 0
    finish_mxu_per_head: int = 0
    # Once per w tile, at the reduction's last step, MXU FLOPs per (compressed block, d) of k.
    finish_mxu_per_key: int = 0


# The kernels a call runs, by program: a gradient runs ``dq_dk`` where one w tile covers W (the call's
# block_w, ``_operands.prepare``), else ``dq_dweights`` and ``dk``. ``grad_kernels`` says which.
SPLIT_GRAD = ("dq_dweights", "dk")
FUSED_GRAD = ("dq_dk",)


# Kernels a variant may go without: the budget drops one that does not fit every target chip's VMEM
# (``dq_dk`` holds dq's accumulator and dk's at once), and its calls run the split ones.
OPTIONAL = frozenset(FUSED_GRAD)


def grad_kernels(plan: VariantPlan, num_w_blocks: int) -> tuple[str, ...]:
    """The backward kernels of a call of ``plan`` whose W takes ``num_w_blocks`` w tiles."""
    fused = num_w_blocks == 1 and any(k.name == FUSED_GRAD[0] for k in plan.kernels)
    return FUSED_GRAD if fused else SPLIT_GRAD


def without(plan: VariantPlan, name: str) -> VariantPlan:
    """``plan`` without its kernel ``name`` (one of OPTIONAL)."""
    return dataclasses.replace(plan, kernels=tuple(k for k in plan.kernels if k.name != name))


COMPUTE_BLOCKS, VISIBLE_PIECES = "compute_blocks", "visible_pieces"  # KernelPlan.walk


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    name: str  # "forward" | "dq_dweights" | "dk" | "dq_dk"
    grid: tuple[GridAxis, ...]
    scalar_prefetch: tuple[str, ...]
    inputs: tuple[Block, ...]
    outputs: tuple[Block, ...]
    scratch: tuple[Buffer, ...]  # the pallas_call's scratch_shapes
    temporaries: tuple[Buffer, ...]  # values the body holds at once besides scratch (VMEM budget only)
    skip: Skip
    work: Work
    vmem_limit_bytes: int | None = None  # set by the budget: None where the default scope suffices
    # How a step walks its w tile: whole compute blocks, each skipped when the q block sees none of it
    # (COMPUTE_BLOCKS), or pieces covering just the columns it may see (VISIBLE_PIECES: the forward's,
    # ``_geometry.visible_pieces``)
    walk: str = COMPUTE_BLOCKS
    # Which of the tiling's compute widths the kernel steps through a block_w tile by (the "compute_w"
    # of its buffers' shapes): "compute_w", or the fused backward's "fused_compute_w"
    width: str = "compute_w"

    @property
    def axes(self) -> str:
        return "".join(a.name for a in self.grid)

    @property
    def semantics(self) -> tuple[str, ...]:
        return tuple(a.semantics for a in self.grid)

    @property
    def reduced(self) -> str:
        """Axes the kernel accumulates over: it zeroes at their first step and stores at their last."""
        return "".join(a.name for a in self.grid if a.semantics == ARBITRARY)

    @property
    def blocks(self) -> tuple[Block, ...]:
        return self.inputs + self.outputs

    def skipped_operands(self) -> tuple[str, ...]:
        """Operands whose block holds still on a skipped step: those following the skipped or held axes.
        The forward's output is written at every step, skipped or not."""
        still = {self.skip.axis, *self.skip.hold}
        return tuple(b.name for b in self.inputs if still & set(b.follows))

    def parked_operands(self) -> tuple[str, ...]:
        """Inputs fetched only for a q block (w tile) with some work: they follow the axis the skip is
        decided by, and not a skipped one (a block with none names block 0's: ``_operands.park``)."""
        skipped = self.skipped_operands()
        return tuple(b.name for b in self.inputs if self.skip.by in b.follows and b.name not in skipped)


@dataclasses.dataclass(frozen=True)
class VariantPlan:
    variant: Variant
    block_q: int
    block_w: int
    compute_w: int  # compressed blocks per compute step inside a block_w tile
    fused_compute_w: int  # the same in the fused backward (dq_dk)
    head_chunk: int  # 0: all heads in one grid step
    sublanes: int  # row granule of a shrunk q block: the narrowest dtype of q, weights and output
    mxu_itemsize: int  # the type the MXU multiplies in: 4 only for float32 at highest precision
    mxu_operand: str  # the dtype q and k meet the MXU in: float8 is upcast to bfloat16 in VMEM (exact)
    # float32 dlogits meet the MXU "split" into a head and a tail of its type (two passes), rounded to
    # "bf16" (one pass), or "plain" (float32 q/k: one pass at the variant's precision)
    grad_matmul: str
    # the cotangent is exact in the MXU's type (a score in that dtype): dk transposes it, masked, in that
    # type and takes each head's weight on q (``_kernel_ops.dk``)
    exact_cotangent: bool
    # MXU passes of the masked cotangent by k in dq (``_kernel_ops.masked_cotangent_by_k``): 1 where it is
    # exact in the MXU's type or rounded to it, 2 where a float32 one is split into a head and a tail
    cotangent_parts: int
    kernels: tuple[KernelPlan, ...]

    @property
    def name(self) -> str:
        return self.variant.name

    def kernel(self, name: str) -> KernelPlan:
        return next(k for k in self.kernels if k.name == name)

    @property
    def dense_module(self) -> str:
        """The generated module whose dense kernels this variant runs: one per kernel shape (q layout,
        head chunking, float8 upcast, key scale), shared by every tiling and dtype of that shape,
        which the variant passes in as its ``_operands.Config``."""
        v, policy = self.variant, self.variant.policy
        upcast = self.mxu_operand != policy.qk
        name = f"_dense_{'hm' if v.head_major else 'sm'}_{'hc' if v.head_chunk else 'hcall'}"
        name += "_fp8" if upcast else ""
        if policy.k_scale != upcast:
            name += "_kscale" if policy.k_scale else "_noscale"
        return name

    @property
    def blocks(self) -> dict[str, Block]:
        """Every operand's block, over all kernels (an operand's block is the same in each)."""
        return {b.name: b for k in self.kernels for b in k.blocks}


def _blocks(variant: Variant) -> dict[str, Block]:
    policy = variant.policy
    chunked = variant.head_chunk > 0
    if variant.head_major:
        q = Block("q", (None, "heads", "block_q", "head_dim"), ("b", "c", "i", 0), policy.qk)
    else:  # [B, S, H, D] as it lies in HBM: a head chunk is a slice of the sublanes of each query's [H, D]
        q = Block("q", (None, "block_q", "heads", "head_dim"), ("b", "i", "c", 0), policy.qk)
    if chunked:  # [B, H // chunk, S, chunk]: one full-width block per chunk
        weights = Block("weights", (None, None, "block_q", "heads"), ("b", "c", "i", 0), policy.weights)
    else:
        weights = Block("weights", (None, "block_q", "heads"), ("b", "i", 0), policy.weights)
    if variant.head_major:  # the forward's: every head of the q block (one matmul per head chunk)
        q_all_heads = Block(
            "q_all_heads", (None, "num_heads", "block_q", "head_dim"), ("b", 0, "i", 0), policy.qk
        )
    else:
        q_all_heads = Block(
            "q_all_heads", (None, "block_q", "num_heads", "head_dim"), ("b", "i", 0, 0), policy.qk
        )
    q_all_heads = dataclasses.replace(q_all_heads, operand="q")
    weights_all_heads = Block(
        "weights_all_heads",
        (None, "num_chunks", "block_q", "heads"),
        ("b", 0, "i", 0),
        policy.weights,
        operand="weights",
    )
    k = Block("k", (None, "block_w", "head_dim"), ("b", "j", 0), policy.qk)
    k_scale = Block("k_scale", (None, 1, "block_w"), ("b", 0, "j"), "float32")
    tile = (None, "block_q", "block_w"), ("b", "i", "j")
    return {
        "q": q,
        "q_all_heads": q_all_heads,
        "weights_all_heads": weights_all_heads,
        "k": k,
        "weights": weights,
        "kv_bounds": Block("kv_bounds", (None, "block_q", 2), ("b", "i", 0), "int32"),
        "k_scale": k_scale,
        "out": Block("out", *tile, policy.out, array=("batch", "seq_pad", "blocks_pad"), dtype_key="out"),
        "g": Block("g", *tile, policy.out),
        "dq": dataclasses.replace(
            q, name="dq", dtype=policy.qk_grad_dtype, array="q", dtype_key="qk_grad", grad_of="q"
        ),
        "dweights": dataclasses.replace(
            weights, name="dweights", array="weights", dtype_key="weights", grad_of="weights"
        ),
        "dk": dataclasses.replace(
            k, name="dk", dtype=policy.qk_grad_dtype, array="k", dtype_key="qk_grad", grad_of="k"
        ),
        "dk_scale": dataclasses.replace(k_scale, name="dk_scale", array="k_scale", dtype_key="float32"),
    }


def _grid(chunked: bool, *axes: tuple[str, str]) -> tuple[GridAxis, ...]:
    return tuple(GridAxis(name, semantics) for name, semantics in axes if chunked or name != "c")


def _skip(grid: tuple[GridAxis, ...], axis: str, by: str, lo: str, hi: str) -> Skip:
    names = "".join(a.name for a in grid)
    hold = tuple(a for a in "c" if a in names and names.index(a) > names.index(axis))
    return Skip(axis, by, lo, hi, hold)


F32 = "float32"


def build(variant: Variant) -> VariantPlan:
    """The plan of every pallas_call the variant renders (the VMEM limits are the budget's to set)."""
    policy = variant.policy
    chunked = variant.head_chunk > 0
    blocks = _blocks(variant)
    scaled = policy.k_scale
    tile = Buffer("tile", ("block_q", "compute_w"), F32)  # one compute block's head sum, or cotangent
    # The heads stacked against one key block: q as [heads * block_q, D] in the MXU type (float8 is
    # upcast), and the compute block of k.
    stacked_q = Buffer("stacked_q", ("heads", "block_q", "head_dim"), policy.mxu_dtype)
    k_tile = (
        (Buffer("k_tile", ("compute_w", "head_dim"), policy.mxu_dtype),)
        if policy.mxu_dtype != policy.qk
        else ()
    )
    # The backward kernels stack GRAD_HEAD_GROUP heads per matmul ("grad_heads") and their gradient
    # matmul contracts dlogits over the compute block, so a group's logits are held whole (float32),
    # beside dlogits in the type the MXU takes them in (a head and a tail of it where split).
    logits = Buffer("logits", ("grad_heads", "block_q", "compute_w"), F32)
    if policy.mxu_dtype == F32:
        grad_matmul, grad_passes = "plain", 1
    else:
        grad_matmul, grad_passes = policy.grad_matmul, 2 if policy.grad_matmul == "split" else 1
    dlogits = (Buffer("dlogits", ("grad_heads", "block_q", "compute_w"), policy.mxu_dtype),) * grad_passes
    # A score in the MXU's type: its cotangent is exact there, and dk transposes the masked g in that
    # type (a key scale waits for the w tile's finish). dq's head weights (constant along a row of
    # dlogits) always leave its matmul: dq is the masked g by k, one exact pass where g is exact and
    # unscaled, else g (times any key scale; float32) meets the MXU as grad_matmul says: a head and a
    # tail of the MXU type, each exact there (two passes, split on [block_q, compute_w] once for all
    # heads), or rounded (one).
    exact_cotangent = policy.out == policy.mxu_dtype
    cotangent_parts = 1 if exact_cotangent and not policy.k_scale else grad_passes
    whole_logits = (Buffer("logits", ("heads", "block_q", "compute_w"), F32),)
    highest_f32 = policy.mxu_dtype == F32 and policy.precision == "highest"
    grad_stacked_q = Buffer("stacked_q", ("grad_heads", "block_q", "head_dim"), policy.mxu_dtype)
    inputs = tuple(
        blocks[n] for n in ("q", "k", "weights", "kv_bounds", "k_scale") if n != "k_scale" or scaled
    )
    # Scalar prefetch (SMEM), flattened over the batch: per q block, the w tiles it has work in
    # (the index maps' skip range) and the range outside which no query of it sees a block: its compute
    # blocks are empty or not by it (full and partial ones run the same masked code).
    q_block_ranges = ("w_lo", "w_hi", "any_lo", "any_hi")

    # The forward contracts every head in a grid step, a head chunk per matmul where the variant has
    # chunks: its scores are stored in the region that sums them, and a step's fixed cost and each
    # compute block's masked store are paid once for all heads (a grid step per chunk paid them per
    # chunk, and stored the scores in a region of their own: 1.16x MaxText's step, compiled on v6e).
    forward_grid = _grid(False, ("b", PARALLEL), ("i", PARALLEL), ("j", PARALLEL))
    forward_inputs = tuple(
        blocks[f"{b.name}_all_heads"] if chunked and b.name in ("q", "weights") else b for b in inputs
    )
    kernels = [
        KernelPlan(
            name="forward",
            grid=forward_grid,
            scalar_prefetch=q_block_ranges,
            inputs=forward_inputs,
            outputs=(blocks["out"],),
            scratch=(),
            # the logits stream out of the MXU into the head sum a group of heads at a time: that group's
            # logits, the sum (and, over chunks, its running total) and the scores are whole (v5e's
            # compiler: 17.3 MiB at 256 x 2048 / 128, 19.6 at / 256, all heads), except at HIGHEST, where
            # float32 operands go as bfloat16 passes and the compiler holds the block's logits whole (7x:
            # the all-heads 128 x 1024 float32 forward needs over 32 MiB)
            temporaries=(stacked_q, tile, tile)
            + ((tile,) if chunked else ())
            + k_tile
            + (whole_logits if highest_f32 else (logits,)),
            skip=_skip(forward_grid, "j", "i", "w_lo", "w_hi"),
            # relu, weight multiply, head sum; the mask once, on the scores
            work=Work(mxu_passes=1, vpu_ops=3, useful_passes=1, mask_per_chunk=False),
            # the float32 forward at HIGHEST (six bfloat16 passes a matmul) keeps whole compute blocks:
            # with the walk's tail pieces, libtpu took 468 s to compile it for 7x against 213 without,
            # for variants that check results rather than race
            walk=COMPUTE_BLOCKS if highest_f32 else VISIBLE_PIECES,
        )
    ]
    # dq's finish broadcasts each head's weights along D by the MXU (a one-hot matmul) where heads are
    # a major axis; sequence-major stacking has them along sublanes already
    finish_mxu_per_head = 2 if variant.head_major else 0
    if variant.backward == "fused":
        dq_grid = _grid(chunked, ("b", PARALLEL), ("i", PARALLEL), ("c", PARALLEL), ("j", ARBITRARY))
        q_block = blocks["q"].shape[1:]
        kernels.append(
            KernelPlan(
                name="dq_dweights",
                grid=dq_grid,
                scalar_prefetch=q_block_ranges,
                inputs=inputs + (blocks["g"],),
                outputs=(blocks["dq"], blocks["dweights"]),
                scratch=(Buffer("dq_acc", q_block, F32),),
                temporaries=(grad_stacked_q, logits, tile)
                + dlogits[:cotangent_parts]
                + k_tile,  # tile: the cotangent in float32
                skip=_skip(dq_grid, "j", "i", "w_lo", "w_hi"),
                # the relu' select of each part of the masked cotangent; once per q block on the summed
                # [rows, D]: the weights (head-major: broadcast by the MXU; sequence-major: moved to
                # sublanes) and the scale on it, q times it and its row sum
                work=Work(
                    mxu_passes=1 + cotangent_parts,
                    vpu_ops=cotangent_parts,
                    useful_passes=2,
                    finish_vpu_ops=4,
                    finish_mxu_per_head=finish_mxu_per_head,
                ),
            )
        )
        dk_grid = _grid(chunked, ("b", PARALLEL), ("j", PARALLEL), ("i", ARBITRARY), ("c", ARBITRARY))
        dk_scratch = (Buffer("dk_acc", ("block_w", "head_dim"), F32),)
        dk_temporaries = (grad_stacked_q, logits, tile) + dlogits + k_tile  # tile: the cotangent in float32
        kernels.append(
            KernelPlan(
                name="dk",
                grid=dk_grid,
                # The skip range first (the index maps read it); no w tile range: dk does not skip along j.
                scalar_prefetch=("q_lo", "q_hi") + q_block_ranges[2:],
                inputs=inputs + (blocks["g"],),
                outputs=(blocks["dk"],) + ((blocks["dk_scale"],) if scaled else ()),
                scratch=dk_scratch,
                temporaries=dk_temporaries,
                skip=_skip(dk_grid, "i", "j", "q_lo", "q_hi"),
                # the dlogits select and multiply; with a key scale, once per w tile: the scale broadcast
                # along D and the row sums of k * dk (dk_scale), each an exact MXU dot with ones
                work=Work(
                    mxu_passes=1 + grad_passes, vpu_ops=2, useful_passes=2, finish_mxu_per_key=4 * scaled
                ),
            )
        )
        # Where one w tile covers W, one kernel does both (``FUSED_GRAD``): each compute block's logits
        # are computed once for dq and dk, where the two above compute them once each. dk is reduced over
        # q blocks and chunks (the dk kernel's grid); dq and dweights are finished at each step, whose
        # q block (and chunk) has seen its only w tile.
        dq_dk_grid = _grid(chunked, ("b", PARALLEL), ("j", PARALLEL), ("i", ARBITRARY), ("c", ARBITRARY))
        kernels.append(
            KernelPlan(
                name="dq_dk",
                grid=dq_dk_grid,
                scalar_prefetch=q_block_ranges,
                inputs=inputs + (blocks["g"],),
                outputs=(blocks["dq"], blocks["dweights"], blocks["dk"])
                + ((blocks["dk_scale"],) if scaled else ()),
                scratch=(Buffer("dq_acc", q_block, F32),) + dk_scratch,
                temporaries=dk_temporaries,
                skip=_skip(dq_dk_grid, "j", "i", "w_lo", "w_hi"),
                # it holds dq's and dk's temporaries for each compute block at once
                width="fused_compute_w",
                work=Work(
                    mxu_passes=1 + cotangent_parts + grad_passes,
                    vpu_ops=cotangent_parts + 2,
                    useful_passes=3,
                    finish_vpu_ops=4,
                    finish_mxu_per_head=finish_mxu_per_head,
                    finish_mxu_per_key=4 * scaled,
                ),
            )
        )
    narrowest = min((policy.qk, policy.weights, policy.out), key=geometry.itemsize)
    mxu_itemsize = 4 if policy.mxu_dtype == F32 and policy.precision == "highest" else 2
    return VariantPlan(
        variant=variant,
        block_q=variant.block_q,
        block_w=variant.block_w,
        compute_w=variant.compute_w,
        fused_compute_w=variant.fused_compute_w,
        head_chunk=variant.head_chunk,
        sublanes=geometry.sublanes(narrowest),
        mxu_itemsize=mxu_itemsize,
        mxu_operand=policy.mxu_dtype,
        grad_matmul=grad_matmul,
        exact_cotangent=exact_cotangent,
        cotangent_parts=cotangent_parts,
        kernels=tuple(kernels),
    )


def with_vmem_limits(plan: VariantPlan, limits: dict[str, int | None]) -> VariantPlan:
    kernels = tuple(dataclasses.replace(k, vmem_limit_bytes=limits[k.name]) for k in plan.kernels)
    return dataclasses.replace(plan, kernels=kernels)


# The sparse kernels (``sparse_score``): a plan of their own, as they share nothing of the variant's
# BLOCK_Q x BLOCK_W tiling or head chunk. Their grid is (b batch, i q block of SPARSE_BLOCK_Q queries);
# k of one batch element is one block, resident in VMEM; indices come per q block in SMEM.


@dataclasses.dataclass(frozen=True)
class SparseKernelPlan:
    """One sparse pallas_call: the dtype it gathers k rows in, the MXU precision of its [top_k, H, D]
    matmuls, and its MXU work per query as passes of a [top_k, D] x [D, H] matmul (the [top_k, H]-sized
    products, head sums into a row and the outer product g wᵀ, run on the VPU)."""

    name: str
    semantics: tuple[str, str]  # of the grid (b, i)
    gather_dtype: str
    precision: str  # "matmul" (the variant's MATMUL_PRECISION) or "highest"
    mxu_passes: int
    query_dtype: str  # the type q meets the MXU in


# MXU passes of the sparse kernels of a variant with a key scale, whose gathered rows are float32 (k
# times its scale) and q its bfloat16 upcast: the logits split the rows into a bfloat16 head and tail;
# dq splits both dlogits and the rows (head x head, head x tail, tail x head); dk splits dlogits.
SCALED_PASSES = {"logits": 2, "dq": 3, "dk": 2}


def sparse(variant: Variant) -> tuple[SparseKernelPlan, SparseKernelPlan]:
    """The forward and backward sparse kernels of ``variant``.

    Rows are gathered in the MXU type of the variant; float8 keys with their per-token scale are
    gathered as float32 rows of k times the scale (upcast and scaled once, before the kernels: a
    per-slot scale would be an XLA gather of B * S * top_k scalars, and its gradient a scatter, which
    on a v5e cost 58 ms at S 16384, top_k 512, four times the kernel). The
    backward computes as the variant's dense backward does: the fused one's bfloat16 gradient matmuls
    split the float32 dlogits into a head and a tail (two passes each, float32 accuracy); a variant
    whose dense backward is the float32 reference VJP gathers float32 rows and multiplies at HIGHEST.
    """
    policy = variant.policy
    mxu_type = policy.mxu_dtype
    if policy.k_scale:  # float8 keys: rows of k times their scale, float32, against bfloat16 q
        forward_passes, backward_passes = SCALED_PASSES["logits"], sum(SCALED_PASSES.values())
        return (
            SparseKernelPlan("sparse_forward", (PARALLEL, PARALLEL), F32, "matmul", forward_passes, mxu_type),
            SparseKernelPlan(
                "sparse_backward", (PARALLEL, ARBITRARY), F32, "matmul", backward_passes, mxu_type
            ),
        )
    if variant.backward == "reference":
        backward_type, backward_precision = F32, "highest"
    else:
        backward_type, backward_precision = mxu_type, "matmul"
    if backward_type == F32 and policy.precision == "highest":
        backward_precision = "highest"  # "matmul" is HIGHEST: one name for one kernel
    grad_passes = 1 if backward_type == F32 else 2
    return (
        SparseKernelPlan("sparse_forward", (PARALLEL, PARALLEL), mxu_type, "matmul", 1, mxu_type),
        # dk accumulates over q blocks in a block whose index follows b only: i is a reduction.
        SparseKernelPlan(
            "sparse_backward",
            (PARALLEL, ARBITRARY),
            backward_type,
            backward_precision,
            1 + 2 * grad_passes,  # the logits again, dq and dk
            backward_type,
        ),
    )
