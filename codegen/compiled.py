"""What the compiled kernels cost, read from the TPU compiler's own schedule (``codegen explain --compiled``).

For every kernel of a program compiled ahead of time (``codegen.tpu_compile``) this reads the final
bundles (``codegen.schedule``) and reports: whether it compiled (else Mosaic's message); the bundles one
grid step issues on each path it can take, every compute block empty, full or partial; the MXU, XLU and
VALU slot occupancy and the spill stores of the full path; the loops inside a step; and the cycles of a
whole call at a shape and mask, summing over the grid steps the bundles of the path each step takes,
with every (q block, compute block) classified by the plan's own rule (``codegen.cost.kind_matrix``).
For ``score_topk`` the programs XLA compiled around the kernels (the selection's passes, gathers and
sort) are costed too, each from its own schedule (``xla_report``). The same is done for a calibration
kernel on the same chip (a plain Pallas matmul of the same contraction depth, operand type and output
dtype, over as many logits as the call has unmasked), so that "x matmul" reads without the chip's clock.

Assumptions: one bundle issues per cycle; DMAs overlap the compute; no stalls; one TensorCore runs
every grid step (on a megacore chip, v5p, the parallel grid axes are split between two). The compiler's own
branch regions around the template's (its pipeline's bookkeeping, an output window's copy) are
counted as taken on every step: a small overestimate, stated rather than modelled.

Which branch regions a grid step issues, and so the bundles of each path and of a call, is read by
``codegen.grid_steps``; this module turns them into time and reports them.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
import sys

import numpy as np

from codegen import chips, cost, schedule, tpu_compile
from codegen.grid_steps import (
    KINDS,
    PIPELINE_ITERATIONS,
    StructureError,
    fill_and_drain,
    loop_bodies,
    once_per_batch,
    one_step_reduction,
    call_cycles,
    dma_floor,
    steps,
)
from codegen.plan import COMPUTE_BLOCKS, KernelPlan, VariantPlan


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """One compiled kernel on one chip."""

    kernel: str
    bundles: int  # of the whole kernel
    straight_line: int  # the grid-step body, every region counted as taken and every loop once
    executed: int  # bundles a step issues: on the full path (dense), every loop trip counted (sparse)
    paths: dict[str, int]  # a step every compute block of which is empty / full / partial (dense)
    occupancy: dict[str, float]  # of the full path (dense), of the straight-line body (sparse)
    spill_stores: int  # of the same bundles
    loops: tuple[tuple[int, int], ...]  # loops inside a step: (bundles, trips)
    steps: int  # grid steps of the call
    cycles: int  # of the call at its shape and mask
    calibration_cycles: int  # the plain matmul over as many logits
    step_dmas: int = 0  # HBM DMAs one step issues (the full path; a DMA in a loop once per trip)
    step_dma_bytes: int = 0  # and the bytes they move
    call_bytes: int = 0  # HBM bytes of the call: its steps' DMAs (sparse), the plan's model (dense)
    clock_hz: float = 0.0  # the clock at which the calibration matmul runs at the chip's cited peak
    hbm_bytes_per_second: float = (
        1.0  # the chip's HBM bandwidth, per device (measured where we have, else cited)
    )

    @property
    def seconds(self) -> float:
        """The call's time: the larger of its cycles at ``clock_hz`` and its bytes at the chip's HBM
        bandwidth (``chips.Chip.model_hbm_bytes_per_second_per_device``) (DMAs cost almost nothing in bundles, so a gather can be bound by its bytes).
        """
        return max(self.cycles / self.clock_hz, self.call_bytes / self.hbm_bytes_per_second)


def _timing(
    plan: VariantPlan, t: cost.Tiling, calibration: schedule.Schedule, calibration_logits: int, chip: str
):
    """A report's clock (where the calibration matmul runs at the chip's cited peak) and HBM bandwidth."""
    device = chips.get(chip)
    rate = device.matmul_flops_per_second(plan.mxu_itemsize)
    return dict(
        clock_hz=rate * calibration.body / (2 * calibration_logits * t.shape.head_dim),
        hbm_bytes_per_second=device.model_hbm_bytes_per_second_per_device(),
    )


def kernel_report(
    plan: VariantPlan,
    kp: KernelPlan | None,
    kernel: str,
    sched: schedule.Schedule,
    t: cost.Tiling,
    kinds: np.ndarray,
    calibration: schedule.Schedule,
    calibration_logits: int,
    chip: str = "v6e",
    model_bytes: int = 0,
) -> KernelReport:
    """The report of one dense kernel (``kp``), or of a sparse one (``kp`` None: its grid is not the plan's,
    so bundles, occupancy, loops and the DMAs of a step, every step alike). The calibration matmul is
    branch-free: a call of it costs its steps times its loop body, ``calibration_logits`` logits a step.
    ``model_bytes``: a dense call's HBM bytes from the plan's model (its DMAs depend on the step's path,
    which this reader does not follow for them)."""
    logits = t.shape.batch * t.shape.num_heads * t.shape.seq_len * t.shape.num_blocks
    calib = calibration.body * logits // calibration_logits
    loops = tuple((loop.size, loop.trips) for loop in sched.loops)
    timing = _timing(plan, t, calibration, calibration_logits, chip)
    if kp is None:  # a sparse kernel: no compute blocks, the same bundles and DMAs every step
        steps_ = sched.grid_trips - PIPELINE_ITERATIONS
        dmas, dma_bytes = sched.step_dmas()
        return KernelReport(
            kernel, sched.bundles, sched.body, sched.executed(), {}, sched.occupancy(), sched.spill_stores(), loops,
            steps_, steps_ * sched.executed() + fill_and_drain(sched), calib, dmas, dma_bytes, steps_ * dma_bytes,
            **timing,
        )  # fmt: skip
    n_blocks = t.block_w // t.compute_w
    tails = len(cost.walk_tails(t, kp.walk))
    # raises on a loop other than the compute blocks'
    st = steps(kp.name, plan.head_chunk > 0, sched, n_blocks, one_step_reduction(kp, t), tails)
    steady = not kp.reduced  # a step inside its reduction (neither first nor last), or its only step
    full = sched.skipped(st.skipped(["full"] * n_blocks, steady, steady))
    dmas, dma_bytes = sched.step_dmas(full)
    paths = {k: st.bundles([k] * n_blocks, steady, steady) for k in KINDS}
    ex = t.extents
    return KernelReport(
        kernel=kernel,
        bundles=sched.bundles,
        straight_line=sched.body,
        executed=paths["full"],
        paths=paths,
        occupancy=sched.occupancy(full),
        spill_stores=sched.spill_stores(full),
        loops=loops,
        steps=int(np.prod([ex[a] for a in kp.axes])),
        cycles=call_cycles(
            kp, st, t, kinds, dma_floor(kp, t, kinds, timing["clock_hz"] / timing["hbm_bytes_per_second"])
        ),
        calibration_cycles=calib,
        step_dmas=dmas,
        step_dma_bytes=dma_bytes,
        call_bytes=model_bytes,
        **timing,
    )


# The report over variants: compile, read, cost.

CALIBRATION_BLOCK = (512, 1024)  # the calibration matmul's output tile: rows x columns per grid step


def calibration_request(plan: VariantPlan, chip: str, shape) -> tpu_compile.Request:
    """The plain matmul a variant's kernels are compared with: depth D, the MXU operand type and
    precision of the variant, its output dtype."""
    f32 = plan.mxu_itemsize == 4
    params = (
        shape[3],
        "float32" if f32 else "bfloat16",
        "highest" if f32 else "default",
        plan.variant.policy.out,
    )
    return tpu_compile.Request(
        "", "", chip, tpu_compile.CALIBRATION, tuple(shape), calibration=params + CALIBRATION_BLOCK
    )


@dataclasses.dataclass(frozen=True)
class Row:
    variant: str
    chip: str
    program: str
    kernel: str
    mask: str  # of MASKS
    ok: bool
    error: str
    report: KernelReport | None
    note: str = ""  # what the reader could not read, said under the table


def explain(
    family: str, plans: list[VariantPlan], chips: list[str], shape, compress_rate: int,
    masks=("causal",), programs=("fwd", "grad"), top_k: int = 512, jobs: int | None = None,
    keep: str | None = None, path: str = "",
) -> list[Row]:  # fmt: skip
    """Compiles ``programs`` of every plan on every chip (once, with visibility bounds: the program is the
    same whatever they hold) and reads each kernel's schedule; costs each call under every mask.
    ``family`` is the generated package's name, imported from ``path`` when given."""
    requests = [
        tpu_compile.Request(family, p.name, chip, program, tuple(shape), top_k, causal=True, path=path)
        for p in plans
        for chip in chips
        for program in programs
    ]
    calibrations = {}
    for p in plans:
        for chip in chips:
            r = calibration_request(p, chip, shape)
            calibrations.setdefault((chip, r.calibration), r)
    results = list(tpu_compile.compile_many(requests + list(calibrations.values()), jobs=jobs, keep=keep))
    by_request = dict(zip(requests + list(calibrations.values()), results))
    calib = {}
    for key, r in calibrations.items():
        res = by_request[r]
        if not res.ok:
            raise RuntimeError(f"the calibration matmul did not compile on {key[0]}: {res.error}")
        calib[key] = schedule.parse(*res.kernels()[tpu_compile.CALIBRATION])
    rows = []
    for request in requests:
        res = by_request[request]
        plan = next(p for p in plans if p.name == request.variant)
        t = cost.tiling(plan, shape)
        cal = calib[(request.chip, calibration_request(plan, request.chip, shape).calibration)]
        compiled = res.kernels()
        # the forward is reported from its own program when that is compiled too
        program_kernels = tpu_compile.PROGRAMS[request.program]
        if request.program == "grad":  # the backward kernels this shape takes
            program_kernels = tuple(k.name for k in cost.call_kernels(plan, tuple(shape)))
        wanted = [
            k for k in program_kernels
            if not (request.program.endswith("grad") and request.program.replace("grad", "fwd") in programs
                    and k.endswith("forward"))
        ]  # fmt: skip
        if request.program == "topk":  # the selection kernel score_topk takes at this W
            out_dtype = plan.variant.as_dict()["out_dtype"]
            wanted = ["forward", _family_topk(family, path).selection_kernel(shape[4], top_k, out_dtype)]
        for kernel in wanted:
            for mask in masks:
                common = (plan.name, request.chip, request.program, kernel, mask)
                if not res.ok:
                    named = tpu_compile.failed_kernel(res, plan.name)
                    error = res.error if named == kernel or named not in wanted else "not reached"
                    rows.append(Row(*common, False, error, None))
                    continue
                name = f"{plan.name}_{kernel}"
                if name not in compiled:
                    raise schedule.ScheduleError(
                        f"{plan.name} {request.program} on {request.chip}: no schedule of {name}"
                    )
                bounds = _bounds(t.shape, compress_rate, mask)
                # the threshold kernel's loops, and a sparse kernel's over a window's spans of slots,
                # run as many trips as the data say
                dynamic = kernel.startswith("topk_") or kernel.startswith("sparse")
                sched = schedule.parse(*compiled[name], dynamic=dynamic)
                kp = next((k for k in plan.kernels if k.name == kernel), None)
                model_bytes = 0
                if kp is not None:
                    model_bytes = cost.kernel_cost(plan, kp, tuple(shape), bounds or None).hbm_bytes
                tk = cost.tiling(plan, shape, kp)  # of the kernel's compute width
                report = kernel_report(
                    plan,
                    kp,
                    kernel,
                    _step_schedule(sched, kernel, family, path, shape),
                    tk,
                    cost.kind_matrix(tk, *bounds, walk=kp.walk if kp is not None else COMPUTE_BLOCKS),
                    cal,
                    CALIBRATION_BLOCK[0] * CALIBRATION_BLOCK[1],
                    chip=request.chip,
                    model_bytes=model_bytes,
                )
                if kernel == "topk_threshold":  # one call per query chunk
                    report = threshold_report(report, sched, family, path, shape, plan, bounds)
                if kernel == "topk_select":
                    report = select_report(report, sched, family, path, shape, plan, bounds)
                if kernel.startswith("sparse_"):  # one call per window of k
                    report = sparse_report(report, sched, family, path, shape, plan, kernel, top_k, bounds)
                rows.append(Row(*common, True, "", report))
        if res.ok:  # XLA's own programs around the kernels (score_topk: the rest of its selection)
            chunks = _topk_chunks(family, path, shape, plan) if request.program == "topk" else 1
            report, unread = xla_report(
                res, plan, chunks, t, cal, CALIBRATION_BLOCK[0] * CALIBRATION_BLOCK[1], request.chip
            )
            note = ""
            if unread:
                note = (
                    f"{plan.name} {request.chip} {XLA}: {len(unread)} of its programs loop a number of times "
                    f"the dump does not state ({', '.join(sorted(unread))}), each loop counted once: a lower bound"
                )
            for mask in masks:  # XLA's programs do the same work whatever the bounds hold
                rows.append(Row(plan.name, request.chip, request.program, XLA, mask, True, "", report, note))
    if not keep:
        for res in results:
            tpu_compile.discard(res)
    return rows


