"""Reading a kernel's final VLIW schedule, as the TPU compiler (libtpu) dumps it.

With ``--xla_jf_dump_to=DIR`` libtpu writes, per kernel, ``*final_bundles.txt`` (the program as issued:
one bundle of instructions per line, one bundle per cycle) and ``*final_hlo-static-per-bundle-utilization.txt``
(per bundle, how many of each unit's slots it fills). This module turns them into what a grid step costs.

What the dumps show, and what is assumed:
- The grid loop is the outermost loop: its first bundle is marked ``LB`` and it ends with the ``sbr.rel``
  that jumps back to a region starting there.
- A ``pl.when`` (or ``lax.cond``) that the compiler keeps as a branch is an ``sbr.rel (pred) target =
  $regionN``: when ``pred`` holds, the bundles from the end of its delay slots up to the bundle where region
  N starts are skipped. The delay slots after a branch issue whatever it decides; how many there are is
  the chip's (4 on v6e, 6 on 7x in the dumps read so far), so ``parse`` reads it from the dump: a
  branch closes its own region that many bundles later (``_delay_slots``). A
  condition the compiler if-converted has no branch: its instructions issue, predicated, on every path.
- One bundle issues per cycle; DMAs overlap the compute; no stalls (a DMA not yet arrived, a taken
  branch's refill) are in the count.
"""

from __future__ import annotations

import dataclasses
import re

MAX_DELAY_SLOTS = 12  # looked for after a branch: the bundles that issue before it takes effect
UNITS = ("MXU", "XLU", "VALU", "VPOP", "EUP", "VLOAD", "VLOAD:FILL", "VSTORE", "VSTORE:SPILL", "SALU")

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(LB|LH|LE|PB|PF|CT)?\s*:")
_STARTS = re.compile(r"(?:Start|Start/End empty) region (\d+)\b")
_BRANCH = re.compile(r"sbr\.rel \((!?%\w+)\) target = \$region(\d+)")
# (a predicated test, inside an outer loop's body: "totalorder (%p1), %s2_s3, 16")
_EXIT_TEST = re.compile(r"scmp\.ge\.s32\.totalorder (?:\(!?%\w+\), )?(%s\d+)_?\w*, (\d+) /\* loop exit test")
# A DMA the kernel issues (not the copy of one a bounds check quotes: "for %N = dma..."): its kind and size.
_DMA = re.compile(r"(?<!for )%\w+ = dma\.(\w+)\b[^;]*?/\*size_in_granules=\*/(\d+)")
DMA_GRANULE_BYTES = 32  # a DMA's size_in_granules unit: a [8, 64, 128] bfloat16 block is 4096 granules
HBM_DMAS = ("hbm_to_vmem", "vmem_to_hbm", "hbm_to_smem", "smem_to_hbm")  # the kinds that move HBM bytes


DYNAMIC = -1  # a loop's trips that the program computes (``parse(dynamic=True)``): see Schedule.with_trips


class ScheduleError(ValueError):
    """A dump whose structure this reader does not recognise: nothing is guessed."""


