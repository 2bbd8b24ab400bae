"""A compiled kernel's grid steps, read from the TPU compiler's schedule (``codegen.schedule``): which of
the template's branch regions a step issues on each path it can take, and what a whole call issues.

The kernel templates unroll the compute blocks of a tile, each with the same ``pl.when`` structure,
which ``BRANCHES`` states per kernel (conditions in program order, nested as in the template). The
reader finds the compiler's wrapper region (the largest top-level one), splits its branches into the
kernel's prologue, one group per compute block and its epilogue, and checks that every group has the
stated shape; a template whose branches change without ``BRANCHES`` fails there, naming the kernel and
what was found. A condition the compiler if-converted has no branch and is not in ``BRANCHES``: its
instructions issue on every path, which is what they cost. The compiler's own branch regions around the
template's (its pipeline's bookkeeping, an output window's copy) are counted as taken on every step. The
grid loop's extra iterations (``PIPELINE_ITERATIONS``) issue the body less its wrapper region.

What the bundles cost in time, and the reports over variants, are ``codegen.compiled``'s.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from codegen import cost, schedule
from codegen.plan import KernelPlan
from codegen.shipped import _geometry as geometry

# Conditions of a compute block's branch regions: on the block's kind and the step's place in the
# kernel's reduction (first, last).
CONDITIONS = {
    "work": lambda kind, first, last: kind != "empty",
    "empty": lambda kind, first, last: kind == "empty",
    "partial": lambda kind, first, last: kind == "partial",
    "first": lambda kind, first, last: first,
    "last": lambda kind, first, last: last,
}
KINDS = ("empty", "full", "partial")


@dataclasses.dataclass(frozen=True)
class Branches:
    """A kernel's branch regions inside the compiler's wrapper: ``prologue`` and ``epilogue`` once per
    step, ``per_block`` once per compute block; each region is (condition, nested regions)."""

    prologue: tuple = ()
    per_block: tuple = ()
    epilogue: tuple = ()


# From the templates (templates/tpu/forward.py.j2, backward.py.j2), in the order
# the compiler lays the regions out (an if/else may come else-first). A compute block with work is
# masked unconditionally: no region of its own.
BRANCHES = {
    # all heads in a step (a head chunk per matmul, if chunked): a piece with work, its masked scores (the
    # tile's masked store comes first, in no region); its tails after the loop, each a piece alike
    ("forward", False): Branches(per_block=(("work", ()),)),
    # a block with work (the q block's first one starts the sum of u: no region zeroes it); the finish
    # at the last step
    ("dq_dweights", False): Branches(per_block=(("work", ()),), epilogue=(("last", ()),)),
    # zero at the reduction's first step; a block with work; store at the last
    ("dk", False): Branches(prologue=(("first", ()),), per_block=(("work", ()),), epilogue=(("last", ()),)),
}  # fmt: skip
# dq_dk has dk's regions; dq and dweights are finished at every step, outside any region
BRANCHES[("dq_dk", False)] = BRANCHES[("dk", False)]
BRANCHES[("forward", True)] = BRANCHES[("forward", False)]
BRANCHES[("dq_dk", True)] = BRANCHES[("dq_dk", False)]
BRANCHES[("dq_dweights", True)] = BRANCHES[("dq_dweights", False)]
BRANCHES[("dk", True)] = BRANCHES[("dk", False)]


def kernel_branches(kernel: str, chunked: bool) -> Branches:
    """The ``Branches`` of a kernel of a variant with (``chunked``) or without head chunks."""
    return BRANCHES[(kernel, chunked)]


class StructureError(schedule.ScheduleError):
    pass


@dataclasses.dataclass(frozen=True)
class Steps:
    """A kernel's grid step read against its ``Branches``: bundles issued outside the compute blocks'
    regions, and per compute block its top-level regions. Where the step runs its compute blocks as a
    loop (``loop``), every block is one trip of it: the same regions, and the trip's own bundles."""

    sched: schedule.Schedule
    branches: Branches
    prologue: tuple[schedule.Span, ...]
    blocks: tuple[tuple[schedule.Span, ...], ...]
    epilogue: tuple[schedule.Span, ...]
    loop: schedule.Loop | None = None
    tails: tuple[tuple[schedule.Span, ...], ...] = ()  # a visible-piece walk's tail pieces, after the loop

    @property
    def shared(self) -> int:
        """Bundles a step issues once whatever its blocks and place: the body less every mapped region
        (and less the compute-block loop, whose trips are the blocks')."""
        ends = self.prologue + self.epilogue + tuple(s for b in self.tails for s in b)
        if self.loop is not None:
            return self.sched.body - sum(s.size for s in ends) - self.loop.size
        return self.sched.body - sum(s.size for s in ends + tuple(s for b in self.blocks for s in b))

    def _skipped(self, spans, conds, kind, first, last) -> list[schedule.Span]:
        """The regions not issued among ``spans`` (conditions ``conds``) and inside the issued ones."""
        out = []
        for span, (cond, nested) in zip(spans, conds):
            if CONDITIONS[cond](kind, first, last):
                out += self._skipped(span.children, nested, kind, first, last)
            else:
                out.append(span)
        return out

    def skipped(self, kinds, first: bool, last: bool, tail_kinds=None) -> list[schedule.Span]:
        """Regions a step skips whose compute blocks are of ``kinds`` (one per block) and tail pieces of
        ``tail_kinds`` (default: none taken)."""
        out = self._skipped(self.prologue, self.branches.prologue, None, first, last)
        out += self._skipped(self.epilogue, self.branches.epilogue, None, first, last)
        for spans, kind in zip(self.blocks, kinds):
            out += self._skipped(spans, self.branches.per_block, kind, first, last)
        for spans, kind in zip(self.tails, tail_kinds or ["empty"] * len(self.tails)):
            out += self._skipped(spans, self.branches.per_block, kind, first, last)
        return out

    def bundles(self, kinds, first: bool, last: bool, tail_kinds=None) -> int:
        """Bundles a step issues (its tail pieces of ``tail_kinds``, default none taken)."""
        blocks = sum(self.block_bundles(n, kind, first, last) for n, kind in enumerate(kinds))
        tail_kinds = tail_kinds or ["empty"] * len(self.tails)
        blocks += sum(self.tail_bundles(m, kind, first, last) for m, kind in enumerate(tail_kinds))
        return self.shared + self.prologue_bundles(first, last) + blocks

    def _issued(self, spans, conds, kind, first, last) -> int:
        return sum(s.size for s in spans) - sum(
            s.size for s in self._skipped(spans, conds, kind, first, last)
        )

    def block_bundles(self, n: int, kind: str, first: bool, last: bool) -> int:
        """Bundles compute block ``n`` issues: its regions' (unrolled), or a trip of the loop less the
        regions it skips."""
        if self.loop is not None:
            skipped = self._skipped(self.blocks[n], self.branches.per_block, kind, first, last)
            return self.loop.size - sum(s.size for s in skipped)
        return self._issued(self.blocks[n], self.branches.per_block, kind, first, last)

    def tail_bundles(self, m: int, kind: str, first: bool, last: bool) -> int:
        """Bundles tail piece ``m`` issues: its regions, as a compute block's."""
        return self._issued(self.tails[m], self.branches.per_block, kind, first, last)

    def prologue_bundles(self, first: bool, last: bool) -> int:
        """Bundles the prologue's and epilogue's regions issue."""
        conds = self.branches.prologue + self.branches.epilogue
        return self._issued(self.prologue + self.epilogue, conds, None, first, last)