MASKS = ("unmasked", "causal", "masked")  # what explain costs a call under


def _bounds(shape: cost.Shape, compress_rate: int, mask: str) -> tuple:
    """(kv_start, kv_end) of ``mask`` (``MASKS``): none for unmasked, causal CSA, or every block hidden."""
    if mask == "causal":
        return cost.causal_bounds(shape, compress_rate)
    if mask == "masked":
        nothing = np.zeros((shape.batch, shape.seq_len), np.int64)
        return nothing, nothing
    return ()


def _family_topk(family: str, path: str):
    """The family's own ``_topk`` module: its rules for chunks and skipped slices, not a copy of them."""
    if path and path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(f"{family}._topk")


def _topk_chunks(family: str, path: str, shape, plan: VariantPlan) -> int:
    """The query chunks ``score_topk`` scores and cuts at ``shape``, by the family's own rule."""
    batch, _, seq_len, _, num_blocks = shape
    chunk = _family_topk(family, path).queries_per_chunk(batch, seq_len, num_blocks, block_q=plan.block_q)
    return -(-seq_len // chunk)


def _chunk_calls(report: KernelReport, sched: schedule.Schedule, family: str, path: str, shape, plan: VariantPlan,
                 bounds, trips) -> KernelReport:  # fmt: skip
    """A selection kernel over all its calls, one a query chunk (the last one ending at S, as
    ``_topk._chunked`` takes them): each block of rows costs its bundles with the loops the data bound
    run no trip, plus a trip's share for each trip ``trips(kv_start, kv_end)`` gives it (per block of
    the call, from the chunk's rows' bounds; every block unmasked)."""
    batch, _, seq_len, _, width = shape
    chunk = _family_topk(family, path).queries_per_chunk(batch, seq_len, width, block_q=plan.block_q)
    if bounds:
        kv_start, kv_end = (np.asarray(b) for b in bounds)
    else:
        kv_start, kv_end = np.zeros((batch, seq_len), np.int64), np.full((batch, seq_len), width)
    none, one = (sched.with_trips(n).executed() for n in (0, 1))
    calls = -(-seq_len // chunk)
    cycles = blocks = 0
    for step in range(calls):
        at = min(step * chunk, seq_len - chunk)
        rows = slice(at, at + chunk)
        per_block = trips(kv_start[:, rows].reshape(-1), kv_end[:, rows].reshape(-1))
        blocks += len(per_block)
        cycles += len(per_block) * none + (one - none) * int(np.sum(per_block)) + fill_and_drain(sched)
    return dataclasses.replace(report, steps=blocks, cycles=cycles, call_bytes=report.call_bytes * calls)


def threshold_report(
    report: KernelReport, sched: schedule.Schedule, family: str, path: str, shape, plan: VariantPlan, bounds
) -> KernelReport:
    """``score_topk``'s threshold kernel over all its calls (``_chunk_calls``). Its passes loop over the
    groups of slices a block's rows see: two loops of as many trips as that (``schedule.DYNAMIC``: the
    keys, and the counts in each pass), by ``_topk.threshold_spans``."""
    width = shape[4]
    groups = _threshold_groups(family, path, width)
    dynamic = [loop for loop in sched.loops if loop.trips == schedule.DYNAMIC]
    if len(dynamic) != (2 if groups > 1 else 0):
        raise StructureError(
            f"topk_threshold: expected {2 if groups > 1 else 0} loops over the groups a block sees "
            f"(keys, counts); found loops {[(x.start, x.stop, x.trips) for x in sched.loops]}"
        )
    topk = _family_topk(family, path)

    def trips(kv_start, kv_end):  # a group's share: 0 where the slices are inline (one group)
        spans = topk.threshold_spans(kv_start, kv_end, width)
        return spans[:, 1] - spans[:, 0]

    return _chunk_calls(report, sched, family, path, shape, plan, bounds, trips)


def select_report(
    report: KernelReport, sched: schedule.Schedule, family: str, path: str, shape, plan: VariantPlan, bounds
) -> KernelReport:
    """``score_topk``'s selection kernel over all its calls (``_chunk_calls``), a block of 128 rows a step.
    Its passes loop over the vregs a block's rows see (``_select.spans``), eight at a time (the counting
    passes sixteen, the shift network from the first vreg): every loop the data bound is costed at a
    trip per eight vregs of the block's span, so the counting passes are counted twice over (an upper
    bound: the model has no term per loop)."""
    select = importlib.import_module(f"{family}._select")

    def trips(kv_start, kv_end):
        spans = select.spans(kv_start, kv_end, shape[4]).reshape(-1, 2)
        return (spans[:, 1] - spans[:, 0]) // select.UNROLL  # spans are whole counting trips: exact

    return _chunk_calls(report, sched, family, path, shape, plan, bounds, trips)


def sparse_report(report: KernelReport, sched: schedule.Schedule, family: str, path: str, shape,
                  plan: VariantPlan, kernel: str, top_k: int, bounds=()) -> KernelReport:  # fmt: skip
    """A sparse kernel over all its calls: one per window of k (all of W in one where it fits VMEM), by
    the family's own rule (``_gather.sparse_key_windows``) for the dtype the kernel gathers in.

    What runs once per batch element of a call is counted so, not on every step: the DMAs of the
    resident blocks (k's window and its dk: their index follows b only; the compiler issues them
    behind a predicate inside the step) and, in the backward, the zeroing of the dk accumulators at
    the first q block and their folding at the last (``once_per_batch``). With several windows, a
    query's loops over slots run the trips of its span of slots in the window: counted from a model
    of the indices at ``bounds`` (``_window_trips``), a query's loops costing one trip each the
    bundles a trip adds to the step over its queries."""
    batch, _, _, head_dim, _ = shape
    runtime, (rows, calls, copies) = sparse_windows(family, path, plan.name, kernel, shape, top_k)
    steps_ = sched.grid_trips - PIPELINE_ITERATIONS
    loops, trips, per_trip, none = report.loops, 0, 0.0, sched
    if calls > 1:
        step_trips = _window_trips(runtime, shape, top_k, rows, calls, bounds)  # [calls, steps]
        trips = int(step_trips.sum())
        none, sched = sched.with_trips(0), sched.with_trips(1)
        per_trip = (sched.executed() - none.executed()) / runtime.SPARSE_BLOCK_Q  # one a query's loops
        mean = trips / (calls * steps_ * runtime.SPARSE_BLOCK_Q)  # a query's trips a call
        loops = tuple((size, round(mean) if n == schedule.DYNAMIC else n) for size, n in loops)
    once = once_per_batch(sched, copies) if kernel == "sparse_backward" else set()
    resident = rows * -(-head_dim // 128) * 128 * 4  # bytes of a float32 block of the window's rows
    dmas, dma_bytes = sched.step_dmas(once, sizes=lambda n: n != resident)
    _, resident_bytes = sched.step_dmas(sizes=lambda n: n == resident)
    steady = none.executed(once)  # a step's bundles, its loops over spans of slots (if any) run no trip
    per_call = steps_ * steady + batch * (sched.executed() - sched.executed(once)) + fill_and_drain(sched)
    cycles = int(calls * per_call + per_trip * trips)
    return dataclasses.replace(
        report, executed=int(steady + per_trip * trips / (calls * steps_)),  # a step's mean
        steps=steps_ * calls, cycles=cycles, step_dmas=dmas, step_dma_bytes=dma_bytes,
        call_bytes=calls * (steps_ * dma_bytes + batch * resident_bytes), loops=loops,
    )  # fmt: skip


def sparse_windows(family: str, path: str, variant: str, kernel: str, shape, top_k: int):
    """(the family's ``_gather``, (rows per window, windows, dk accumulators)) of a sparse kernel of
    ``variant`` at ``shape``: the family's own rule (``_gather.sparse_key_windows``) for the dtype the
    kernel gathers in and the accumulators it may hold."""
    _, heads, _, head_dim, width = shape
    if path and path not in sys.path:
        sys.path.insert(0, path)
    module = importlib.import_module(f"{family}.{variant}")
    sparse = module._sparse
    backward = kernel == "sparse_backward"
    gather = sparse.SPARSE_BACKWARD_GATHER_DTYPE if backward else sparse.SPARSE_GATHER_DTYPE
    most = sparse._gather.SPARSE_DK_COPIES if backward else 0
    windows = sparse._gather.sparse_key_windows(
        width, head_dim, heads, top_k, gather, module.VARIANT["q_dtype"], most
    )
    return sparse._gather, windows


def _window_trips(runtime, shape, top_k: int, rows: int, calls: int, bounds) -> np.ndarray:
    """Loop trips of each grid step of each window's call, summed over the step's queries (and batch
    elements): ``[calls, steps]``.

    The indices are a model, not the kernel's data: each query selects min(top_k, visible) distinct
    blocks uniformly among those it sees (``[kv_start, kv_end)`` of ``bounds``; every block without),
    the selection ``score_topk`` makes of random scores, drawn with a fixed seed window by window
    (multivariate hypergeometric counts). Its slots, sorted by block, then span each window as
    ``_gather.window_spans`` says, and cost the trips ``_gather.span_trips`` says."""
    batch, _, seq_len, _, width = shape
    if bounds:
        kv_start, kv_end = (np.asarray(b, np.int64).reshape(batch, seq_len) for b in bounds)
    else:
        kv_start, kv_end = np.zeros((batch, seq_len), np.int64), np.full((batch, seq_len), width)
    rng = np.random.default_rng(0)
    kv_end = np.minimum(kv_end, width)
    unseen = np.maximum(kv_end - kv_start, 0)  # visible blocks not yet in a window
    left = np.minimum(unseen, top_k)  # slots not yet in a window
    first = np.zeros_like(unseen)  # the query's first slot in the window (its slots sorted)
    geometry = runtime._geometry
    qb, unroll = runtime.SPARSE_BLOCK_Q, geometry.sparse_trip(geometry.sparse_top_k_pad(top_k))
    out = np.zeros((calls, -(-seq_len // qb)), np.int64)
    for c in range(calls):
        here = np.maximum(np.minimum(kv_end, (c + 1) * rows) - np.maximum(kv_start, c * rows), 0)
        count = rng.hypergeometric(here, unseen - here, left)
        lo, stop = runtime.span_trips(first, first + count, unroll)
        trips = np.zeros((batch, out.shape[1] * qb), np.int64)
        trips[:, :seq_len] = stop - lo
        out[c] = trips.reshape(batch, -1, qb).sum(axis=(0, 2))
        first, left, unseen = first + count, left - count, unseen - here
    return out


def _threshold_groups(family: str, path: str, width: int) -> int:
    """The groups of slices of a row of the threshold kernel: its loops' trips for a block that sees all."""
    padded, lanes, unroll, _ = _family_topk(family, path).threshold_geometry(width)
    return padded // (lanes * unroll)


def _step_schedule(sched: schedule.Schedule, kernel: str, family: str, path: str, shape) -> schedule.Schedule:
    """A kernel's schedule for its step report: the selection kernels' for a block whose rows see every
    block (the threshold kernel's every group of slices; the select kernel's every vreg, eight a trip)."""
    if kernel == "topk_threshold":
        return sched.with_trips(_threshold_groups(family, path, shape[4]))
    if kernel == "topk_select":
        select = importlib.import_module(f"{family}._select")
        return sched.with_trips(
            select.geometry(shape[4], 1, "float32")[0] // select.SUBLANES // select.UNROLL
        )
    return sched


XLA = "xla"  # the report of a program's XLA programs, beside its kernels'


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*?)\)(?:, |$)")


def _array_bytes(text: str) -> int:
    """Bytes of every array type written in ``text`` (a tuple's elements summed), untiled."""
    return sum(
        math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES.get(dtype, 4)
        for dtype, dims in _ARRAY.findall(text)
        if dtype in _DTYPE_BYTES
    )


def hbm_bytes(hlo: str) -> dict[str, int]:
    """Per HLO instruction of the optimised program text: the bytes it reads and writes if its operands
    and result all live in HBM (its result's and its operands' arrays), for XLA's own programs, which
    are costed as the larger of their cycles and these bytes at the chip's HBM bandwidth."""
    types: dict[str, str] = {}
    instructions = []
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            name, result, _, operands = m.groups()
            types[name] = result
            instructions.append((name, result, re.findall(r"%([\w.\-]+)", operands)))
    return {
        name: _array_bytes(result) + sum(_array_bytes(types.get(o, "")) for o in operands)
        for name, result, operands in instructions
    }


def xla_report(
    result: tpu_compile.Result, plan: VariantPlan, trips: int, t: cost.Tiling, calibration: schedule.Schedule,
    calibration_logits: int, chip: str,
) -> tuple[KernelReport, list[str]]:  # fmt: skip
    """What XLA's own programs of a compiled program cost (every program the dump holds but the variant's
    Pallas kernels): each program the larger of its cycles (``schedule.program_cycles``) and its HBM
    bytes (``hbm_bytes``: a layout copy of q is a few bundles a trip of a loop the dump does not bound,
    and 256 MiB moved at S 8192) at the chip's HBM bandwidth, ``trips`` times for one inside the while
    loop (``score_topk``'s scan over its query chunks), once otherwise; the chip's delay slots read from
    the variant's forward kernel in the same dump (any of its kernels, where it has no forward). Returns
    the report (its cycles: the programs' time at the report's clock) and the programs whose loop trips
    could not be read (counted once)."""
    hlo = result.hlo()
    inside, moved = loop_bodies(hlo), hbm_bytes(hlo)
    timing = _timing(plan, t, calibration, calibration_logits, chip)
    cycles_per_byte = timing["clock_hz"] / timing["hbm_bytes_per_second"]
    ours = {n: f for n, f in result.kernels().items() if n.startswith(f"{plan.name}_")}
    delay = schedule.parse(*ours.get(f"{plan.name}_forward", next(iter(ours.values())))).delay_slots
    cycles = per_trip = bundles = call_bytes = 0
    unread = []
    for name, files in result.programs().items():
        if name.startswith(f"{plan.name}_"):  # a Pallas kernel of the variant: reported on its own
            continue
        c, size, read = schedule.program_cycles(*files, delay)
        c = max(c, int(moved.get(name, 0) * cycles_per_byte))
        bundles += size
        if not read:
            unread.append(name)
        times = trips if name in inside else 1
        cycles += c * times
        call_bytes += moved.get(name, 0) * times
        per_trip += c if name in inside else 0
    logits = t.shape.batch * t.shape.num_heads * t.shape.seq_len * t.shape.num_blocks
    report = KernelReport(
        kernel=XLA, bundles=bundles, straight_line=bundles, executed=per_trip, paths={}, occupancy={},
        spill_stores=0, loops=(), steps=trips, cycles=cycles,
        calibration_cycles=calibration.body * logits // calibration_logits, call_bytes=call_bytes, **timing,
    )  # fmt: skip
    return report, unread


def table(rows: list[Row], shape) -> str:
    """One line per kernel: compiled or Mosaic's message; bundles per grid step by path; occupancy;
    cycles per call against the calibration matmul."""
    head = (
        f"compiled by libtpu (ahead of time, no TPU), not modelled; B,H,S,D,W = {','.join(map(str, shape))}; "
        "a bundle per cycle, DMAs overlapped, no stalls; step bundles at a step inside the reduction; "
        "DMAs and KiB: the HBM DMAs one step issues (full path); GB: the call's HBM bytes (sparse: its "
        "DMAs; dense: the plan's model); us: the larger of Mcycles at the clock where the calibration "
        "matmul runs at the chip's cited peak, and GB at its HBM bandwidth (a copy's, measured, on v5e; else the cited); xla: XLA's own programs "
        "around the kernels (the operands' layout and bounds; score_topk's selection), each the larger of its "
        "bundles with its loops' trips and its operands' and result's bytes at the HBM bandwidth, once per chunk "
        "inside score_topk's chunk loop; step: straight is their bundles, executed their cycles a chunk"
    )
    columns = ["variant", "chip", "kernel", "mask", "step: straight", "executed", "empty", "full", "partial",
               "MXU", "XLU", "VALU", "spills", "loops x trips", "DMAs", "KiB", "Mcycles", "x matmul", "GB",
               "us"]  # fmt: skip
    lines = []
    for r in rows:
        if not r.ok:
            lines.append([r.variant, r.chip, r.kernel, r.mask, f"DOES NOT COMPILE: {r.error}"])
            continue
        k = r.report
        occ = k.occupancy
        loops = ", ".join(f"{size}x{trips}" for size, trips in sorted(set(k.loops))) or "-"
        lines.append(
            [r.variant, r.chip, r.kernel, r.mask, f"{k.straight_line:,}", f"{k.executed:,}",
             *(f"{k.paths[p]:,}" if k.paths else "-" for p in KINDS),
             *(f"{occ[u]:.0%}" if occ else "-" for u in ("MXU", "XLU", "VALU")), str(k.spill_stores), loops,
             f"{k.step_dmas:,}", f"{k.step_dma_bytes / 1024:,.0f}", f"{k.cycles / 1e6:,.2f}",
             f"{k.cycles / k.calibration_cycles:.2f}", f"{k.call_bytes / 1e9:,.3f}", f"{k.seconds * 1e6:,.0f}"]
        )  # fmt: skip
    widths = [max(len(c), *(len(line[i]) for line in lines if len(line) > i)) for i, c in enumerate(columns)]
    out = [head, "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    for line in lines:
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    out += sorted({r.note for r in rows if r.note})
    return "\n".join(out)
