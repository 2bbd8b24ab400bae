"""The shared harness: every generated variant, discovered from ``VARIANTS``, against the reference."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import pytest

from codegen import cost, hlo_audit
from generated.csa_v4 import VARIANTS
from tests import support
from tests.spec_cases import family

# (B, H, S, D, W). Every H is a multiple of 16 so each head-chunked variant runs.
FORWARD_SHAPES = {
    "ragged_two_chunks": (2, 32, 40, 128, 300),  # ragged S and W, two head chunks of 16
    "single_query_single_block": (1, 16, 1, 128, 1),
    "short_s_narrow_d": (1, 16, 5, 64, 129),  # S < every block_q; W one past a lane tile; D < 128
    "several_production_tiles": (1, 16, 264, 128, 2100),  # > one 256 x 2048 tile each way
}
GRADIENT_SHAPES = {  # tests/test_masking.py adds masked gradients, and fully masked rows
    "ragged": (2, 32, 37, 128, 150),
    "single_block": (1, 16, 3, 64, 1),
}


# On the chip: the ragged case (every variant, two head chunks, a non-default scale).
@pytest.mark.parametrize(
    "shape_name",
    [
        pytest.param(n, marks=pytest.mark.chip) if n == "ragged_two_chunks" else n
        for n in sorted(FORWARD_SHAPES)
    ],
)
def test_forward_matches_reference(module, shape_name):
    """Interpret mode fills outputs with NaN first, so an unwritten element fails. The ragged case
    runs in the TPU-faithful interpreter (NaN-filled VMEM, race detection, out-of-bounds reads
    raise) with a non-default scale."""
    name = module.VARIANT["name"]
    shape = FORWARD_SHAPES[shape_name]
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed=sorted(FORWARD_SHAPES).index(shape_name))
    tpu_faithful = shape_name == "ragged_two_chunks"
    interpret = support.tpu_interpret_params() if tpu_faithful else support.INTERPRET
    scale = 0.3 if tpu_faithful else None
    out = support.call(module, q, k, weights, softmax_scale=scale, interpret=interpret)
    assert not support.races_found()
    assert out.dtype == jnp.dtype(module.VARIANT["out_dtype"])
    expected = support.reference_score(module.VARIANT, q, k, weights, softmax_scale=scale)
    support.assert_close(f"{name} {shape}", out, expected)


@pytest.mark.parametrize("shape_name", sorted(GRADIENT_SHAPES))
def test_gradients_match_reference_vjp(module, shape_name):
    name = module.VARIANT["name"]
    variant = module.VARIANT
    shape = GRADIENT_SHAPES[shape_name]
    q, k, weights = support.make_inputs(variant, shape, seed=11)
    batch, _, seq_len, _, num_blocks = shape
    cotangent = jax.random.normal(jax.random.PRNGKey(12), (batch, seq_len, num_blocks)).astype(
        variant["out_dtype"]
    )

    _, grads = support.vjp_program(module, interpret=True)(q, k, weights, cotangent)
    ref_grads = support.reference_grads(variant, q, k, weights, cotangent)

    grad_dtypes = (variant["qk_grad_dtype"], variant["qk_grad_dtype"], variant["weights_dtype"])
    for arg, grad, ref_grad, dtype in zip(("q", "k", "weights"), grads, ref_grads, grad_dtypes):
        # Each gradient in its input's dtype; float8 inputs get bfloat16 gradients (VARIANT says so).
        assert grad.dtype == jnp.dtype(dtype), f"d{arg} is {grad.dtype}, expected {dtype}"
        support.assert_close(f"{name} d{arg} {shape}", grad, ref_grad)


def test_lowers_for_tpu(module):
    """Mosaic's TPU lowering accepts the forward and the gradient at the production head shape, and
    the fused gradient does no [S, W]-sized work outside its kernels (the reference one does)."""
    name = module.VARIANT["name"]
    shape = (1, 64, 256, 128, 2048)
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed=0)
    assert (
        support.lower_for_tpu(functools.partial(support.call, module), q, k, weights).count("tpu_custom_call")
        == 1
    )

    cotangent = jnp.ones(shape[:1] + shape[2:3] + shape[4:], module.VARIANT["out_dtype"])

    def loss(q, k, weights):
        return jnp.sum((support.call(module, q, k, weights) * cotangent).astype(jnp.float32))

    lowered = support.lower_tpu(jax.grad(loss, argnums=(0, 1, 2)), q, k, weights)
    audit = hlo_audit.analyse(lowered.compiler_ir("stablehlo"), shape[2] * shape[4], name)
    big_in_score = sum(count for (owner, *_), count in audit.big_ops.items() if owner == "score")
    kernels = collections.Counter(call.strip('"').removeprefix(f"{name}_") for call in audit.pallas_calls)
    # Whether the forward kernel survives in the gradient program is the compiler's dead-code
    # elimination, not the kernels' (the gradient does not use its output; JAX 0.12 drops it, 0.10
    # keeps it): it may be there once, never anything but the variant's own kernels.
    assert kernels["forward"] <= 1, kernels
    if module.VARIANT["backward"] == "fused":
        # the backward this shape takes: dq_dk where one w tile covers W (and the variant has it), else two
        backward = [k.name for k in cost.call_kernels(family().plan(name), shape) if k.name != "forward"]
        assert set(kernels) <= {"forward", *backward}, kernels
        assert all(kernels[k] == 1 for k in backward), kernels
        assert audit.loops == [] and big_in_score == 0, audit
    else:
        assert set(kernels) <= {"forward"}, kernels
        assert audit.loops and big_in_score > 0  # the reference VJP scans and materialises logits


@pytest.mark.parametrize(
    "name", sorted(n for n, m in VARIANTS.items() if "dq_dk" in m.CONFIG.work and "q16" not in n)
)
def test_fused_backward_is_the_split_one_bit_for_bit(name):
    """Where one w tile covers W, dq_dk computes each logit once for dq and dk; the two split kernels,
    which compute it once each, return the same bits (same operations, same order of sums)."""
    module = VARIANTS[name]
    shape = (1, 32, 40, 128, 300)  # two head chunks of 16, ragged S and W
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed=1)
    k_scale = support.key_scale(module.VARIANT, k).get("k_scale")
    end = jnp.broadcast_to((jnp.arange(shape[2]) + 1) // 4, shape[:1] + shape[2:3]).astype(jnp.int32)
    x = module.prepare(q, k, weights, jnp.zeros_like(end), end, k_scale)
    assert x.num_w_blocks == 1
    g = jax.random.normal(jax.random.PRNGKey(2), (1, x.seq_pad, x.blocks_pad)).astype(
        module.VARIANT["out_dtype"]
    )
    run = lambda backward: backward(module.CONFIG, 0.5, True, x, q, k, weights, g)
    fused, split = run(module._dense._fused_backward), run(module._dense._split_backward)
    assert len(fused) == len(split) == 3 + bool(k_scale is not None)
    for got, want in zip(fused, split):
        assert got.dtype == want.dtype and bool(jnp.array_equal(got, want)), name


REFERENCE_TWINS = sorted(
    (name, name.removesuffix("_refbwd"))
    for name in VARIANTS
    if VARIANTS[name].VARIANT["backward"] == "reference" and name.removesuffix("_refbwd") in VARIANTS
)


def test_some_reference_variant_has_a_fused_twin():
    assert REFERENCE_TWINS, "the spec should emit a reference-backward twin of a fused variant"


@pytest.mark.parametrize("reference_name, fused_name", REFERENCE_TWINS)
def test_fused_and_reference_backward_agree(reference_name, fused_name):
    """Twins differ only in the backward: their gradients agree to the gradient dtype's tolerance."""
    twins = [VARIANTS[reference_name], VARIANTS[fused_name]]
    variant = twins[0].VARIANT
    q, k, weights = support.make_inputs(variant, (2, 32, 45, 128, 1030), seed=5)
    cotangent = jax.random.normal(jax.random.PRNGKey(6), (2, 45, 1030)).astype(variant["out_dtype"])
    grads = [support.vjp_program(module, interpret=True)(q, k, weights, cotangent)[1] for module in twins]
    for arg, reference_grad, fused_grad in zip(("q", "k", "weights"), *grads):
        support.assert_close(f"d{arg}", fused_grad, reference_grad.astype(jnp.float32))