def _shape_of(spans) -> tuple:
    return tuple((len(s.children), _shape_of(s.children)) for s in spans)


def _want(conds) -> tuple:
    return tuple((len(nested), _want(nested)) for _, nested in conds)


def _alike(groups) -> bool:
    """Whether the compute blocks' groups have the same regions: the same nesting, and sizes within 10%
    and 64 bundles of each other position by position (the same code, unrolled, scheduled alike; the
    first block's store may carry what the compiler hoisted, 63 bundles at 512 x 2048 / 512)."""
    for position in zip(*groups):
        sizes = [s.size for s in position]
        if len({_shape_of([s]) for s in position}) > 1 or max(sizes) > 1.1 * min(sizes) + 64:
            return False
    return True


def compute_block_loop(sched: schedule.Schedule, compute_blocks: int) -> schedule.Loop | None:
    """The loop a step runs its compute blocks as (``_kernel_ops.each_compute_block``: several blocks
    are a loop of as many trips), or None where there is one block; StructureError if it is not there."""
    if compute_blocks == 1:
        return None
    loops = [x for x in sched.loops if x.trips == compute_blocks]
    if len(loops) != 1 or len(sched.loops) != 1:
        raise StructureError(
            f"expected one loop of {compute_blocks} trips over the compute blocks; found loops "
            f"{[(x.start, x.stop, x.trips) for x in sched.loops]}"
        )
    return loops[0]


