"""The real TPU compiler in the loop: libtpu compiles the production kernels here, and the schedule reader.

The compile gate over every variant (``codegen compile``) runs in CI at the newest JAX; these tests hold
the reader and the cycle count to the compiled program at both ends of the JAX range.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from codegen import cli, compiled, cost, grid_steps, pipeline, schedule, tpu_compile
from codegen import plan as plan_module
from tests.spec_cases import SPEC_PATH

SHAPE = (1, 64, 8192, 128, 2048)
PRODUCTION = "tpu_sm_bf16_q256_w2048c512f256_hc16"
# What libtpu printed for the sparse gather of bfloat16 rows before it read aligned row groups.
MOSAIC_ERROR = (
    "XlaRuntimeError: INTERNAL: Mosaic failed to compile TPU kernel with MLIR module name "
    "`tpu_sm_bf16_q256_w2048c512f256_hc16_sparse_forward` HLO name `tpu_sm_bf16_q256_w2048c512f256_hc16_sparse_forward.1`: "
    "E2003: CompileTimeMosaicUnprovenMemoryAccessAlignment: cannot statically prove that index in dimension 1 "
    "is a multiple of 8 The MLIR operation involved: %1 = vector.load ..."
)


def test_mosaic_message_names_the_kernel():
    result = tpu_compile.Result(tpu_compile.Request("f", PRODUCTION, "7x", "sparse_fwd", SHAPE), False,
                                tpu_compile.mosaic_message(MOSAIC_ERROR), 1.0, "")  # fmt: skip
    assert result.error.startswith("Mosaic failed to compile TPU kernel")
    assert "E2003" in result.error and "The MLIR operation" not in result.error
    assert tpu_compile.failed_kernel(result, PRODUCTION) == "sparse_forward"


def test_compiled_explain_without_libtpu_names_the_extra(monkeypatch, capsys):
    monkeypatch.setattr(tpu_compile, "available", lambda: False)
    argv = ["explain", str(SPEC_PATH), PRODUCTION, "--shape", "1,64,8192,128,2048", "--compiled"]
    assert cli.main(argv) == 2
    assert '".[tpu]"' in capsys.readouterr().err
    assert cli.main(["compile", str(SPEC_PATH), PRODUCTION]) == 2


def test_compile_rejects_an_unknown_chip_or_program(capsys):
    assert cli.main(["compile", str(SPEC_PATH), PRODUCTION, "--chip", "v4"]) == 2
    assert "unknown chip 'v4'" in capsys.readouterr().err
    assert cli.main(["compile", str(SPEC_PATH), PRODUCTION, "--programs", "fwd,bwd"]) == 2
    assert "unknown programs ['bwd']" in capsys.readouterr().err


def test_compile_gate_passes_a_variant(capsys):
    argv = ["compile", str(SPEC_PATH), "tpu_hm_f32_q16_w128_hcall", "--chip", "v5e", "--programs", "fwd"]
    argv += ["--shape", "1,8,256,128,128"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "ok    v5e  tpu_hm_f32_q16_w128_hcall fwd" in out and "1 compiled, 0 failed" in out


def test_compile_gate_compiles_sparse_programs_once_per_sparse_kernel_module(capsys):
    """Two variants that differ only in head chunking share the sparse kernels, layout and dtypes: one
    sparse program between them; a variant of the other layout gets its own."""
    argv = ["compile", str(SPEC_PATH), "tpu_sm_bf16_q16_w128_hc16", "tpu_sm_bf16_q16_w128_hcall",
            "tpu_hm_bf16_q16_w128_hc16", "--chip", "v5e", "--programs", "sparse_fwd", "--shape", "1,16,256,128,128"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "ok    v5e  tpu_sm_bf16_q16_w128_hc16 sparse_fwd" in out
    assert "ok    v5e  tpu_hm_bf16_q16_w128_hc16 sparse_fwd" in out
    assert "tpu_sm_bf16_q16_w128_hcall" not in out and "2 compiled, 0 failed" in out


def test_compile_gate_compiles_the_dense_route_once_per_score_dtype(capsys):
    """The dense route's own kernels (the take and its transpose) depend only on the scores' dtype, and
    its dense kernels are the variant's gradient program's: one route program per scores' dtype."""
    argv = ["compile", str(SPEC_PATH), "tpu_sm_bf16_q16_w128_hc16", "tpu_hm_bf16_q16_w128_hc16",
            "tpu_hm_f32_q16_w128_hcall", "--chip", "v5e", "--programs", "route_grad", "--shape", "1,16,256,128,128"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "ok    v5e  tpu_sm_bf16_q16_w128_hc16 route_grad" in out
    assert "ok    v5e  tpu_hm_f32_q16_w128_hcall route_grad" in out
    assert "tpu_hm_bf16_q16_w128_hc16" not in out and "2 compiled, 0 failed" in out


def test_dma_floor_is_what_a_step_waits_on():
    """The forward at S 16384 / W 8192, causal, by hand: q blocks 0 to 31 see w tile 0 only, so their
    steps at tiles 1 to 3 only write -inf. Such a step waits on the write of the tile before (bf16
    [256, 2048]: 1 MiB) and on the fetch of what the next step reads anew: nothing in its own row (k
    holds its tile on a step with no work), the next q block's q, weights and bounds at a row's end,
    and k's tile 0 again after a row that ended on tile 1."""
    plan = pipeline.load_family(SPEC_PATH).plan(PRODUCTION)
    kp = next(k for k in plan.kernels if k.name == "forward")
    shape = (1, 64, 16384, 128, 8192)
    t = cost.tiling(plan, shape, kp)
    kinds = cost.kind_matrix(t, *compiled._bounds(t.shape, 4, "causal"), walk=kp.walk)
    floor = grid_steps.dma_floor(kp, t, kinds, 1.0).reshape(64, 4)  # bytes, [q block, w tile]
    out, k_tile = 256 * 2048 * 2, 2048 * 128 * 2
    next_row = 256 * 64 * 128 * 2 + 256 * 64 * 2 + 256 * 2 * 4  # q, weights, kv bounds of a q block
    assert floor[0, 0] == 0  # nothing written before it, nothing new for step (0, 1)
    assert floor[0, 1] == floor[0, 2] == floor[31, 2] == out
    assert floor[0, 3] == out + next_row
    assert floor[40, 0] == out + k_tile  # q block 40 sees tiles 0 and 1: tile 1 fetched
    assert floor[40, 3] == out + next_row + k_tile


def _steps_by_loop(kp, st, t, kinds) -> int:
    """A call's cycles the slow way: every grid step in turn, the bundles of its own path."""
    ex = {a: n if a in kp.axes else 1 for a, n in t.extents.items()}  # the forward has no chunk axis
    n_blocks, per_tile = t.block_w // t.compute_w, t.block_w // t.compute_w + len(st.tails)
    total = 0
    for b, i, j, c in np.ndindex(ex["b"], ex["i"], ex["j"], ex["c"]):
        at = {"b": b, "i": i, "j": j, "c": c}
        first = all(at[a] == 0 for a in kp.reduced)
        last = all(at[a] == ex[a] - 1 for a in kp.reduced)
        row = [grid_steps.KINDS[k] for k in kinds[b * ex["i"] + i, j * per_tile : (j + 1) * per_tile]]
        total += st.bundles(row[:n_blocks], first, last, row[n_blocks:])
    return total


def test_compiled_schedule_of_the_production_kernels(tmp_path):
    """One compile (forward and gradient of the production hc16 variant on v6e, and the calibration
    matmul) read as ``codegen explain --compiled`` reads it."""
    family = pipeline.load_family(SPEC_PATH)
    plan = family.plan(PRODUCTION)
    t = cost.tiling(plan, SHAPE)
    calibration = compiled.calibration_request(plan, "v6e", SHAPE)
    requests = [tpu_compile.Request("generated.csa_v4", PRODUCTION, "v6e", p, SHAPE) for p in ("fwd", "grad")]
    results = list(tpu_compile.compile_many(requests + [calibration], keep=str(tmp_path)))
    assert all(r.ok for r in results), [r.error for r in results]

    # The calibration matmul is branch-free: only the compiler's wrapper region, nothing in it, so a
    # call costs its steps times its body.
    calib = schedule.parse(*results[2].kernels()[tpu_compile.CALIBRATION])
    assert len(calib.spans) == 1 and not calib.spans[0].children and not calib.loops
    assert calib.body > 0

    kernels = {**results[0].kernels(), **results[1].kernels()}
    bounds = cost.causal_bounds(t.shape, family.spec.computation.compress_rate)
    for kp in cost.call_kernels(plan, SHAPE):  # the forward and, one w tile covering W, dq_dk
        t = cost.tiling(plan, SHAPE, kp)  # 512-wide compute blocks in the forward, 256 in dq_dk
        n_blocks = t.block_w // t.compute_w
        assert n_blocks == (4 if kp.name == "forward" else 8)
        sched = schedule.parse(*kernels[f"{PRODUCTION}_{kp.name}"])
        causal, unmasked = cost.kind_matrix(t, *bounds, walk=kp.walk), cost.kind_matrix(t, walk=kp.walk)
        # the forward's walk ends on a piece of 256 and one of 128 after its loop of 512-wide ones
        tails = len(cost.walk_tails(t, kp.walk))
        assert tails == (2 if kp.name == "forward" else 0)
        # raises if the branches are not the template's
        one_step = grid_steps.one_step_reduction(kp, t)  # dq/dweights: one w tile at W = 2048
        st = grid_steps.steps(kp.name, True, sched, n_blocks, one_step, tails)
        ex = t.extents
        assert sched.grid_trips == np.prod([ex[a] for a in kp.axes]) + grid_steps.PIPELINE_ITERATIONS
        # the shared code plus every region once is the straight-line body
        # (the compute blocks are a loop of n_blocks trips, its body one block's regions)
        assert st.loop is not None and st.loop.trips == n_blocks and len(set(st.blocks)) == 1
        ends = sum(s.size for s in st.prologue + st.epilogue + tuple(s for g in st.tails for s in g))
        assert st.shared + ends + st.loop.size == sched.body
        assert (
            st.bundles(["partial"] * n_blocks, True, True, ["partial"] * tails) <= sched.executed()
        )  # all taken
        for first, last in ((True, True), (False, False), (True, False), (False, True)):
            empty, full, partial = (st.bundles([k] * n_blocks, first, last) for k in grid_steps.KINDS)
            assert empty < full <= partial <= sched.executed()
        # the vectorised count equals a walk over every grid step
        for kinds in (unmasked, causal):
            fill_and_drain = grid_steps.fill_and_drain(sched)
            assert (
                grid_steps.call_cycles(kp, st, t, kinds) == _steps_by_loop(kp, st, t, kinds) + fill_and_drain
            )
            # a floor below every step's bundles changes nothing; one above them all is the call's time
            steps_ = np.prod([ex[a] for a in kp.axes])
            low, high = np.zeros(steps_), np.full(steps_, 10**7)
            assert grid_steps.call_cycles(kp, st, t, kinds, low) == grid_steps.call_cycles(kp, st, t, kinds)
            assert grid_steps.call_cycles(kp, st, t, kinds, high) == 10**7 * steps_ + fill_and_drain
        cal = (calib, compiled.CALIBRATION_BLOCK[0] * compiled.CALIBRATION_BLOCK[1])
        rep = {
            m: compiled.kernel_report(plan, kp, kp.name, sched, t, k, *cal)
            for m, k in (("u", unmasked), ("c", causal))
        }
        # causal skipping: cycles follow the share of compute blocks with work (0.5625 at this tiling),
        # or of the columns the forward's pieces cover (0.531), plus what an empty block and an idle step
        # still issue
        if kp.walk == plan_module.VISIBLE_PIECES:
            work = cost.visible_columns(t, *bounds) / (t.seq_pad // t.block_q * t.blocks_pad)
        else:
            work = np.mean(causal != 0)
        assert work < rep["c"].cycles / rep["u"].cycles < work + 0.1, kp.name
        # within reach of the plain matmul over the same logits (which also stores them all), and
        # the MXU does work on the full path
        assert rep["u"].cycles > 0.5 * rep["u"].calibration_cycles
        assert rep["u"].occupancy["MXU"] > 0.2

    # A template whose branches changed without BRANCHES is refused, naming the kernel.
    sched = schedule.parse(*kernels[f"{PRODUCTION}_dq_dk"])
    wrong = dataclasses.replace(
        grid_steps.BRANCHES[("dq_dk", True)], per_block=(("work", (("partial", ()),)),)
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(grid_steps.BRANCHES, ("dq_dk", True), wrong)
        with pytest.raises(
            grid_steps.StructureError, match=r"dq_dk: the step's \d+ branch regions hold no run"
        ):
            grid_steps.steps("dq_dk", True, sched, n_blocks)


def test_a_reduction_of_one_step_folds_its_first_and_last_regions(tmp_path):
    """With one w tile, every dq/dweights step is its q block's first and last: the compiler folds both
    conditions, so the reader finds no epilogue and counts the finish as code every step issues. (A
    variant with dq_dk runs that at one w tile instead; this one goes without it, over VMEM.)"""
    name, shape = "tpu_sm_bf16_q512_w2048c512_hc16", (1, 16, 1024, 128, 128)  # W = block_w: one w tile
    plan = pipeline.load_family(SPEC_PATH).plan(name)
    t = cost.tiling(plan, shape)
    (result,) = tpu_compile.compile_many([tpu_compile.Request("generated.csa_v4", name, "7x", "grad", shape)],
                                         keep=str(tmp_path))  # fmt: skip
    assert result.ok, result.error
    kp = next(k for k in plan.kernels if k.name == "dq_dweights")
    assert grid_steps.one_step_reduction(kp, t)
    sched = schedule.parse(*result.kernels()[f"{name}_dq_dweights"])
    n_blocks = t.block_w // t.compute_w
    with pytest.raises(grid_steps.StructureError, match="dq_dweights: the step's"):
        grid_steps.steps(kp.name, True, sched, n_blocks)
    st = grid_steps.steps(kp.name, True, sched, n_blocks, one_step_reduction=True)
    assert not st.prologue and not st.epilogue
    assert st.bundles(["full"] * n_blocks, False, False) == sched.body  # the finish included


# A grid loop of 10 steps holding a loop unrolled by 8 (its counter steps by 8 to 1024: 128 trips) that
# issues a 512-byte row gather each trip, then a 128 KiB write-back and six idle bundles; the bounds check's quote of the
# gather is not a DMA. Two delay slots after each branch.
SYNTHETIC_BUNDLES = """\
   0x0 LB: > { %s1_s1 = sphi %s0_s0, %s2_s2 } /* Start region 1 */
   0x1   : > { %s3_s3 = sadd.s32 1, %s1_s1 }
   0x2 LB: >> { %s5_s5 = sphi %s4_s4, %s6_s5 } /* Start region 2 */
   0x3   : >> { %10 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s3, /*size_in_granules=*/16, /*vmem=*/%s4  ;;  %s6_s5 = sadd.s32 8, %s5_s5 }
   0x4   : >> { %12 = shalt.err (!%p1) /* BoundsCheck 2 for %10 = dma.hbm_to_vmem [thread:$0]  /*hbm=*/%s3, /*size_in_granules=*/16, /*vmem=*/%s4 */ }
   0x5   : >> { %p7_p1 = scmp.ge.s32.totalorder %s6_s5, 1024 /* loop exit test */ }
   0x6   : >> { %8 = sbr.rel (!%p7_p1) target = $region2 }
   0x7   : >> { %s9_s9 = smov 0 }
   0x8   : >> { %s9_s9 = smov 0 } /* End region 2 */
   0x9   : > { %11 = dma.vmem_to_hbm [thread:$0]  /*vmem=*/%s3, /*size_in_granules=*/4096, /*hbm=*/%s4 }
   0xa   : > { %s9_s9 = smov 0 }
   0xb   : > { %s9_s9 = smov 0 }
   0xc   : > { %s9_s9 = smov 0 }
   0xd   : > { %s9_s9 = smov 0 }
   0xe   : > { %s9_s9 = smov 0 }
   0xf   : > { %s9_s9 = smov 0 }
   0x10  : > { %p20_p2 = scmp.ge.s32.totalorder %s3_s3, 10 /* loop exit test */ }
   0x11  : > { %9 = sbr.rel (!%p20_p2) target = $region1 }
   0x12  : > { %s9_s9 = smov 0 }
   0x13  : > { %s9_s9 = smov 0 } /* End region 1 */
   0x14  : > { %13 = shalt }
"""


def test_schedule_counts_unrolled_trips_and_dmas(tmp_path):
    bundles, utilization = tmp_path / "final_bundles.txt", tmp_path / "utilization.txt"
    bundles.write_text(SYNTHETIC_BUNDLES)
    rows = ["0 0 0 0 0 0 0 0 0 1"] * 21
    utilization.write_text("== CAPACTIY:\n" + ", ".join(schedule.UNITS) + "\n2 2 4 2 1 3 3 2 2 2\n== UTILIZATION:\n"
                           + "\n".join(rows) + "\n")  # fmt: skip
    sched = schedule.parse(str(bundles), str(utilization))
    assert sched.grid_trips == 10
    assert [(loop.start, loop.stop, loop.trips) for loop in sched.loops] == [(2, 9, 128)]
    assert sched.body == 20 and sched.executed() == 20 + 127 * 7
    # per step: 128 gathers of 16 granules (32 bytes each) and one write-back of 4096
    assert sched.step_dmas() == (129, 128 * 16 * 32 + 4096 * 32)
    assert sched.step_dmas(kinds=("vmem_to_hbm",)) == (1, 4096 * 32)
    assert sched.step_dmas(sched.skipped([schedule.Span(8, 9, 10, "")])) == (128, 128 * 16 * 32)


def test_a_nested_loop_runs_its_trips_on_every_outer_trip():
    # bundles 2-7 loop 4 times; 3-4, inside, 3 times each of those
    sched = schedule.Schedule(
        bundles=10, body_start=0, body_stop=10, spans=(), grid_trips=1,
        loops=(schedule.Loop(2, 8, 4), schedule.Loop(3, 5, 3)), capacity=(1,) * len(schedule.UNITS),
        utilization=((0,) * len(schedule.UNITS),) * 10, dmas=((),) * 4 + ((("hbm_to_vmem", 64),),) + ((),) * 5,
    )  # fmt: skip
    assert sched.executed() == 4 * 1 + 4 * 4 + 2 * 12
    assert sched.step_dmas() == (12, 12 * 64)


def _write_dump(tmp_path, text):
    bundles, utilization = tmp_path / "final_bundles.txt", tmp_path / "utilization.txt"
    bundles.write_text(text)
    rows = ["0 0 0 0 0 0 0 0 0 1"] * text.count("\n")
    utilization.write_text("== CAPACTIY:\n" + ", ".join(schedule.UNITS) + "\n2 2 4 2 1 3 3 2 2 2\n== UTILIZATION:\n"
                           + "\n".join(rows) + "\n")  # fmt: skip
    return str(bundles), str(utilization)


def test_an_xla_program_costs_its_bundles_with_loop_trips(tmp_path):
    # the synthetic kernel as an XLA program: 1 bundle before the loop, 20 a trip, 10 trips, its
    # inner loop's 7 bundles 128 times a trip
    assert schedule.program_cycles(*_write_dump(tmp_path, SYNTHETIC_BUNDLES), delay=2) == (
        1 + 10 * (20 + 127 * 7),
        SYNTHETIC_BUNDLES.count("\n"),
        True,
    )
    straight = "".join(f"   {hex(n)}  : > {{ %s9_s9 = smov 0 }}\n" for n in range(5))
    assert schedule.program_cycles(*_write_dump(tmp_path, straight), delay=2) == (5, 5, True)
    # a loop whose bound is a register (XLA's gathers and copies loop as the data says): once, flagged
    unbounded = SYNTHETIC_BUNDLES.replace("%s6_s5, 1024 /* loop exit test */", "%s6_s5, %s7_s7")
    cycles, size, read = schedule.program_cycles(*_write_dump(tmp_path, unbounded), delay=2)
    assert (cycles, size, read) == (SYNTHETIC_BUNDLES.count("\n"), SYNTHETIC_BUNDLES.count("\n"), False)


SYNTHETIC_HLO = """\
HloModule jit_call, entry_computation_layout={()->s32[4]}

%body (arg: (s32[], s32[4])) -> (s32[], s32[4]) {
  %arg = (s32[], s32[4]) parameter(0)
  %fusion.7 = s32[4]{0} fusion(%arg), kind=kLoop, calls=%fused_computation.1
  ROOT %tuple.1 = (s32[], s32[4]) tuple(%fusion.7, %sort.3)
}

%cond (arg.1: (s32[], s32[4])) -> pred[] {
  ROOT %lt = pred[] compare(%arg.1), direction=LT
}

ENTRY %main () -> s32[4] {
  %copy.2 = s32[4]{0} copy(%c)
  %while.3 = (s32[], s32[4]) while(%tuple.0), condition=%cond, body=%body
  ROOT %gte = s32[4]{0} get-tuple-element(%while.3), index=1
}
"""


def test_loop_bodies_are_read_from_the_hlo():
    assert grid_steps.loop_bodies(SYNTHETIC_HLO) == {"arg", "fusion.7", "tuple.1"}


def test_xla_programs_are_costed_by_the_bytes_they_move():
    """An XLA program reads its operands and writes its result: a layout copy of bf16 [8192, 8192] moves
    256 MiB however few bundles a trip of its loop issues (a tuple's elements add up)."""
    hlo = (
        "ENTRY %main () -> bf16[1,8192,8192] {\n"
        "  %q = bf16[1,8192,64,128]{3,2,1,0:T(8,128)(2,1)} parameter(0)\n"
        '  %copy.3 = bf16[1,8192,8192]{2,1,0:T(8,128)(2,1)} copy(%q), metadata={op_name="reshape"}\n'
        "  ROOT %fusion = (f32[4]{0}, s32[2]{0}) fusion(%copy.3, %q), kind=kLoop, calls=%f\n"
        "}\n"
    )
    moved = compiled.hbm_bytes(hlo)
    q = 8192 * 8192 * 2
    assert moved["q"] == q and moved["copy.3"] == 2 * q
    assert moved["fusion"] == 4 * 4 + 2 * 4 + 2 * q


def test_a_loop_the_kernel_bounds_itself_takes_the_trips_the_caller_gives(tmp_path):
    # the synthetic kernel's inner loop bounded by a register: DYNAMIC when asked for, else an error
    unbounded = SYNTHETIC_BUNDLES.replace("%s6_s5, 1024 /* loop exit test */", "%s6_s5, %s7_s7")
    files = _write_dump(tmp_path, unbounded)
    with pytest.raises(schedule.ScheduleError, match="no exit test with a constant bound"):
        schedule.parse(*files)
    sched = schedule.parse(*files, dynamic=True)
    assert [(loop.start, loop.stop, loop.trips) for loop in sched.loops] == [(2, 9, schedule.DYNAMIC)]
    assert [sched.with_trips(n).executed() for n in (0, 1, 128)] == [13, 20, 20 + 127 * 7]


@pytest.mark.parametrize("num_blocks, windows", [(2048, 1), (65536, 2)], ids=["resident_k", "k_in_windows"])
def test_sparse_kernels_cost_their_windows_and_once_per_batch_work_once(num_blocks, windows, tmp_path):
    """The sparse gradient compiled for v6e (few queries, the V4 heads and top_k 1024) and read as
    ``codegen explain --compiled`` reads it: a call per window of k, each query's loops in a window's
    call only over its span of slots there, and what runs once per batch element of a call (the
    backward's zeroing and adding up of its dk accumulators, the resident blocks' DMAs) once."""
    shape, top_k = (1, 64, 64, 128, num_blocks), 1024
    family = pipeline.load_family(SPEC_PATH)
    plan = family.plan(PRODUCTION)
    request = tpu_compile.Request("generated.csa_v4", PRODUCTION, "v6e", "sparse_grad", shape, top_k)
    (result,) = tpu_compile.compile_many([request], keep=str(tmp_path))
    assert result.ok, result.error
    module = __import__(f"generated.csa_v4.{PRODUCTION}", fromlist=["_sparse"])
    runtime, gather = module._sparse._gather, module._sparse.SPARSE_BACKWARD_GATHER_DTYPE
    rows, calls, copies = runtime.sparse_key_windows(num_blocks, 128, 64, top_k, gather, "bfloat16", 4)
    assert calls == windows and copies == (4 if windows == 1 else 1)
    sched = schedule.parse(*result.kernels()[f"{PRODUCTION}_sparse_backward"], dynamic=True)
    # with windows, the loops over slots run as many trips as a query's span (none without)
    assert all((loop.trips == schedule.DYNAMIC) == (windows > 1) for loop in sched.loops)
    t = cost.tiling(plan, shape)
    base = compiled.kernel_report(plan, None, "sparse_backward", sched, t, cost.kind_matrix(t), sched, 1)
    report = compiled.sparse_report(
        base, sched, "generated.csa_v4", "", shape, plan, "sparse_backward", top_k
    )
    trip = runtime._geometry.sparse_trip(runtime._geometry.sparse_top_k_pad(top_k))  # slots a loop trip
    steps, trips = sched.grid_trips - grid_steps.PIPELINE_ITERATIONS, top_k // trip  # a query's, over W
    assert steps == 64 // 8 and report.steps == steps * calls
    full = sched.with_trips(trips)  # every slot visited in every call
    once = grid_steps.once_per_batch(full, copies)
    # the zeroing (and, with several accumulators, the adding up) writes every row of each: at least
    # one vector store a bundle for its rows x 128 lanes of float32, 8 rows a vector
    assert len(once) >= copies * rows // 8 // 4
    once_bundles = full.executed() - full.executed(once)
    fill = grid_steps.fill_and_drain(sched)
    if windows == 1:
        assert report.cycles == steps * full.executed(once) + once_bundles + fill
    else:  # each slot visited once over the calls: a trip more at most per query and window
        none, one = sched.with_trips(0), sched.with_trips(1)
        per_trip = (one.executed(once) - none.executed(once)) / 8
        fixed = calls * (steps * none.executed(once) + once_bundles + fill)
        least = fixed + per_trip * 64 * trips
        assert least <= report.cycles <= least + per_trip * 64 * calls < calls * (steps * full.executed(once))
    # the resident blocks (k's window, dk) move once per call, every other DMA on every step
    _, resident_bytes = full.step_dmas(sizes=lambda n: n == rows * 128 * 4)
    assert report.call_bytes == calls * (steps * report.step_dma_bytes + resident_bytes)
