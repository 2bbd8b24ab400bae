"""Spec validation: each rule, and each message names the field path, the value and the rule."""

from __future__ import annotations

import pytest

from codegen import load, pipeline, variants
from codegen.errors import SpecError
from tests.spec_cases import edited, shipped

pytestmark = pytest.mark.version_free  # the spec models and the cost model: no JAX version changes them


def _problems(text: str) -> str:
    with pytest.raises(SpecError) as info:
        pipeline.build(load.parse(text, "spec.yaml"), "spec.yaml")
    return str(info.value)


def _set(path: str, value):
    def edit(data):
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[leaf] = value

    return edit


def _drop(path: str):
    def edit(data):
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        del node[leaf]

    return edit


CASES = {
    # name: (edit, expected fragments of the message: path, value, rule)
    "targets_without_a_chip_of_the_backend": (
        _set("targets", ["h100"]),
        ["targets = ['h100']", "holds no tpu chip", "add one of ['7x', 'v5e', 'v5p', 'v6e']"],
    ),
    "unknown_top_level_key": (_set("tiling_default", 3), ["tiling_default = 3", "unknown key"]),
    "unknown_nested_key": (_set("tilings.prod.blockq", 128), ["tilings.prod.blockq = 128", "unknown key"]),
    "missing_field": (_drop("tilings.prod.block_w"), ["tilings.prod.block_w", "required field is missing"]),
    "block_w_not_lane_multiple": (
        _set("tilings.small.block_w", 100),
        ["tilings.small.block_w = 100", "multiple of 128 on TPU"],
    ),
    "compute_w_not_dividing_block_w": (
        _set("tilings.prod.compute_w", 384),
        ["tilings.prod.compute_w = 384", "must divide block_w = 2048"],
    ),
    "compute_w_not_lane_multiple": (
        _set("tilings.prod.compute_w", 64),
        ["tilings.prod.compute_w = 64", "multiple of 128 on TPU"],
    ),
    "fused_compute_w_not_dividing_block_w": (
        _set("tilings.prod.fused_compute_w", 384),
        ["tilings.prod.fused_compute_w = 384", "must divide block_w = 2048"],
    ),
    "fused_compute_w_not_lane_multiple": (
        _set("tilings.prod.fused_compute_w", 64),
        ["tilings.prod.fused_compute_w = 64", "multiple of 128 on TPU"],
    ),
    "block_q_not_sublane_multiple": (
        _set("tilings.prod.block_q", 100),
        ["tilings.prod.block_q = 100", "multiple of 8 on TPU"],
    ),
    "nonpositive_block": (
        _set("tilings.prod.block_q", 0),
        ["tilings.prod.block_q = 0", "greater than or equal to 1"],
    ),
    "head_chunk_not_dividing_heads": (
        _set("variants.matrix.head_chunk", [0, 24]),
        ["variants.matrix.head_chunk = 24", "must divide model.num_heads = 64"],
    ),
    "negative_head_chunk": (
        _set("variants.matrix.head_chunk", [-1]),
        ["variants.matrix.head_chunk[0] = -1", "greater than or equal to 0"],
    ),
    "seq_major_chunk_not_row_tiled": (
        _set("variants.matrix.head_chunk", [0, 4]),
        ["variants.matrix.head_chunk = 4", "seq_major", "float32 q", "multiple of 8 on TPU"],
    ),
    "seq_major_fp8_chunk_below_its_row_tile": (
        lambda d: d["variants"]["include"][1].update(head_chunk=16),
        ["variants.include[1].head_chunk = 16", "float8_e4m3fn q", "multiple of 32 on TPU"],
    ),
    "unknown_dtype_policy": (
        _set("variants.matrix.dtype", ["f32", "fp16"]),
        ["variants.matrix.dtype = 'fp16'", "no such dtype policy", "'bf16'"],
    ),
    "unknown_tiling_in_include": (
        lambda d: d["variants"]["include"][0].update(tiling="huge"),
        ["variants.include[0].tiling = 'huge'", "no such tiling"],
    ),
    "unsupported_storage_dtype": (
        _set("dtype_policies.f32.qk", "float16"),
        ["dtype_policies.f32.qk = 'float16'", "'float32', 'bfloat16' or 'float8_e4m3fn'"],
    ),
    "bf16_accumulation": (
        _set("dtype_policies.bf16.accum", "bfloat16"),
        ["dtype_policies.bf16", "accum = 'bfloat16' is not supported", "accum: float32"],
    ),
    "fp8_without_key_scale": (
        _set("dtype_policies.fp8.k_scale", False),
        ["dtype_policies.fp8", "needs a per-token key scale", "k_scale: true"],
    ),
    "key_scale_on_bf16": (
        _set("dtype_policies.bf16.k_scale", True),
        ["dtype_policies.bf16", "k_scale applies to float8_e4m3fn keys only"],
    ),
    "one_pass_gradient_matmul_on_float32": (
        _set("dtype_policies.f32.grad_matmul", "bf16"),
        ["dtype_policies.f32", "grad_matmul = 'bf16' applies to bfloat16 and float8_e4m3fn q/k only"],
    ),
    "unknown_gradient_matmul": (
        _set("dtype_policies.bf16.grad_matmul", "fp8"),
        ["dtype_policies.bf16.grad_matmul = 'fp8'", "'split' or 'bf16'"],
    ),
    "fp8_without_float32_accumulation": (
        _set("dtype_policies.fp8.accum", "bfloat16"),
        ["dtype_policies.fp8", "float8_e4m3fn q/k need float32 accumulation"],
    ),
    "fp8_weights": (
        _set("dtype_policies.fp8.weights", "float8_e4m3fn"),
        ["dtype_policies.fp8.weights = 'float8_e4m3fn'", "'float32' or 'bfloat16'"],
    ),
    "fp8_reference_backward": (
        lambda d: d["variants"]["include"][1].update(backward="reference"),
        ["variants.include[1].backward = 'reference'", "does not take a key scale"],
    ),
    "unknown_matmul_precision": (
        _set("dtype_policies.f32.matmul_precision", "fastest"),
        ["dtype_policies.f32.matmul_precision = 'fastest'", "'default' or 'highest'"],
    ),
    "compress_rate_zero": (
        _set("computation.compress_rate", 0),
        ["computation.compress_rate = 0", "greater than or equal to 1"],
    ),
    "negative_scale": (
        _set("computation.softmax_scale", -0.5),
        ["computation.softmax_scale = -0.5", "greater than 0"],
    ),
    "nan_masked_value": (_set("computation.masked_value", float("nan")), ["computation.masked_value", "NaN"]),
    "unknown_activation": (
        _set("computation.activation", "gelu"),
        ["computation.activation = 'gelu'", "'relu'"],
    ),
    "bad_policy_name": (
        lambda d: d["dtype_policies"].update({"BF-16": d["dtype_policies"]["bf16"]}),
        ["dtype_policies.BF-16", "pattern"],
    ),
    "exclude_matches_nothing": (
        _set("variants.exclude", [{"dtype": "bf16f32"}]),
        ["variants.exclude[0]", "matches no variant"],
    ),
    "empty_exclude_entry": (_set("variants.exclude", [{}]), ["variants.exclude[0]", "at least one field"]),
    "include_duplicates_matrix": (
        lambda d: d["variants"]["include"].append(
            dict(
                backend="tpu",
                q_layout="head_major",
                dtype="f32",
                tiling="small",
                head_chunk=0,
                backward="fused",
            )
        ),
        [
            f"variants.include[{len(shipped()['variants']['include'])}] = 'tpu_hm_f32_q16_w128_hcall'",
            "duplicates a variant already emitted",
        ],
    ),
    "unknown_backend": (
        _set("variants.matrix.backend", ["tpu", "npu"]),
        ["variants.matrix.backend[1] = 'npu'"],
    ),
    "gpu_not_renderable_yet": (
        _set("variants.matrix.backend", ["tpu", "gpu"]),
        ["variants.matrix.backend = 'gpu'", "no templates for this backend"],
    ),
    "tuning_names_a_missing_tiling": (
        _set("tuning.tilings", ["prod", "huge"]),
        ["tuning.tilings[1] = 'huge'", "no such tiling; defined: ["],
    ),
    "tuning_without_head_chunks": (_set("tuning.head_chunk", []), ["tuning.head_chunk = []", "at least 1"]),
    "tuning_chip_names_a_missing_tiling": (
        _set("tuning.chip", ["prod", "huge"]),
        ["tuning.chip[1] = 'huge'", "no such tiling; defined: ["],
    ),
    "tuning_chip_over_eight": (_set("tuning.chip", ["prod"] * 9), ["tuning.chip", "at most 8"]),
    "empty_matrix_axis": (
        _set("variants.matrix.q_layout", []),
        ["variants.matrix.q_layout = []", "at least 1"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_spec_is_rejected_with_path_value_and_rule(case):
    edit, fragments = CASES[case]
    message = _problems(edited(edit))
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert message.startswith("spec.yaml: ")


def test_shipped_spec_is_valid_and_covers_the_required_axes():
    spec = load.parse(edited(lambda d: None), "spec.yaml")
    found = pipeline.build(spec, "spec.yaml").variants
    assert len(found) >= 8
    assert {v.q_layout for v in found} == {"head_major", "seq_major"}
    assert {v.policy.qk for v in found} >= {"float32", "bfloat16"}
    assert {bool(v.head_chunk) for v in found} == {True, False}
    assert (128, 1024) in {(v.block_q, v.block_w) for v in found}
    assert len({(v.block_q, v.block_w) for v in found}) >= 2
    assert all(v.backward == "fused" for v in found if v.origin == "variants.matrix")
    assert {v.backward for v in found} == {"fused", "reference"}


def test_names_are_stable_and_readable():
    spec = load.parse(edited(lambda d: None), "spec.yaml")
    names = [v.name for v in variants.expand(spec)]
    assert "tpu_hm_bf16_q256_w2048c512f256_hc16" in names
    assert "tpu_sm_f32_q16_w128_hcall" in names
    assert "tpu_sm_bf16_q256_w2048c512f256_hc16_refbwd" in names  # the flag appears only when it is on
    assert names == sorted(set(names))


def test_a_tiling_that_differs_only_in_compute_w_renders_under_its_own_name():
    def edit(data):
        data["tilings"]["one"] = {"block_q": 128, "block_w": 1024}
        data["tilings"]["four"] = {"block_q": 128, "block_w": 1024, "compute_w": 256}
        data["tilings"]["same"] = {"block_q": 128, "block_w": 1024, "compute_w": 1024}
        data["tilings"]["fused"] = {"block_q": 128, "block_w": 1024, "compute_w": 512, "fused_compute_w": 256}
        data["tilings"]["fusedsame"] = {
            "block_q": 128,
            "block_w": 1024,
            "compute_w": 256,
            "fused_compute_w": 256,
        }
        data["variants"]["matrix"]["tiling"] += ["one", "four", "fused"]

    found = {v.name: v for v in pipeline.build(load.parse(edited(edit), "spec.yaml")).variants}
    # one compute block per tile (the default, or compute_w == block_w) is what a name leaves out
    assert found["tpu_hm_bf16_q128_w1024_hc16"].compute_w == 1024
    assert found["tpu_hm_bf16_q128_w1024c256_hc16"].compute_w == 256
    assert found["tpu_hm_bf16_q128_w1024c256_hc16"].tiles.compute_w == 256
    assert found["tpu_hm_bf16_q256_w2048c512f256_hc16"].compute_w == 512  # production: four per tile
    # the fused backward's own width shows after it, unless it is compute_w's (the default)
    assert found["tpu_hm_bf16_q128_w1024c512f256_hc16"].fused_compute_w == 256
    assert found["tpu_hm_bf16_q128_w1024c256_hc16"].fused_compute_w == 256
    assert found["tpu_hm_bf16_q128_w1024_hc16"].fused_compute_w == 1024
    spec = load.parse(edited(edit), "spec.yaml")
    assert spec.tilings["same"].name_part() == spec.tilings["one"].name_part() == "q128_w1024"
    assert spec.tilings["fusedsame"].name_part() == spec.tilings["four"].name_part() == "q128_w1024c256"
    # rankings show the fused width beside the tiling's where it differs
    assert spec.tilings["fused"].shape_text() == "128 x 1024 / 512, dq_dk 256"
    assert spec.tilings["fusedsame"].shape_text() == spec.tilings["four"].shape_text() == "128 x 1024 / 256"


def test_grad_matmul_sets_the_gradient_passes():
    """split: a bfloat16 head and tail of the float32 factor (two MXU passes); bf16: one; float32 q/k:
    one, plain. A bfloat16 score's dq is one exact pass either way (its cotangent is exact)."""

    def edit(data):
        data["dtype_policies"]["bf16"]["grad_matmul"] = "bf16"

    shipped_plans = pipeline.build(load.parse(edited(lambda d: None), "spec.yaml"))
    one_pass = pipeline.build(load.parse(edited(edit), "spec.yaml"))
    name = "tpu_hm_bf16_q256_w2048c512f256_hcall"
    split, rounded = shipped_plans.plan(name), one_pass.plan(name)
    assert (split.grad_matmul, rounded.grad_matmul) == ("split", "bf16")
    assert split.exact_cotangent and rounded.exact_cotangent
    assert split.kernel("dk").work.mxu_passes == 3 and rounded.kernel("dk").work.mxu_passes == 2
    assert split.kernel("dq_dweights").work.mxu_passes == rounded.kernel("dq_dweights").work.mxu_passes == 2
    fp8 = shipped_plans.plan("tpu_sm_fp8_q256_w2048c512f256_hcall")  # a key scale: the cotangent is not exact
    assert not fp8.exact_cotangent and fp8.kernel("dq_dweights").work.mxu_passes == 3
    assert (split.cotangent_parts, rounded.cotangent_parts, fp8.cotangent_parts) == (1, 1, 2)
    assert shipped_plans.plan("tpu_hm_f32_q128_w1024c512_hcall").grad_matmul == "plain"


def test_two_variants_of_one_name_are_an_error_naming_both():
    def edit(data):
        data["tilings"]["prod2"] = dict(data["tilings"]["prod"])  # the same kernel under another name
        data["variants"]["matrix"]["tiling"].append("prod2")

    message = _problems(edited(edit))
    assert "variants.matrix = 'tpu_hm_bf16_q256_w2048c512f256_hc16'" in message
    assert "tiling prod and tiling prod2" in message


def test_exclude_then_include():
    def edit(data):
        data["variants"]["exclude"] = [{"tiling": "small"}]

    spec = load.parse(edited(edit), "spec.yaml")
    found = variants.expand(spec)
    assert all(v.tiling == "prod" for v in found if v.origin == "variants.matrix")
    assert [v.tiling for v in found if v.origin != "variants.matrix"].count("small") == 1  # an include
    assert len(found) == 8 + len(shipped()["variants"]["include"])  # the matrix's production half + includes


def test_all_problems_are_reported_at_once():
    def edit(data):
        data["tilings"]["small"]["block_w"] = 100
        data["tilings"]["prod"]["block_q"] = 12

    message = _problems(edited(edit))
    assert "tilings.small.block_w = 100" in message and "tilings.prod.block_q = 12" in message
    assert message.count("tilings.small.block_w") == 1  # once, though several variants use it


@pytest.mark.parametrize(
    "text, fragment",
    [("family: [unclosed", "not valid YAML"), ("- just\n- a list\n", "must be a mapping")],
)
def test_unparseable_spec(text, fragment):
    assert fragment in _problems(text)