def steps(
    kernel: str,
    chunked: bool,
    sched: schedule.Schedule,
    compute_blocks: int,
    one_step_reduction: bool = False,
    tails: int = 0,
) -> Steps:
    """Maps ``sched``'s branch regions onto the kernel's ``kernel_branches``; StructureError if they differ.

    Inside the compiler's wrapper region, the template's regions are a contiguous run: its prologue,
    the compute blocks' regions, its epilogue. Several compute blocks are one loop, whose body holds one
    block's regions (``compute_block_loop``). Regions the compiler adds around them (the copy of an
    output window, say) are shared code: issued, as an upper bound, on every step. Where the reduction
    has one step (``one_step_reduction``: one w tile, say) every step is its first and last, so the
    compiler folds the prologue's and epilogue's conditions: their code is shared code. A walk of
    visible pieces has ``tails`` more pieces after its loop (or its one block), each a block's regions
    outside the loop."""
    branches = kernel_branches(kernel, chunked)
    if one_step_reduction:
        branches = dataclasses.replace(branches, prologue=(), epilogue=())
    if not sched.spans:
        raise StructureError(f"{kernel}: no branch region in the grid-step body")
    try:
        loop = compute_block_loop(sched, compute_blocks)
    except StructureError as err:
        raise StructureError(f"{kernel}: {err}") from None
    groups_written = 1 if loop is not None else compute_blocks  # a loop's body holds one block
    inner = max(sched.spans, key=lambda s: s.size).children
    pre, post, per = len(branches.prologue), len(branches.epilogue), len(branches.per_block)
    want = pre + post + per * (groups_written + tails)
    for start in range(len(inner) - want + 1):
        run = inner[start : start + want]
        groups = tuple(tuple(run[pre + n * per : pre + (n + 1) * per]) for n in range(groups_written))
        tail_groups = tuple(
            tuple(run[pre + n * per : pre + (n + 1) * per])
            for n in range(groups_written, groups_written + tails)
        )
        outside = run[:pre] + tuple(s for g in tail_groups for s in g) + run[want - post :]
        in_loop = (
            loop is None
            or all(loop.start <= s.start and s.stop <= loop.stop for g in groups for s in g)
            and not any(loop.start <= s.start < loop.stop for s in outside)
        )
        if (
            in_loop
            and _shape_of(run[:pre]) == _want(branches.prologue)
            and _shape_of(run[want - post :]) == _want(branches.epilogue)
            and all(_shape_of(g) == _want(branches.per_block) for g in groups + tail_groups)
            and _alike(groups)
        ):
            blocks = groups * compute_blocks if loop is not None else groups
            return Steps(
                sched, branches, tuple(run[:pre]), blocks, tuple(run[want - post :]), loop, tail_groups
            )
    raise StructureError(
        f"{kernel}: the step's {len(inner)} branch regions hold no run of {pre} + {groups_written} compute "
        f"blocks x {per} + {tails} tail pieces x {per} + {post} nested as the template's {branches}; found "
        f"nesting {_shape_of(inner)}"
    )


