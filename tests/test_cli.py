"""The ``codegen`` command: determinism, --check on stale trees, list, diff, help and exit codes."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from codegen import cli
from tests.spec_cases import ROOT, SPEC_PATH, edited


@pytest.fixture
def project(tmp_path) -> pathlib.Path:
    """A copy of the project's specs/ and generated/ trees, safe to corrupt."""
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    shutil.copytree(ROOT / "generated", tmp_path / "generated", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _snapshot(root: pathlib.Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.mark.version_free
def test_render_is_deterministic(tmp_path):
    outputs = []
    for run in ("one", "two"):
        out = tmp_path / run / "generated"
        assert cli.main(["render", str(SPEC_PATH), "--out", str(out)]) == 0
        outputs.append(_snapshot(out))
    assert outputs[0] == outputs[1]
    assert "csa_v4/__init__.py" in outputs[0]


@pytest.mark.version_free
def test_render_matches_committed_bytes(project):
    before = _snapshot(project / "generated")
    shutil.rmtree(project / "generated" / "csa_v4")
    assert cli.main(["render", str(project / "specs" / "csa_v4.yaml")]) == 0
    assert _snapshot(project / "generated") == before


@pytest.mark.version_free
def test_check_catches_a_hand_edit_and_writes_nothing(project, capsys):
    target = next((project / "generated" / "csa_v4").glob("tpu_hm_*.py"))
    target.write_text(target.read_text().replace("BLOCK_Q = ", "BLOCK_Q = 2 * "))
    before = _snapshot(project / "generated")
    assert cli.main(["render", "--check", str(project / "specs" / "csa_v4.yaml")]) == 1
    captured = capsys.readouterr()
    assert f"a/csa_v4/{target.name}" in captured.out and "-BLOCK_Q = 2 * " in captured.out
    assert "fix with: codegen render" in captured.err
    assert _snapshot(project / "generated") == before


@pytest.mark.version_free
def test_stale_files_are_reported_then_removed(project, capsys):
    stale = project / "generated" / "csa_v4" / "tpu_hm_f32_q64_w512_hcall.py"
    stale.write_text("# an old variant\n")
    spec = str(project / "specs" / "csa_v4.yaml")
    assert cli.main(["render", "--check", spec]) == 1
    assert "a/csa_v4/tpu_hm_f32_q64_w512_hcall.py" in capsys.readouterr().out
    assert cli.main(["render", spec]) == 0
    assert not stale.exists()
    assert cli.main(["render", "--check", spec]) == 0


@pytest.mark.version_free
def test_a_bad_spec_writes_nothing(project, capsys):
    spec = project / "specs" / "csa_v4.yaml"
    spec.write_text(edited(lambda d: d["tilings"]["small"].update(block_w=100)))
    before = _snapshot(project / "generated")
    assert cli.main(["render", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "nothing was written" in err and "tilings.small.block_w = 100" in err
    assert _snapshot(project / "generated") == before


def test_a_missing_spec_file_is_a_clean_error(tmp_path, capsys):
    assert cli.main(["render", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_list_shows_every_variant_with_parameters(capsys):
    from generated.csa_v4 import VARIANTS

    assert cli.main(["list", str(SPEC_PATH)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "name", "backend", "q_layout", "q_dtype", "weights_dtype", "out_dtype",
        "block_q", "block_w", "head_chunk", "backward",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == set(VARIANTS)
    for name, module in VARIANTS.items():
        assert rows[name][6:8] == [str(module.VARIANT["block_q"]), str(module.VARIANT["block_w"])]


def test_diff_of_two_variants_is_a_reviewable_unified_diff(capsys):
    a, b = "tpu_hm_f32_q256_w2048c512_hc16", "tpu_hm_f32_q128_w1024c512_hcall"
    assert cli.main(["diff", str(SPEC_PATH), a, b]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"--- {a}.py\n+++ {b}.py\n")
    assert "-HEAD_CHUNK = 16" in out and "+HEAD_CHUNK = None" in out
    assert cli.main(["diff", str(SPEC_PATH), a, a]) == 0
    assert capsys.readouterr().out == ""


def test_diff_of_two_tilings_is_constants_only(capsys):
    """A tiling is constants: the two tilings of one variant differ in its name, block sizes and VMEM limits only."""
    a, b = "tpu_hm_bf16_q256_w2048c512f256_hc16", "tpu_hm_bf16_q16_w128_hc16"
    assert cli.main(["diff", str(SPEC_PATH), a, b]) == 1
    changed = [line for line in capsys.readouterr().out.splitlines()[2:] if line[:1] in "+-"]
    constants = re.compile(
        r'^[+-](BLOCK_[QW] = \d+|(FUSED_)?COMPUTE_W = \d+  #[^\n]*|    "(name|block_q|block_w|(fused_)?compute_w)": [^\n]+,'
        r'|    vmem_limit_bytes=[^\n]+,|"""[^\n]*variant ``\w+``\.)$'
    )
    assert changed and all(constants.match(line) for line in changed), changed


def test_diff_between_fused_and_reference_backward_touches_only_the_backward(capsys):
    fused, reference = "tpu_sm_bf16_q256_w2048c512f256_hc16", "tpu_sm_bf16_q256_w2048c512f256_hc16_refbwd"
    assert cli.main(["diff", str(SPEC_PATH), fused, reference]) == 1
    changed = [
        line for line in capsys.readouterr().out.splitlines()[2:] if line[:1] in "+-" and line[1:].strip()
    ]
    # The two bind the same forward kernels to different backwards, and the reference one's sparse
    # backward gathers float32 rows: a module of its own.
    assert "-    functools.partial(_dense.backward, CONFIG)," in changed
    assert "+    functools.partial(_autodiff.reference_backward, CONFIG)," in changed
    assert "+from . import _sparse_bf16_refbwd as _sparse" in changed
    assert not [line for line in changed if "_dense.forward" in line or "BLOCK_" in line or "_dense_" in line]


def test_diff_of_an_unknown_variant_suggests_names(capsys):
    assert (
        cli.main(
            [
                "diff",
                str(SPEC_PATH),
                "tpu_hm_f32_q256_w2048c512_hc16",
                "tpu_hm_f32_q256_w2048c512_hc8",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "no variant named 'tpu_hm_f32_q256_w2048c512_hc8'" in err and "did you mean" in err


@pytest.mark.parametrize("command", [[], ["render"], ["list"], ["diff"], ["explain"]])
def test_help_on_every_command(command):
    result = subprocess.run(
        [sys.executable, "-m", "codegen.cli", *command, "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0
    assert result.stdout.startswith("usage: codegen")


def test_usage_errors_exit_2():
    result = subprocess.run(
        [sys.executable, "-m", "codegen.cli", "render"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 2 and "SPEC" in result.stderr