@dataclasses.dataclass(frozen=True)
class Span:
    """Bundles ``[start, stop)`` that a branch at ``branch`` skips when ``predicate`` holds; ``children``:
    the spans nested inside it, in program order."""

    branch: int
    start: int
    stop: int
    predicate: str
    children: tuple[Span, ...] = ()

    @property
    def size(self) -> int:
        return self.stop - self.start

    def contains(self, other: Span) -> bool:
        return self.start <= other.branch and other.stop <= self.stop


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop: bundles ``[start, stop)`` issued ``trips`` times (its exit test's bound over the counter's
    step: the counter runs from 0, by the step its increment adds, more than 1 in an unrolled loop)."""

    start: int
    stop: int
    trips: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One kernel's final bundles: the grid-loop body ``[body_start, body_stop)``, the branch spans inside
    it as a tree, the loops nested inside it, and every bundle's slot use (``UNITS`` order)."""

    bundles: int
    body_start: int
    body_stop: int
    spans: tuple[Span, ...]  # top level of the body, program order
    grid_trips: int  # iterations of the grid loop (the pipeline's prologue and epilogue included)
    loops: tuple[Loop, ...]  # loops inside the body, nested ones too
    capacity: tuple[int, ...]
    utilization: tuple[tuple[int, ...], ...]  # per bundle
    dmas: tuple[tuple[tuple[str, int], ...], ...] = ()  # per bundle: the DMAs it issues, (kind, bytes)
    delay_slots: int = 0  # the chip's, read from the dump: bundles that issue after a branch

    @property
    def body(self) -> int:
        """Straight-line bundles of one grid step: every branch region counted as taken."""
        return self.body_stop - self.body_start

    def executed(self, skipped: set[int] = frozenset()) -> int:
        """Bundles one grid step issues when ``skipped`` are not: a loop inside it once per trip."""
        return sum(self._times(skipped).values())

    def with_trips(self, trips: int) -> Schedule:
        """This schedule with ``trips`` for every loop whose trips the program computes (``DYNAMIC``)."""
        loops = tuple(dataclasses.replace(x, trips=trips) if x.trips == DYNAMIC else x for x in self.loops)
        return dataclasses.replace(self, loops=loops)

    def _times(self, skipped) -> dict[int, int]:
        """Each bundle a step issues when ``skipped`` are not, and how many times: the product of the
        trips of the loops it is in (a loop nested in another runs its trips on each outer trip)."""
        times = dict.fromkeys(self.issued(skipped), 1)
        for loop in self.loops:
            for b in range(loop.start, loop.stop):
                if b in times:
                    times[b] *= loop.trips
        return times

    def step_dmas(self, skipped: set[int] = frozenset(), kinds=HBM_DMAS, sizes=None) -> tuple[int, int]:
        """(count, bytes) of the DMAs of ``kinds`` one grid step issues when ``skipped`` are not, a DMA
        inside a loop once per trip; every region counted as taken unless skipped. ``sizes``: only
        DMAs of bytes for which it holds."""
        count = size = 0
        for b, times in self._times(skipped).items():
            for kind, nbytes in self.dmas[b] if self.dmas else ():
                if kind in kinds and (sizes is None or sizes(nbytes)):
                    count, size = count + times, size + times * nbytes
        return count, size

    def all_spans(self) -> list[Span]:
        """Every branch span of the body, nested ones too, in program order."""
        out, todo = [], list(reversed(self.spans))
        while todo:
            span = todo.pop()
            out.append(span)
            todo.extend(reversed(span.children))
        return out

    def skipped(self, spans) -> set[int]:
        """Bundle indices not issued when ``spans`` are skipped."""
        return {b for s in spans for b in range(s.start, s.stop)}

    def issued(self, skipped: set[int] = frozenset()) -> list[int]:
        """The body's bundles a step issues when ``skipped`` are not."""
        return [b for b in range(self.body_start, self.body_stop) if b not in skipped]

    def occupancy(self, skipped: set[int] = frozenset()) -> dict[str, float]:
        """Per unit, the share of its slots the body's issued bundles fill."""
        issued = self.issued(skipped)
        used = [sum(self.utilization[b][u] for b in issued) for u in range(len(UNITS))]
        return {unit: used[u] / (self.capacity[u] * len(issued)) for u, unit in enumerate(UNITS)}

    def spill_stores(self, skipped: set[int] = frozenset()) -> int:
        """Vector stores to spill slots among the body's issued bundles."""
        spill = UNITS.index("VSTORE:SPILL")
        return sum(self.utilization[b][spill] for b in self.issued(skipped))


def _bundle_lines(path: str) -> list[tuple[str, str]]:
    with open(path) as f:
        return [(m.group(2) or "", line) for line in f if (m := _BUNDLE.match(line))]


