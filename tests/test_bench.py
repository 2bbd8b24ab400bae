"""``codegen bench`` off the chip: its peers' numerics, its report of a saved run, and the one line it
says without a TPU. The timings themselves are the chip's (README, "Speed on a TPU v5e")."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from codegen import bench, cli, load, peers, pipeline, reference
from codegen.errors import SpecError
from tests import support
from tests.spec_cases import ROOT


def test_stacked_forward_and_xla_peers_compute_the_score():
    """The baseline and the XLA peers compute what the kernels do, so their times are comparable."""
    batch, heads, seq_len, head_dim, num_blocks = 1, 32, 256, 128, 2048
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq_len, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, num_blocks, head_dim), jnp.bfloat16)
    weights = jax.random.normal(keys[2], (batch, seq_len, heads), jnp.bfloat16)
    expected = reference.score(q, k, weights, q_layout="seq_major")
    support.assert_close("stacked_forward", peers.stacked_forward(q, k, weights, interpret=True), expected)
    support.assert_close("xla_score", peers.xla_score(q, k, weights), expected)
    indices = jax.random.randint(keys[3], (batch, seq_len, 16), -1, num_blocks)
    picked = jnp.take_along_axis(expected, jnp.maximum(indices, 0), axis=2)
    support.assert_close(
        "xla_sparse_score",
        peers.xla_sparse_score(q, k, weights, indices),
        jnp.where(indices >= 0, picked, -jnp.inf),
    )
    with pytest.raises(ValueError, match="must be multiples of 128, 1024"):
        peers.stacked_forward(q[:, :100], k, weights[:, :100], interpret=True)


def _saved():
    result = lambda case, subject, ms, **kw: {
        "shape": [1, 64, 8192, 128, 2048, 512], "case": case, "subject": subject, "ms": ms, "tflops": None,
        "ratio": None, "note": "", "seconds": 1.0, **kw,
    }  # fmt: skip
    return {
        "chip": "TPU v5 lite", "jax": "0.10.2", "date": "2026-12-06", "command": "codegen bench", "calls": 10,
        "results": [
            {**result("matmul", "bf16 matmul (calibration)", 6.11, tflops=180.0), "shape": [0] * 6},
            result("stacked", "stacked-heads forward, every block", 1.94, tflops=142.0, ratio=1.0),
            result("score.causal", "tpu_sm_bf16_q512_w2048c512_hc16", 1.79, tflops=77.4, ratio=0.92),
            result("topk", "tpu_sm_bf16_q512_w2048c512_hc16 score_topk", 428.1, tflops=0.6, ratio=220.7),
            result("xla.grad", "XLA score, forward + gradient", None, note="does not fit"),
        ],
    }  # fmt: skip


def test_report_of_a_saved_run():
    text = bench.report(_saved())
    assert text.startswith("Measured on one TPU v5 lite, JAX 0.10.2, 2026-12-06: `codegen bench`")
    assert "B 1, H 64, D 128; S 8192, W 2048, top_k 512:" in text
    assert "| case | what | ms, S 8192 | x stacked | TF/s |" in text
    assert "| stacked | stacked-heads forward, every block | 1.94 | 1.00 | 142 |" in text
    assert "| score.causal | tpu_sm_bf16_q512_w2048c512_hc16 | 1.79 | 0.92 | 77 |" in text
    assert "| topk | tpu_sm_bf16_q512_w2048c512_hc16 score_topk | 428.10 | 220.70 | 0.6 |" in text
    assert "| xla.grad | XLA score, forward + gradient | does not fit |  |  |" in text
    assert text.rstrip().endswith("Calibration: bf16 matmul (calibration), 8192^3: 6.11 ms, 180 TF/s.")


def test_ranking_puts_the_fastest_forward_and_gradient_first():
    """``--rank``'s table: candidates by their causal forward + gradient, a ratio to the best, one that
    has no time (it did not fit) last, with dashes."""
    saved = _saved()
    tilings = {"a": "256 x 2048 / 512", "b": "512 x 2048 / 256", "c": "256 x 2048 / 256"}
    timed = {
        ("a", "grad.causal"): 7.0,
        ("a", "score.causal"): 1.4,
        ("b", "grad.causal"): 6.3,
        ("b", "score.causal"): 1.3,
    }
    row = lambda name, case, ms: {**saved["results"][1], "case": case, "subject": name, "ms": ms}
    saved["results"] = [row(n, c, ms) for (n, c), ms in timed.items()] + [row("c", "grad.causal", None)]
    lines = bench.ranking(saved, "a", tilings).splitlines()
    assert lines[0].startswith("a's tilings ranked on the chip by grad.causal")
    assert lines[4:] == [
        "| 1 | b | 512 x 2048 / 256 | 1.300 | 6.300 | 1.00 |",
        "| 2 | a | 256 x 2048 / 512 | 1.400 | 7.000 | 1.11 |",
        "| 3 | c | 256 x 2048 / 256 | - | - | - |",
    ]
    # a case --cases added (a band mask) gets its column, in the order of the cases, before the ranking one
    saved["results"].append(row("a", "score.band8", 0.6))
    lines = bench.ranking(saved, "a", tilings).splitlines()
    assert (
        lines[2]
        == "| rank | variant | block_q x block_w / compute_w | score.causal | score.band8 | grad.causal | x best |"
    )
    assert lines[4:6] == [
        "| 1 | b | 512 x 2048 / 256 | 1.300 | - | 6.300 | 1.00 |",
        "| 2 | a | 256 x 2048 / 512 | 1.400 | 0.600 | 7.000 | 1.11 |",
    ]


def test_report_command_reads_a_saved_run(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_saved()))
    assert cli.main(["bench", "--report", str(path)]) == 0
    assert capsys.readouterr().out == bench.report(_saved())
    assert cli.main(["bench", "--report", str(tmp_path / "missing.json")]) == 2


def test_without_a_tpu_it_says_so_in_one_line(capsys):
    """The suite runs on the CPU: the command says so, once, and exits 2, before any work."""
    assert cli.main(["bench"]) == 2
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "codegen bench: no TPU here (JAX's default backend is cpu); it measures on a TPU only"
    ]


def test_unknown_cases_are_named(capsys):
    assert cli.main(["bench", "--cases", "score.causal,scores"]) == 2
    assert "unknown cases ['scores']" in capsys.readouterr().err


def test_the_recorded_command_leaves_out_where_the_figures_went():
    assert cli._without_outputs(["--json", "out.json", "--cases", "topk"]) == ["--cases", "topk"]
    assert cli._without_outputs(["--json=out.json", "--calls", "20"]) == ["--calls", "20"]


def test_production_names_emitted_variants_one_per_layout():
    text = (ROOT / "specs" / "csa_v4.yaml").read_text()
    line = next(l for l in text.splitlines() if l.startswith("production:"))
    cases = {
        "[tpu_sm_nope]": "production[0] = 'tpu_sm_nope': must name a variant the spec emits",
        "[tpu_sm_bf16_q16_w128_hc16, tpu_sm_bf16_q16_w128_hc16]": "production[1] = 'tpu_sm_bf16_q16_w128_hc16': "
        "names a variant already listed",
        "[tpu_sm_bf16_q16_w128_hc16, tpu_sm_f32_q16_w128_hc16]": "production[1] = 'tpu_sm_f32_q16_w128_hc16': a "
        "second seq_major variant (first: tpu_sm_bf16_q16_w128_hc16)",
    }
    for value, message in cases.items():
        with pytest.raises(SpecError) as err:
            pipeline.build(load.parse(text.replace(line, f"production: {value}"), "spec.yaml"), "spec.yaml")
        assert str(err.value) == f"spec.yaml: {message}"
    from generated.csa_v4 import PRODUCTION, VARIANTS

    assert PRODUCTION and all(name in VARIANTS for name in PRODUCTION)
    assert len({VARIANTS[name].VARIANT["q_layout"] for name in PRODUCTION}) == len(PRODUCTION)


def test_shared_selection_takes_each_querys_last_blocks_and_others_from_its_range():
    """The sparse stage's shared selection: a query seeing at most top_k blocks gets them all, then -1;
    one seeing more its last top_k - 16 and 16 distinct others from the rest of its range; the same
    draw for the same seed."""
    start = np.array([[0, 0, 5, 0]])
    end = np.array([[0, 20, 30, 100]])
    out = bench.shared_selection(start, end, 24)
    assert out.dtype == np.int32 and out.shape == (1, 4, 24)
    assert (out[0, 0] == -1).all()
    assert list(out[0, 1]) == list(range(20)) + [-1] * 4
    # 25 visible: the last 8, then 16 of the 17 before them
    assert list(out[0, 2, :8]) == list(range(22, 30)) and len(set(out[0, 2, 8:]) & set(range(5, 22))) == 16
    last, others = out[0, 3, :8], out[0, 3, 8:]
    assert list(last) == list(range(92, 100))
    assert len(set(others)) == 16 and others.min() >= 0 and others.max() < 92
    np.testing.assert_array_equal(bench.shared_selection(start, end, 24), out)
