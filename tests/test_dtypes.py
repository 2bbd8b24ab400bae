"""Dtype policies: float8 keys with per-token scales, the quantisation helper, gradient dtypes."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from codegen import reference
from generated.csa_v4 import VARIANTS, quantize_fp8_per_token
from tests import support
from tests.spec_cases import family
from tests.tolerances import RTOL, rtol

FP8_NAMES = sorted(name for name, module in VARIANTS.items() if module.VARIANT["q_dtype"] == "float8_e4m3fn")


def test_the_family_has_an_fp8_variant_at_the_production_tiling():
    prod = family().spec.tilings["prod"]
    assert any(
        (VARIANTS[n].VARIANT["block_q"], VARIANTS[n].VARIANT["block_w"]) == (prod.block_q, prod.block_w)
        for n in FP8_NAMES
    )


def test_every_output_and_gradient_dtype_has_a_tolerance():
    for module in VARIANTS.values():
        variant = module.VARIANT
        for key in ("out_dtype", "qk_grad_dtype", "weights_dtype"):
            assert variant[key] in RTOL, f"{variant['name']}: no tolerance for {variant[key]}"


def test_quantize_fp8_per_token():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 50, 128), jnp.float32) * jnp.logspace(-3, 3, 50)[:, None]
    x = x.at[1, 7].set(0.0)  # an all-zero token
    x_fp8, scale = quantize_fp8_per_token(x)
    assert x_fp8.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32 and scale.shape == (3, 50)
    assert float(scale[1, 7]) == 1.0 and not np.asarray(x_fp8[1, 7], np.float32).any()
    values = np.asarray(x_fp8, np.float32)
    assert np.allclose(
        np.abs(values).max(-1)[np.asarray(scale) != 1.0], 448.0
    )  # each token's max maps to 448
    back = values * np.asarray(scale)[..., None]
    normal = np.abs(values) >= 2.0**-6  # e4m3 normal range: 3 mantissa bits, half-ulp 2**-4 relative
    assert np.all(np.abs(back - x)[normal] <= 2.0**-4 * np.abs(x)[normal] * (1 + 1e-6))
    assert np.all(
        np.abs(back - x)[~normal] <= 2.0**-10 * np.asarray(scale)[..., None].repeat(128, -1)[~normal]
    )


@pytest.mark.parametrize("e4m3b11", [True, False], ids=["e4m3b11-unpack", "astype"])
def test_float8_upcast_is_exact_on_every_code(monkeypatch, e4m3b11):
    # The kernels' float8 upcast: through e4m3b11fnuz's unpack (v5e, v5p, v6e, and interpret mode) or
    # a plain astype (7x): every one of the 256 codes exact, subnormals, +-448 and NaN included.
    from generated.csa_v4 import _fp8

    monkeypatch.setattr(_fp8, "unpacks_e4m3b11", lambda: e4m3b11)
    x = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), jnp.float8_e4m3fn)
    want = np.asarray(x, np.float32)
    assert np.isnan(want).sum() == 2 and np.abs(want[~np.isnan(want)]).max() == 448.0
    for dtype in (jnp.bfloat16, jnp.float32):
        got = _fp8.upcast(x, dtype)  # eager: the route is chosen as it is traced, and jit would cache it
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)  # NaN where NaN; -0 reads as 0


def test_float8_upcast_route_off_a_tpu_is_the_e4m3b11_unpack():
    from generated.csa_v4 import _fp8

    assert jax.default_backend() != "tpu" and _fp8.unpacks_e4m3b11()


def _quantised_problem(variant, shape, seed):
    """float32 q, k, weights and their float8 forms: k per token with k_scale, q per (token, head)
    with its scale folded into the weights (exact for relu: the scale is positive)."""
    batch, heads, seq_len, head_dim, num_blocks = shape
    kq, kk, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
    q32 = jax.random.normal(kq, support.q_shape(variant, batch, heads, seq_len, head_dim), jnp.float32)
    k32 = jax.random.normal(kk, (batch, num_blocks, head_dim), jnp.float32)
    w32 = jax.random.normal(kw, (batch, seq_len, heads), jnp.float32)
    q8, q_scale = quantize_fp8_per_token(q32)  # [B, H, S] or [B, S, H]
    k8, k_scale = quantize_fp8_per_token(k32)
    q_scale = q_scale if variant["q_layout"] == "seq_major" else jnp.swapaxes(q_scale, 1, 2)
    weights = (w32 * q_scale).astype(variant["weights_dtype"])
    return (q32, k32, w32), (q8, k8, weights, k_scale)


@pytest.mark.chip
@pytest.mark.parametrize("name", FP8_NAMES)
def test_fp8_against_dequantised_and_unquantised_inputs(name):
    module = VARIANTS[name]
    variant = module.VARIANT
    (q32, k32, w32), (q8, k8, weights, k_scale) = _quantised_problem(variant, (2, 32, 40, 128, 300), seed=31)
    out = module.score(q8, k8, weights, k_scale=k_scale, interpret=support.INTERPRET)
    layout = variant["q_layout"]
    dequantised = support.on_cpu(reference.score, q8, k8, weights, q_layout=layout, k_scale=k_scale)
    support.assert_close(f"{name} vs dequantised", out, dequantised)  # rtol of the output dtype
    exact = support.on_cpu(reference.score, q32, k32, w32, q_layout=layout)
    quantisation_error = support.relative_error(dequantised, exact)
    assert 1e-3 < quantisation_error < 0.1  # float8 costs a few percent, and it is measured here
    assert support.relative_error(out, exact) <= quantisation_error + rtol(out.dtype)


@pytest.mark.chip
@pytest.mark.parametrize("name", FP8_NAMES)
def test_fp8_gradients_including_the_key_scale(name):
    """dq, dk in bfloat16 and dweights, dk_scale in float32, against the reference VJP in float32
    math at the dequantised inputs, with a causal mask."""
    module = VARIANTS[name]
    variant = module.VARIANT
    shape = (2, 32, 40, 128, 300)
    _, (q8, k8, weights, k_scale) = _quantised_problem(variant, shape, seed=32)
    kv_start, kv_end = support.mask_batch(shape[2], shape[4], seed=33)
    kv_start, kv_end = kv_start[1:3], kv_end[1:3]  # causal and packed
    cotangent = jax.random.normal(jax.random.PRNGKey(34), (2, shape[2], shape[4]), jnp.float32)
    masks = dict(kv_start=kv_start, kv_end=kv_end)

    score = lambda q, k, w, s: module.score(q, k, w, k_scale=s, interpret=support.INTERPRET, **masks)
    # The forward and backward as one compiled program (one XLA compile, as a training step).
    gradients = jax.jit(lambda args, g: jax.vjp(score, *args)[1](g))
    grads = gradients((q8, k8, weights, k_scale), cotangent.astype(variant["out_dtype"]))
    ref = lambda q, k, w, s: reference.score(q, k, w, q_layout=variant["q_layout"], k_scale=s, **masks)
    upcast = [x.astype(jnp.float32) for x in (q8, k8, weights, k_scale)]
    ref_grads = support.on_cpu(lambda args, g: jax.vjp(ref, *args)[1](g), upcast, cotangent)

    expected_dtypes = ("bfloat16", "bfloat16", variant["weights_dtype"], "float32")
    for arg, grad, ref_grad, dtype in zip(
        ("q", "k", "weights", "k_scale"), grads, ref_grads, expected_dtypes
    ):
        assert grad.dtype == jnp.dtype(dtype), f"d{arg} is {grad.dtype}, expected {dtype}"
        support.assert_close(f"{name} d{arg}", grad, ref_grad)


@pytest.mark.parametrize("name", FP8_NAMES)
def test_fp8_key_scale_is_required_and_checked(name):
    module = VARIANTS[name]
    _, (q8, k8, weights, k_scale) = _quantised_problem(module.VARIANT, (1, 16, 8, 128, 130), seed=0)
    with pytest.raises(ValueError, match=r"^k_scale is required by variant"):
        module.score(q8, k8, weights, interpret=True)
    with pytest.raises(ValueError, match=r"^k_scale must be float32 \[B=1, W=130\]"):
        module.score(q8, k8, weights, k_scale=k_scale[:, :5], interpret=True)
    with pytest.raises(ValueError, match=r"^k_scale must be float32"):
        module.score(q8, k8, weights, k_scale=k_scale.astype(jnp.bfloat16), interpret=True)


def test_key_scale_is_rejected_where_keys_carry_none():
    name = next(n for n in sorted(VARIANTS) if not VARIANTS[n].VARIANT["k_scale"])
    module = VARIANTS[name]
    q, k, weights = support.make_inputs(module.VARIANT, (1, 16, 8, 64, 130), seed=0)
    with pytest.raises(ValueError, match=r"^k_scale applies to float8 variants only"):
        module.score(q, k, weights, k_scale=jnp.ones((1, 130)), interpret=True)


@pytest.mark.parametrize("dims", ["CONTRACT_INNER", "CONTRACT_FIRST"])
def test_gradient_matmul_modes(dims):
    """grad_matmul "split" keeps float32 dlogits to float32 accuracy (a bfloat16 head and tail); "bf16"
    is exactly one pass of dlogits rounded to bfloat16, about 2**-9 relative."""
    from generated.csa_v4 import _kernel_ops, _operands

    kl, kr = jax.random.split(jax.random.key(3))
    lhs = jax.random.normal(kl, (256, 256), jnp.float32)  # dlogits
    rhs = jax.random.normal(kr, (256, 128), jnp.bfloat16)  # k, or the stacked q
    numbers = getattr(_kernel_ops, dims)
    lhs64, rhs64 = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    exact = lhs64 @ rhs64 if dims == "CONTRACT_INNER" else lhs64.T @ rhs64

    def run(mode):
        cfg = _operands.Config({}, 8, None, mode, False, 1, {}, {}, "visible_pieces")
        return np.asarray(_kernel_ops.grad_matmul(cfg, lhs, rhs, numbers), np.float64)

    def error(x):
        return np.linalg.norm(x - exact) / np.linalg.norm(exact)

    rounded = np.asarray(lhs.astype(jnp.bfloat16), np.float64)
    one_pass = rounded @ rhs64 if dims == "CONTRACT_INNER" else rounded.T @ rhs64
    np.testing.assert_allclose(run("bf16"), one_pass, rtol=1e-5, atol=1e-4)
    assert error(run("split")) < 1e-5 < 1e-3 < error(run("bf16")) < 4e-3