def _utilization(path: str, bundles: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    with open(path) as f:
        lines = [line.split() for line in f if line.strip()]
    names = lines[1]
    if tuple(n.rstrip(",") for n in names) != UNITS or lines[3][0] != "==":
        raise ScheduleError(f"{path}: unexpected header {lines[:4]}")
    capacity = tuple(int(x) for x in lines[2])
    rows = tuple(tuple(int(x) for x in row) for row in lines[4:])
    if len(rows) != bundles:
        raise ScheduleError(f"{path}: {len(rows)} utilization rows for {bundles} bundles")
    return capacity, rows


def _tree(spans: list[Span]) -> tuple[Span, ...]:
    """Nests spans (in program order, properly nested) into a tree."""
    top: list[Span] = []
    stack: list[tuple[Span, list[Span]]] = []

    def close():
        span, kids = stack.pop()
        done = dataclasses.replace(span, children=tuple(kids))
        (stack[-1][1] if stack else top).append(done)

    for span in spans:
        while stack and not stack[-1][0].contains(span):
            if stack[-1][0].size and span.branch < stack[-1][0].stop < span.stop:
                raise ScheduleError(f"branch regions overlap: {stack[-1][0]} and {span}")
            close()
        stack.append((span, []))
    while stack:
        close()
    return tuple(top)


def _delay_slots(lines, branches: list[int], path: str) -> int:
    """The chip's delay slots: the largest distance after a branch at which every branch closes a
    region, else the largest at which many (a third or more) do, else the largest at which any does. A
    branch's own region closes there; a region that closes sooner is nested, or ends early because the
    compiler moved the skippable region's first, predicated, ops into the slots (a step whose regions
    are mostly nested or moved so may agree on nothing: 7x's all-heads float8 dk closes one of its 9
    at 4 bundles and one at 6, its delay)."""
    closes = {
        d: sum(1 for n in branches if n + d < len(lines) and "End region" in lines[n + d][1])
        for d in range(1, MAX_DELAY_SLOTS + 1)
    }
    every = [d for d, count in closes.items() if branches and count == len(branches)]
    if every:  # every branch closes a region there: its own (a small kernel's few branches)
        return max(every)
    many = [d for d, count in closes.items() if count * 3 >= len(branches)]
    if not many:  # most regions closed early: the farthest close is a branch's own region
        many = [d for d, count in closes.items() if count]
    if not branches or not many:
        raise ScheduleError(
            f"{path}: no branch closes a region within {MAX_DELAY_SLOTS} bundles: no delay-slot count"
        )
    return max(many)


def _trips(lines, start: int, stop: int, path: str, predicate: str = "", strict: bool = False) -> int:
    """The trip count of the loop ``[start, stop)``: the bound of its exit test over the step of the
    counter it tests (``%sN = sadd.s32 STEP, ...`` inside the loop; 1 where the counter is not
    incremented by a constant there, as the grid loop's is not). Its exit test is the one that sets
    ``predicate``, the loop's back branch's (an outer loop's test may be scheduled inside an inner
    loop); without one of those, the last exit test inside the loop (``strict``: ScheduleError)."""
    tests = [(m, line) for _, line in lines[start:stop] for m in _EXIT_TEST.finditer(line)]
    name = predicate.lstrip("!").split("_")[0]
    own = [
        m.groups()
        for m, line in tests
        if name and re.search(re.escape(name) + r"(_\w+)? = $", line[: m.start()])
    ]
    found = own or ([] if strict else [m.groups() for m, _ in tests])
    if not found:
        raise ScheduleError(f"{path}: the loop at bundle {start} has no exit test with a constant bound")
    counter, bound = found[-1]
    increment = re.compile(re.escape(counter) + r"(_\w+)? = sadd\.s32 (\d+), ")
    steps = [int(m.group(2)) for _, line in lines[start:stop] if (m := increment.search(line))]
    step = steps[-1] if steps else 1
    return -(-int(bound) // step)


def _dmas(lines) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Per bundle, the DMAs it issues: (kind, bytes)."""
    return tuple(
        tuple((m.group(1), int(m.group(2)) * DMA_GRANULE_BYTES) for m in _DMA.finditer(line))
        for _, line in lines
    )


def parse(
    bundles_path: str,
    utilization_path: str,
    delay: int | None = None,
    strict: bool = False,
    dynamic: bool = False,
) -> Schedule:
    """The schedule of one kernel from its two dump files; ``delay``: the chip's delay slots where known
    (else read from the kernel's own branches); ``strict``: every loop's trips from its own exit test
    (the one that sets its back branch's predicate), else ScheduleError; ``dynamic``: an inner loop
    with no exit test of its own against a constant has ``DYNAMIC`` trips (a bound the kernel
    computes), for the caller to give (``Schedule.with_trips``)."""
    lines = _bundle_lines(bundles_path)
    starts: dict[str, int] = {}
    for n, (_, line) in enumerate(lines):
        for region in _STARTS.findall(line):
            starts.setdefault(region, n)
    loop = next((n for n, (mark, _) in enumerate(lines) if mark == "LB"), None)
    branches, exits = [], []
    for n, (_, line) in enumerate(lines):
        for predicate, region in _BRANCH.findall(line):
            if region in starts:
                branches.append((n, starts[region], predicate))
            else:  # to the kernel's end (v5p: the other core of a megacore skips a core's work)
                exits.append(n)
    if loop is None:
        raise ScheduleError(f"{bundles_path}: no loop (LB) marker: not a gridded kernel")
    back = [n for n, target, _ in branches if target == loop]
    if not back:
        raise ScheduleError(f"{bundles_path}: no branch back to the grid loop's first bundle {loop}")
    if delay is None:
        delay = _delay_slots(lines, [n for n, _, _ in branches if n >= loop], bundles_path)
    body_stop = max(back) + delay + 1
    if any(loop <= n < body_stop for n in exits):
        raise ScheduleError(f"{bundles_path}: a branch inside the grid-step body leaves the kernel")
    forward = [
        Span(n, n + delay + 1, max(target, n + delay + 1), p)
        for n, target, p in branches
        if loop <= n < target <= body_stop
    ]
    # an inner loop: a branch back to an LB inside the body (nested ones too: their trips multiply)
    inner = {
        (target, n + delay + 1): p
        for n, target, p in branches
        if loop < target <= n < body_stop and lines[target][0] == "LB"
    }

    def trips(a, b, p):
        try:
            return _trips(lines, a, b, bundles_path, p, strict or dynamic)
        except ScheduleError:
            if not dynamic:
                raise
            return DYNAMIC

    loops = [Loop(a, b, trips(a, b, p)) for (a, b), p in inner.items()]
    capacity, rows = _utilization(utilization_path, len(lines))
    return Schedule(
        bundles=len(lines),
        body_start=loop,
        body_stop=body_stop,
        spans=_tree(forward),
        grid_trips=_trips(
            lines, loop, body_stop, bundles_path, next(p for n, t, p in branches if n == max(back)), strict
        ),
        loops=tuple(sorted(loops, key=lambda loop_: loop_.start)),
        capacity=capacity,
        utilization=rows,
        dmas=_dmas(lines),
        delay_slots=delay,
    )


def program_cycles(bundles_path: str, utilization_path: str, delay: int) -> tuple[int, int, bool]:
    """Cycles of one XLA program of the dump (a fusion, a copy, a sort: what XLA runs around the Pallas
    kernels), as ``parse`` reads a kernel: its bundles, those of its loop once per trip. Returns
    (cycles, bundles, read): ``read`` is False where a loop's trips are not in the dump (a bound the program
    computes, as XLA's gathers do: no exit test of its own with a constant bound) or a loop lies
    outside the one ``parse`` follows; such a loop is counted once, so the cycles are then a lower
    bound. ``delay``: the chip's delay slots (an XLA
    program may have too few branches to read them from)."""
    lines = _bundle_lines(bundles_path)
    marks = [n for n, (mark, _) in enumerate(lines) if mark == "LB"]
    if not marks:  # straight-line: every bundle once, a branch's region counted as taken
        return len(lines), len(lines), True
    try:
        sched = parse(bundles_path, utilization_path, delay, strict=True)
    except ScheduleError:
        return len(lines), len(lines), False
    followed = {sched.body_start} | {loop.start for loop in sched.loops}
    cycles = sched.bundles - sched.body + sched.executed() * sched.grid_trips
    return cycles, len(lines), followed.issuperset(marks)