def test_variant_metadata_matches_behaviour(module):
    """VARIANT is what the spec resolved for this variant, its constants are VARIANT's, and the module's
    output and gradient dtypes are those VARIANT names (by abstract evaluation: nothing runs)."""
    name = module.VARIANT["name"]
    variant = module.VARIANT
    assert module.__name__.rsplit(".", 1)[-1] == name
    assert variant == family().plan(name).variant.as_dict()
    assert (module.BLOCK_Q, module.BLOCK_W, module.HEAD_CHUNK or 0) == (
        variant["block_q"],
        variant["block_w"],
        variant["head_chunk"],
    )
    shape = (1, 32, 20, 64, 130)
    q, k, weights = support.make_inputs(variant, shape, seed=0)
    cotangent = jax.ShapeDtypeStruct((1, 20, 130), variant["out_dtype"])
    out, grads = jax.eval_shape(support.vjp_program(module, interpret=True), q, k, weights, cotangent)
    assert out.dtype == jnp.dtype(variant["out_dtype"]) and out.shape == (1, 20, 130)
    assert [g.dtype for g in grads] == [
        jnp.dtype(variant[key]) for key in ("qk_grad_dtype", "qk_grad_dtype", "weights_dtype")
    ]


def test_poisoned_output_catches_an_unwritten_tile():
    """The harness's poison works: a kernel that skips one tile fails ``assert_close``.

    ``interpret=True`` leaves the unwritten tile NaN; the TPU interpreter, like a TPU, copies out
    the stale VMEM buffer of the previous tile, which the value comparison catches.
    """
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(0) != 1)
        def _write():
            o_ref[...] = x_ref[...]

    x = jax.random.normal(jax.random.PRNGKey(0), (24, 128), jnp.float32)
    for interpret in (True, support.tpu_interpret_params()):
        out = pl.pallas_call(
            kernel,
            grid=(3,),
            in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            interpret=interpret,
        )(x)
        with pytest.raises(AssertionError, match="NaN entries|relative error"):
            support.assert_close("skipped tile", out, x)
