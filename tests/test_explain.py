"""The VMEM budget at spec time, vmem_limit_bytes in generated code, and `codegen explain`."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest

from codegen import cli, cost, load, pipeline, plan
from codegen.errors import SpecError
from codegen.spec import Tiling
from generated.csa_v4 import VARIANTS
from tests.spec_cases import SPEC_PATH, edited, family

pytestmark = pytest.mark.version_free  # the spec models and the cost model: no JAX version changes them

PRODUCTION = "tpu_hm_bf16_q256_w2048c512f256_hc16"
SHAPE = "1,64,8192,128,2048"


def _check(text: str):
    spec = load.parse(text, "spec.yaml")
    return list(pipeline.build(spec, "spec.yaml").warnings)


def test_an_over_budget_variant_is_rejected_with_the_numbers():
    def edit(data):
        data["tilings"]["huge"] = {"block_q": 1024, "block_w": 8192}
        data["variants"]["include"].append(
            dict(
                backend="tpu",
                q_layout="head_major",
                dtype="f32",
                tiling="huge",
                head_chunk=0,
                backward="fused",
            )
        )

    with pytest.raises(SpecError) as info:
        _check(edited(edit))
    message = str(info.value)
    assert "tilings.huge = 'block_q=1024, block_w=8192'" in message
    assert "variant tpu_hm_f32_q1024_w8192_hcall: its forward kernel needs" in message
    assert "MiB of VMEM" in message and "v5p 64 MiB" in message and "7x 64 MiB" in message


def test_targets_decide_the_budget():
    """The same tiling fits when the spec only targets chips with room for it."""

    def edit(data, targets):
        data["targets"] = targets
        data["tilings"]["big"] = {"block_q": 256, "block_w": 2048}
        data["variants"]["include"].append(
            dict(
                backend="tpu",
                q_layout="head_major",
                dtype="bf16",
                tiling="big",
                head_chunk=16,
                backward="fused",
            )
        )

    big = plan.build(
        dataclasses.replace(family().plan(PRODUCTION).variant, tiles=Tiling(block_q=256, block_w=2048))
    )
    footprint = cost.vmem_footprints(big, num_heads=64, head_dim=128)
    assert 64 * 2**20 < max(footprint.values()) * 1.25 < 128 * 2**20
    with pytest.raises(SpecError, match="more than v5p 64 MiB, 7x 64 MiB"):
        _check(edited(lambda d: edit(d, ["v5e", "v5p", "v6e", "7x"])))
    assert _check(edited(lambda d: edit(d, ["v5e", "v6e"]))) == []


def test_a_legal_but_non_native_block_warns(capsys, tmp_path):
    spec = tmp_path / "specs" / "x.yaml"
    spec.parent.mkdir()
    spec.write_text(edited(lambda d: d["tilings"]["small"].update(block_q=8)))
    assert cli.main(["render", str(spec)]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "tilings.small.block_q = 8" in err and "not a multiple of 16" in err


def test_kernels_over_the_default_scope_ask_for_more_vmem():
    """Every kernel holds a head group's float32 logits (the gradients [16 * 128, 1024], the forward
    [16, 256, 512] at the production tiling): more than v5e's 16 MiB default, so they ask for their
    footprint with headroom. (The compiler's own need, read on a v5e: the all-heads forward at 256 x
    2048 / 256 took 19.6 MiB, over the default the budget had left it.) The small tiling asks nothing."""
    for name in ("tpu_hm_f32_q128_w1024c512_hcall", PRODUCTION):
        limits = VARIANTS[name].CONFIG.vmem_limit_bytes
        for kernel in ("forward", "dq_dweights"):
            need = cost.vmem_footprints(family().plan(name), 64, 128)[kernel]
            assert need > 16 * 2**20 and limits[kernel] >= need and limits[kernel] % 2**20 == 0, (
                name,
                kernel,
            )
    assert set(VARIANTS["tpu_sm_bf16_q16_w128_hcall"].CONFIG.vmem_limit_bytes.values()) == {None}


def test_explain_the_production_variant(capsys):
    assert cli.main(["explain", str(SPEC_PATH), PRODUCTION, "--shape", SHAPE, "--chip", "v6e"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith(PRODUCTION)}
    # one w tile covers W = 2048: the gradient is one kernel, dq_dk
    assert set(lines) == {"forward", "dq_dk"}
    # forward: grid (B, q blocks, w blocks) = 1 x 32 x 1, every head in a step (a chunk per matmul);
    # 2 * 64 * 8192 * 2048 * 128 = 2**38 MXU FLOPs (274.9 GFLOP), 3 elementwise operations per entry
    # (3 * 2**30) and the mask's 6 per (query, block) (6 * 2**24): 3.3 Gop. The gradient's grid has
    # the chunk axis: 1 x 1 x 32 x 4 (dq_dk).
    grids = {kernel: line.split()[2] for kernel, line in lines.items()}
    assert grids == {"forward": "1x32x1", "dq_dk": "1x1x32x4"}
    assert "  274.9  " in lines["forward"] and "  3.3  " in lines["forward"]
    assert "k [2048, 128]" in out and "q [16, 256, 128]" in out and "q_all_heads [64, 256, 128]" in out
    # W = 4096 takes two w tiles: dq_dweights (1 x 32 x 4 x 2) and dk (1 x 2 x 32 x 4)
    assert cli.main(["explain", str(SPEC_PATH), PRODUCTION, "--shape", "1,64,8192,128,4096"]) == 0
    wide = {line.split()[1]: line.split()[2] for line in capsys.readouterr().out.splitlines()
            if line.startswith(PRODUCTION)}  # fmt: skip
    assert wide == {"forward": "1x32x2", "dq_dweights": "1x32x4x2", "dk": "1x2x32x4"}


def test_explain_json_and_causal(capsys):
    args = ["explain", str(SPEC_PATH), PRODUCTION, "--shape", SHAPE, "--json"]
    assert cli.main(args) == 0
    full = {row["kernel"]: row for row in json.loads(capsys.readouterr().out)}
    assert cli.main(args + ["--causal"]) == 0
    causal = {row["kernel"]: row for row in json.loads(capsys.readouterr().out)}
    # Causal at S = 8192, W = 2048 with 256 x 2048 DMA tiles, computed in 512-wide blocks by the forward
    # and 256-wide ones by the backward: q block i (positions 256i .. 256i + 255) sees blocks
    # [0, 64i + 64) at most and [0, 64i) in every query, so a compute block c of width n has work while
    # nc < 64i + 64 and is full while n(c + 1) <= 64i: over i < 32, at 512 80 of the 128 blocks have
    # work, 48 full, 32 partial, 48 empty; at 256 144 of 256 (0.5625), 112 full, 32 partial, 112 empty.
    # The one tile of each q block has work (block 0): 32 of 32; so has every q block, and the one w
    # tile. The forward's pieces cover q block i's visible blocks to whole lane groups:
    # 128 ceil((i + 1) / 2) of its 2048 columns, 34,816 of 65,536 (272 of 512 lane groups).
    tiles = {"tiles_with_work": 32, "tiles": 32, "q_blocks": 32, "q_blocks_with_work": 32, "w_tiles": 1,
             "w_tiles_with_work": 1, "visible_columns": 34816, "columns": 65536}  # fmt: skip
    blocks = {
        "forward": {"empty": 48, "full": 48, "partial": 32, **tiles},
        "dq_dk": {"empty": 112, "full": 112, "partial": 32, **tiles},
    }
    share = {"forward": (272, 512), "dq_dk": (144, 256)}  # of the unmasked work
    # dq_dk finishes dq/dweights once per q block and head chunk, mask or not: on B*S*H*D entries, the
    # one-hot broadcast of a chunk's 16 heads' weights (2 * 16 MXU FLOPs each) and 4 elementwise operations.
    entries = 8192 * 64 * 128
    finish = {"forward": (0, 0), "dq_dk": (32 * entries, 4 * entries)}
    assert set(full) == set(causal) == set(finish)
    for kernel in finish:
        mxu, vpu = finish[kernel]
        assert causal[kernel]["compute_blocks"] == blocks[kernel]
        done, of = share[kernel]
        assert causal[kernel]["mxu_flops"] - mxu == (full[kernel]["mxu_flops"] - mxu) * done // of
        if not mxu:
            assert causal[kernel]["mxu_vs_unmasked"] == done / of
        # The elementwise work, the mask's included (every block with work is masked), goes with the
        # MXU work.
        assert causal[kernel]["vpu_ops"] - vpu == (full[kernel]["vpu_ops"] - vpu) * done // of
    assert causal["dq_dk"]["hbm_bytes"] == full["dq_dk"]["hbm_bytes"]  # every tile has work: no DMA skipped
    # At W = 4096 no query sees the second 2048-wide tile: causal skipping issues none of its DMAs.
    wide = ["explain", str(SPEC_PATH), PRODUCTION, "--shape", "1,64,8192,128,4096", "--json"]
    assert cli.main(wide) == 0
    wide_full = {row["kernel"]: row for row in json.loads(capsys.readouterr().out)}
    assert cli.main(wide + ["--causal"]) == 0
    wide_causal = {row["kernel"]: row for row in json.loads(capsys.readouterr().out)}
    assert (
        wide_causal["dk"]["compute_blocks"]["tiles_with_work"] < wide_causal["dk"]["compute_blocks"]["tiles"]
    )
    assert wide_causal["dk"]["hbm_bytes"] < wide_full["dk"]["hbm_bytes"]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--shape", "1,64,8192"], "expected five positive integers"),
        (["--shape", SHAPE, "--chip", "v9"], "unknown chip"),
    ],
)
def test_explain_bad_arguments(args, fragment, capsys):
    with pytest.raises(SystemExit) if "--chip" not in args else contextlib.nullcontext():
        code = cli.main(["explain", str(SPEC_PATH), PRODUCTION, *args])
        assert code == 2
    assert fragment in capsys.readouterr().err
