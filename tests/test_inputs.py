"""Bad calls raise a ValueError naming the argument, before anything is traced."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from generated.csa_v4 import VARIANTS
from tests import support

B, H, S, D, W = 2, 32, 24, 64, 130


def _inputs(variant):
    return support.make_inputs(variant, (B, H, S, D, W), seed=3)


def _case(variant, case):
    q, k, weights = _inputs(variant)
    other = jnp.float32 if variant["q_dtype"] != "float32" else jnp.bfloat16
    hm = variant["q_layout"] == "head_major"
    cases = {
        "q_rank": (dict(q=q[0]), r"^q must have rank 4"),
        "k_rank": (dict(k=k[None]), r"^k must have rank 3"),
        "weights_rank": (dict(weights=weights[..., 0]), r"^weights must have rank 3"),
        "q_dtype": (dict(q=q.astype(other)), r"^q must be " + variant["q_dtype"]),
        "k_dtype": (dict(k=k.astype(other)), r"^k must be " + variant["k_dtype"]),
        "weights_dtype": (
            dict(weights=weights.astype(jnp.float16)),
            r"^weights must be " + variant["weights_dtype"],
        ),
        "k_batch": (dict(k=k[:1]), r"^k must be \[B=2"),
        "k_head_dim": (dict(k=k[..., :32]), r"^k must be \[B=2, W>=1, D=64\]"),
        "no_blocks": (dict(k=k[:, :0]), r"^k must be \[B=2, W>=1"),
        "weights_heads": (dict(weights=weights[..., :16]), r"^weights must be \[B=2, S=24, H=32\]"),
        "weights_seq": (dict(weights=weights[:, :5]), r"^weights must be \[B=2, S=24, H=32\]"),
        "no_queries": (
            dict(q=q[:, :, :0] if hm else q[:, :0], weights=weights[:, :0]),
            r"^q must have at least",
        ),
        "scale_negative": (dict(softmax_scale=-1.0), r"^softmax_scale must be positive"),
        "scale_not_a_number": (dict(softmax_scale="big"), r"^softmax_scale must be a positive Python float"),
        "not_an_array": (dict(q=[[1.0]]), r"^q must be an array"),
    }
    return (q, k, weights), cases[case]


CASES = [
    "q_rank", "k_rank", "weights_rank", "q_dtype", "k_dtype", "weights_dtype", "k_batch", "k_head_dim",
    "no_blocks", "weights_heads", "weights_seq", "no_queries", "scale_negative", "scale_not_a_number", "not_an_array",
]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_bad_call_raises_value_error_naming_the_argument(layout_module, case):
    module = layout_module
    (q, k, weights), (override, pattern) = _case(module.VARIANT, case)
    args = dict(q=q, k=k, weights=weights)
    kwargs = {key: override.pop(key) for key in list(override) if key == "softmax_scale"}
    args.update(override)
    with pytest.raises(ValueError, match=pattern):
        support.call(module, args["q"], args["k"], args["weights"], interpret=True, **kwargs)


@pytest.mark.parametrize("name", sorted(n for n, m in VARIANTS.items() if m.VARIANT["head_chunk"]))
def test_head_count_the_chunk_does_not_divide(name):
    module = VARIANTS[name]
    q, k, weights = support.make_inputs(module.VARIANT, (1, 24, 8, 64, 130), seed=0)
    with pytest.raises(ValueError, match=r"^q has 24 heads, which head_chunk 16 .* does not divide"):
        support.call(module, q, k, weights, interpret=True)


@pytest.mark.parametrize("name", ["tpu_hm_bf16_q16_w128_hc16", "tpu_sm_bf16_q16_w128_hc16"])
def test_q_in_the_other_layout_is_named_as_such(name):
    module = VARIANTS[name]
    q, k, weights = _inputs(module.VARIANT)
    hm = module.VARIANT["q_layout"] == "head_major"
    with pytest.raises(
        ValueError, match=r"looks (seq|head)_major, but variant .* is (head|seq)_major"
    ) as info:
        support.call(module, jnp.swapaxes(q, 1, 2), k, weights, interpret=True)
    assert ("[B, H, S, D]" if hm else "[B, S, H, D]") in str(info.value)


def test_an_unknown_variant_name_suggests_close_ones():
    # a production name from before the fused backward's width was in names leads to today's first
    with pytest.raises(KeyError, match="did you mean tpu_sm_bf16_q256_w2048c512f256_hc16"):
        VARIANTS["tpu_sm_bf16_q256_w2048c512_hc16"]
    assert "tpu_sm_bf16_q256_w2048c512f256_hc16" in VARIANTS and VARIANTS.get("nope") is None