def one_step_reduction(kp: KernelPlan, t: cost.Tiling) -> bool:
    """Whether the kernel's reduction has one step at this tiling and shape (one w tile, say)."""
    return bool(kp.reduced) and all(t.extents[a] == 1 for a in kp.reduced)


# The grid loop runs this many iterations more than the grid has steps (its pipeline's fill and drain,
# which issue DMAs and skip the wrapper region): read from every dense kernel's exit test by the tests.
PIPELINE_ITERATIONS = 2


def fill_and_drain(sched: schedule.Schedule) -> int:
    """Bundles of the grid loop's extra iterations: the body less its wrapper region."""
    wrapper = max((s.size for s in sched.spans), default=0)
    return PIPELINE_ITERATIONS * (sched.body - wrapper)


def reduction_flags(kp: KernelPlan, extents: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Over the kernel's grid (indexed in ``AXES`` order b, i, j, c): each step's (b, i, j) and whether it is
    its reduction's first and last step (an axis the kernel's grid lacks has one step)."""
    names = "bijc"
    grid = np.indices([extents[a] if a in kp.axes else 1 for a in names]).reshape(4, -1)
    first = np.ones(grid.shape[1], bool)
    last = np.ones(grid.shape[1], bool)
    for axis in kp.reduced:
        n = names.index(axis)
        first &= grid[n] == 0
        last &= grid[n] == extents[axis] - 1
    return grid, first, last


def call_cycles(
    kp: KernelPlan, st: Steps, t: cost.Tiling, kinds: np.ndarray, floor: np.ndarray | None = None
) -> int:
    """Cycles of a call: per grid step the bundles of the path it takes, or ``floor`` of that step where
    more (``dma_floor``: the DMAs the step waits on). ``kinds``: the plan's classification
    (``cost.kind_matrix`` by the kernel's walk), [B * q blocks, pieces of the padded W] in 0 empty,
    1 full, 2 partial."""
    ex = t.extents
    n_blocks = t.block_w // t.compute_w
    per_tile = n_blocks + len(st.tails)  # kinds' columns per w tile: the blocks (trips), then the tails

    def piece_bundles(n, kind, first, last):
        return (
            st.block_bundles(n, kind, first, last)
            if n < n_blocks
            else st.tail_bundles(n - n_blocks, kind, first, last)
        )

    # bundles of compute block (or tail piece) n of kind k at (first, last)
    table = np.array(
        [
            [[[piece_bundles(n, KINDS[k], f, l) for l in (0, 1)] for f in (0, 1)] for k in range(3)]
            for n in range(per_tile)
        ]
    )
    grid, first, last = reduction_flags(kp, ex)
    b, i, j = grid[0], grid[1], grid[2]
    rows = b * ex["i"] + i
    flags = first.astype(int), last.astype(int)
    prologue = np.array([[st.prologue_bundles(f, l) for l in (0, 1)] for f in (0, 1)])
    per_step = st.shared + prologue[flags[0], flags[1]]
    for n in range(per_tile):
        per_step = per_step + table[n][kinds[rows, j * per_tile + n], flags[0], flags[1]]
    if floor is not None:
        per_step = np.maximum(per_step, floor)
    return int(per_step.sum()) + fill_and_drain(st.sched)


def dma_floor(kp: KernelPlan, t: cost.Tiling, kinds: np.ndarray, cycles_per_byte: float) -> np.ndarray:
    """Per grid step (``reduction_flags``' order), the cycles of the HBM DMAs it waits on: the blocks the
    pipeline fetches for the next step and the one it writes back from the step before, at the chip's
    bandwidth. A step of little work (one that only stores a masked tile) takes that long, however few
    its bundles: the pipeline keeps one step's DMAs in flight. (On a v5e the causal forward at
    S 16384 / W 8192, whose rows of q blocks end in steps that only write -inf, took 1.27 x the
    bundles' time.) An input's index holds still on a step with no work where the kernel's skip holds
    it, and stays at block 0 over a q block (w tile) with none (``_operands.park``)."""
    ex = t.extents
    names = "bijc"
    grid, _, _ = reduction_flags(kp, ex)
    shape = [ex[a] if a in kp.axes else 1 for a in names]
    per_tile = kinds.shape[1] // ex["j"]
    tiles = kinds.reshape(kinds.shape[0], ex["j"], per_tile).any(axis=2)  # [B * q blocks, w tiles]
    rows = grid[0] * ex["i"] + grid[1]
    work = tiles[rows, grid[2]]
    by_work = tiles.reshape(ex["b"], ex["i"], ex["j"]).any(axis=2 if kp.skip.by == "i" else 1)
    has_work = by_work[grid[0], grid[1] if kp.skip.by == "i" else grid[2]]
    # the kernel's own step order: its grid axes outermost first
    outermost_first = [names.index(a) for a in kp.axes] + [n for n, a in enumerate(names) if a not in kp.axes]
    order = np.arange(grid.shape[1]).reshape(shape).transpose(outermost_first).reshape(-1)
    held, parked = set(kp.skipped_operands()), set(kp.parked_operands())
    during = np.zeros(grid.shape[1])  # bytes in flight while each step (in the kernel's order) runs
    for block in kp.blocks:
        index = np.stack([grid[names.index(a)] for a in block.follows if a in kp.axes] or [0 * grid[0]])
        if block.name in parked:
            index = np.where(has_work, index, 0)
        index = index[:, order]
        if block.name in held:  # a step with no work keeps the block before it
            keep = work[order]
            last = np.maximum.accumulate(np.where(keep, np.arange(keep.size), 0))
            index = index[:, last]
        changes = np.concatenate([[True], (index[:, 1:] != index[:, :-1]).any(axis=0)])
        nbytes = math.prod(t.dims(block.shape)) * geometry.itemsize(block.dtype)
        if block in kp.inputs:  # fetched while the step before it runs
            during[:-1] += nbytes * changes[1:]
        else:  # written back while the step after its last runs
            ends = np.concatenate([changes[1:], [True]])
            during[1:] += nbytes * ends[:-1]
    floor = np.empty_like(during)
    floor[order] = during * cycles_per_byte
    return floor


def loop_bodies(hlo: str) -> set[str]:
    """Names of the HLO instructions inside a while loop's body (``score_topk``'s scan over query chunks:
    each runs once per trip), from the optimised HLO text of the top-level program."""
    computations: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in hlo.splitlines():
        if m := re.match(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$", line):
            current = computations.setdefault(m.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := re.match(r"^\s+(?:ROOT )?%([\w.\-]+) = ", line)):
            current.append((m.group(1), line))
    bodies = [
        m.group(1)
        for instructions in computations.values()
        for _, line in instructions
        if " while(" in line and (m := re.search(r"body=%([\w.\-]+)", line))
    ]
    return {name for body in bodies for name, _ in computations.get(body, [])}


def once_per_batch(sched: schedule.Schedule, dk_copies: int) -> set[int]:
    """The sparse backward's bundles that run at one q block of a batch element only: the branch region
    zeroing its dk accumulators (before the first loop over slots, none inside it) and, with more than
    one accumulator, the one adding them up (after the last): the largest such region on each side."""
    if not sched.loops:
        raise StructureError("sparse_backward: no loop over slots in the step")
    first, last = sched.loops[0].start, sched.loops[-1].stop
    plain = [s for s in sched.all_spans() if not any(s.start <= x.start < s.stop for x in sched.loops)]
    sides = [[s for s in plain if s.stop <= first]] + (
        [[s for s in plain if s.start >= last]] if dk_copies > 1 else []
    )
    if not all(sides):
        raise StructureError("sparse_backward: no branch region zeroing (or adding up) the dk accumulators")
    return sched.skipped([max(side, key=lambda s: s.size) for side in sides])
