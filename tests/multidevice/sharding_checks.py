"""``score`` inside ``jax.shard_map`` and ``sharded_score``, on 8 simulated CPU devices.

Not collected by the suite (the name does not match ``test_*.py``): ``tests/test_sharding.py`` runs
this file in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``, so the rest
of the suite keeps one device. To run it alone:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest -q tests/multidevice/sharding_checks.py

Every sharded result is held to the single-device ``score`` on the same inputs (forward and
gradients) and to the float32 reference, with ragged S and W (S divisible by the context axis),
random visible ranges and causal ones deep in a long context.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from codegen import reference
from generated.csa_v4 import VARIANTS, causal_kv_range
from tests import support

if jax.device_count() != 8:  # pragma: no cover - a guard against running it in the suite's process
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8", allow_module_level=True)

BF16 = VARIANTS["tpu_sm_bf16_q16_w128_hc16"]  # sequence-major, 16-head chunks
F32_HM = VARIANTS["tpu_hm_f32_q16_w128_hcall"]  # head-major, all heads per step
FP8 = VARIANTS["tpu_sm_fp8_q256_w2048c512f256_hcall"]  # float8 keys with k_scale
COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")


def mesh_of(shape, names, axis_type=AxisType.Auto):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def problem(module, shape, seed):
    """Inputs, bounds and a cotangent: even batch elements see random ranges (some empty, some past
    either end of [0, W)), odd ones are causal CSA deep in a long context (late tiles invisible)."""
    batch, _, seq_len, _, num_blocks = shape
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed)
    rng = np.random.default_rng(seed)
    random_start = rng.integers(-2, num_blocks, (batch, seq_len))
    random_end = rng.integers(0, num_blocks + 3, (batch, seq_len))
    positions = 4 * num_blocks - 4 * seq_len - 40 + np.arange(seq_len)
    causal_start, causal_end = (
        np.broadcast_to(np.asarray(x), (batch, seq_len)) for x in causal_kv_range(positions, 4)
    )
    odd = (np.arange(batch) % 2 == 1)[:, None]
    bounds = dict(
        kv_start=jnp.asarray(np.where(odd, causal_start, random_start), jnp.int32),
        kv_end=jnp.asarray(np.where(odd, causal_end, random_end), jnp.int32),
    )
    cotangent = jax.random.normal(jax.random.PRNGKey(seed + 1), (batch, seq_len, num_blocks))
    diff = dict(q=q, k=k, weights=weights, **support.key_scale(module.VARIANT, k))
    return diff, bounds, cotangent.astype(module.VARIANT["out_dtype"])


def compiled_vjp(fn, diff, bounds, cotangent):
    """(output, gradients of ``diff``) from one compiled program, and that program's text."""

    def run(diff, bounds, cotangent):
        out, vjp = jax.vjp(lambda diff: fn(**diff, **bounds), diff)
        return out, vjp(cotangent)[0]

    compiled = jax.jit(run).lower(diff, bounds, cotangent).compile()
    out, grads = compiled(diff, bounds, cotangent)
    return out, grads, compiled.as_text()


def single_device(module, diff, bounds, cotangent):
    out, grads, _ = compiled_vjp(functools.partial(module.score, interpret=True), diff, bounds, cotangent)
    return out, grads


def reference_vjp(module, diff, bounds, cotangent):
    """The float32 reference score and its gradients with respect to every array in ``diff``."""
    upcast = {name: jnp.asarray(x, jnp.float32) for name, x in diff.items()}
    fn = lambda d: reference.score(**d, q_layout=module.VARIANT["q_layout"], **bounds)
    out, vjp = jax.vjp(fn, upcast)
    return out, vjp(jnp.asarray(cotangent, jnp.float32))[0]


def collectives(hlo_text):
    """(kind, result type) of every collective in a compiled program."""
    found = []
    for line in hlo_text.splitlines():
        match = re.search(r"=\s*(\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
        if match:
            found.append((match.group(2), match.group(1)))
    return found


def assert_matches(name, module, out, grads, expected, diff, bounds, cotangent, exact_forward=True):
    """Sharded results against the single-device ``score`` and against the float32 reference."""
    expected_out, expected_grads = expected
    assert out.shape == expected_out.shape and out.dtype == expected_out.dtype, name
    if exact_forward:  # batch and context sharding change no arithmetic
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected_out, np.float32))
    support.assert_close(f"{name} forward vs single device", out, jnp.asarray(expected_out, jnp.float32))
    reference_out, reference_grads = reference_vjp(module, diff, bounds, cotangent)
    support.assert_close(f"{name} forward vs reference", out, reference_out)
    assert set(grads) == set(diff), name
    for arg in diff:
        assert grads[arg].dtype == expected_grads[arg].dtype, f"{name} d{arg}: {grads[arg].dtype}"
        expected_grad = jnp.asarray(expected_grads[arg], jnp.float32)
        support.assert_close(f"{name} d{arg} vs single device", grads[arg], expected_grad)
        support.assert_close(f"{name} d{arg} vs reference", grads[arg], reference_grads[arg])


# ------------------------------------------------------------------------------------------------
# The failure: score inside a user's jax.shard_map with default arguments (check_vma=True).
# ------------------------------------------------------------------------------------------------

DATA_SHAPE = (8, 16, 24, 64, 150)  # (B, H, S, D, W): ragged S and W


@pytest.fixture(scope="module")
def data_problem():
    diff, bounds, cotangent = problem(BF16, DATA_SHAPE, seed=0)
    return diff, bounds, cotangent, single_device(BF16, diff, bounds, cotangent)


def test_score_inside_a_users_default_shard_map(data_problem):
    diff, bounds, cotangent, expected = data_problem
    mesh = mesh_of((8,), ("data",))
    spec = P("data")

    def fn(**arrays):
        return jax.shard_map(
            lambda arrays: BF16.score(**arrays, interpret=True), mesh=mesh, in_specs=(spec,), out_specs=spec
        )(arrays)

    out, grads, _ = compiled_vjp(fn, diff, bounds, cotangent)
    assert_matches("user shard_map over data", BF16, out, grads, expected, diff, bounds, cotangent)
    eager = fn(**diff, **bounds)  # no jax.jit around the shard_map
    np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(expected[0], np.float32))


def test_score_inside_a_users_shard_map_with_replicated_keys():
    """The user shards the sequence and replicates k: dk must come back summed over that axis, once
    (it is invariant over it, as k is), in float32."""
    mesh = mesh_of((8,), ("seq",), AxisType.Explicit)
    diff, bounds, cotangent = problem(F32_HM, (1, 16, 48, 64, 150), seed=1)
    expected = single_device(F32_HM, diff, bounds, cotangent)
    specs = dict(
        q=P(None, None, "seq"), k=P(), weights=P(None, "seq"), kv_start=P(None, "seq"), kv_end=P(None, "seq")
    )
    placed = lambda tree: {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in tree.items()}

    def fn(**arrays):
        return jax.shard_map(
            lambda arrays: F32_HM.score(**arrays, interpret=True),
            mesh=mesh,
            in_specs=(specs,),
            out_specs=P(None, "seq"),
        )(arrays)

    out, grads, _ = compiled_vjp(fn, placed(diff), placed(bounds), cotangent)
    assert grads["k"].sharding.spec in (P(), P(None, None, None))
    assert_matches("user shard_map over the sequence", F32_HM, out, grads, expected, diff, bounds, cotangent)


@pytest.mark.parametrize(
    "module, windows", [(BF16, 1), (FP8, 1), (FP8, 3)], ids=["bf16", "fp8", "fp8_k_in_windows"]
)
def test_sparse_score_inside_a_users_shard_map_with_replicated_keys(module, windows, monkeypatch):
    """sparse_score with the queries (and their indices) sharded over a sequence axis and k replicated:
    the same scores and gradients as on one device, dk (and dk_scale) summed over the axis once; with
    all of k resident, and with k in windows (a scan over them, inside the shard_map)."""
    mesh = mesh_of((8,), ("seq",), AxisType.Explicit)
    batch, seq_len, num_blocks, top_k = 1, 48, 150, 12
    if windows > 1:
        support.sparse_key_windows(monkeypatch, module, (batch, 16, seq_len, 64, num_blocks), top_k, windows)
    q, k, weights = support.make_inputs(module.VARIANT, (batch, 16, seq_len, 64, num_blocks), seed=3)
    diff = dict(q=q, k=k, weights=weights, **support.key_scale(module.VARIANT, k))
    rng = np.random.default_rng(3)
    indices = jnp.asarray(rng.integers(-2, num_blocks + 2, (batch, seq_len, top_k)), jnp.int32)
    cotangent = jax.random.normal(jax.random.PRNGKey(4), (batch, seq_len, top_k)).astype(
        module.VARIANT["out_dtype"]
    )
    specs = dict(q=P(None, "seq"), k=P(), weights=P(None, "seq"), k_scale=P(), indices=P(None, "seq"))
    specs = {name: spec for name, spec in specs.items() if name in diff or name == "indices"}
    placed = lambda tree: {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in tree.items()}

    def sharded(**arrays):
        return jax.shard_map(
            lambda arrays: module.sparse_score(**arrays, route="sparse", interpret=True),
            mesh=mesh,
            in_specs=(specs,),
            out_specs=P(None, "seq"),
        )(arrays)

    single = functools.partial(module.sparse_score, route="sparse", interpret=True)
    out, grads, _ = compiled_vjp(sharded, placed(diff), placed(dict(indices=indices)), cotangent)
    expected_out, expected_grads, _ = compiled_vjp(single, diff, dict(indices=indices), cotangent)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected_out, np.float32))
    assert grads["k"].sharding.spec in (P(), P(None, None, None))
    for arg in diff:
        assert grads[arg].dtype == expected_grads[arg].dtype, f"d{arg}: {grads[arg].dtype}"
        support.assert_close(
            f"sparse d{arg} vs single device", grads[arg], jnp.asarray(expected_grads[arg], jnp.float32)
        )


# ------------------------------------------------------------------------------------------------
# sharded_score, mode by mode.
# ------------------------------------------------------------------------------------------------


def test_data_parallel_has_no_gather_and_no_all_to_all(data_problem):
    diff, bounds, cotangent, expected = data_problem
    mesh = mesh_of((8,), ("data",))
    fn = functools.partial(BF16.sharded_score, mesh=mesh, interpret=True)
    out, grads, hlo = compiled_vjp(fn, diff, bounds, cotangent)
    assert_matches("data (8,)", BF16, out, grads, expected, diff, bounds, cotangent)
    found = collectives(hlo)
    assert not [c for c in found if c[0] in ("all-gather", "all-to-all")], found
    assert out.sharding.spec[0] == "data"


CONTEXT_SHAPE = (2, 16, 40, 64, 150)  # S = 40 splits into 4 shards of 10 queries, none a whole tile


@pytest.fixture(scope="module")
def context_problem():
    diff, bounds, cotangent = problem(BF16, CONTEXT_SHAPE, seed=2)
    return diff, bounds, cotangent, single_device(BF16, diff, bounds, cotangent)


def test_context_parallel_on_an_auto_mesh(context_problem):
    """Unsharded inputs; the program gathers no q and no weights: its only collective is the sum of
    dk over the context axis, once, in float32."""
    diff, bounds, cotangent, expected = context_problem
    mesh = mesh_of((2, 4), ("data", "context"))
    fn = functools.partial(BF16.sharded_score, mesh=mesh, context_axis="context", interpret=True)
    out, grads, hlo = compiled_vjp(fn, diff, bounds, cotangent)
    assert_matches("data x context, Auto", BF16, out, grads, expected, diff, bounds, cotangent)
    batch, _, _, head_dim, num_blocks = CONTEXT_SHAPE
    dk_partial = f"f32[{batch // 2},{num_blocks},{head_dim}]"
    assert [(kind, shape.split("{")[0]) for kind, shape in collectives(hlo)] == [("all-reduce", dk_partial)]
    assert out.sharding.spec[:2] == ("data", "context")


def load_balanced_order(seq_len, shards):
    """Each shard holds chunk i from the start and chunk 2 * shards - 1 - i from the end."""
    chunks = np.split(np.arange(seq_len), 2 * shards)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def test_load_balanced_context_parallel_on_an_explicit_mesh(context_problem):
    """Already-sharded inputs on an Explicit mesh (jax.make_mesh's default), in the load-balanced
    causal order: the scores and gradients are the single-device ones, permuted alike."""
    diff, bounds, cotangent, (expected_out, expected_grads) = context_problem
    mesh = mesh_of((2, 4), ("data", "context"), AxisType.Explicit)
    order = load_balanced_order(CONTEXT_SHAPE[2], 4)
    seq_axis = dict(q=1, weights=1, kv_start=1, kv_end=1)
    permute = lambda tree: {
        n: jnp.take(x, order, axis=seq_axis[n]) if n in seq_axis else x for n, x in tree.items()
    }
    specs = dict(
        q=P("data", "context"),
        k=P("data"),
        weights=P("data", "context"),
        kv_start=P("data", "context"),
        kv_end=P("data", "context"),
    )
    place = lambda tree: {n: jax.device_put(x, NamedSharding(mesh, specs[n])) for n, x in tree.items()}
    p_diff, p_bounds = place(permute(diff)), place(permute(bounds))
    p_cotangent = jax.device_put(cotangent[:, order], NamedSharding(mesh, P("data", "context")))
    fn = functools.partial(BF16.sharded_score, mesh=mesh, context_axis="context", interpret=True)
    out, grads, _ = compiled_vjp(fn, p_diff, p_bounds, p_cotangent)
    expected = (expected_out[:, order], permute(expected_grads))
    assert_matches(
        "load-balanced data x context, Explicit",
        BF16,
        out,
        grads,
        expected,
        permute(diff),
        permute(bounds),
        cotangent[:, order],
    )


def test_eager_gradient_on_the_readmes_explicit_mesh(context_problem):
    """Eagerly, as the README shows: on jax.make_mesh's Explicit axes, the caller's own eager ops on the
    sharded scores (its loss) need the mesh set, the one line ``with jax.set_mesh(mesh):``."""
    diff, bounds, cotangent, (expected_out, expected_grads) = context_problem
    mesh = jax.make_mesh((2, 4), ("data", "context"))
    assert set(mesh.axis_types) == {AxisType.Explicit}
    placed = jax.device_put(cotangent.astype(jnp.float32), NamedSharding(mesh, P("data", "context")))

    def loss(diff):
        out = BF16.sharded_score(**diff, mesh=mesh, context_axis="context", **bounds, interpret=True)
        return jnp.sum(jnp.where(jnp.isfinite(out), out.astype(jnp.float32) * placed, 0.0)), out

    with jax.set_mesh(mesh):
        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(diff)
    expected = (expected_out, expected_grads)
    assert_matches("eager, Explicit", BF16, out, grads, expected, diff, bounds, cotangent)


def test_data_context_and_heads_with_the_batch_fallback():
    """(2, 2, 2) data x context x heads with B = 1: the batch falls back to replication (one warning),
    S splits over context, H over heads; partial scores are summed in float32, then rounded."""
    mesh = mesh_of((2, 2, 2), ("data", "context", "heads"))
    diff, bounds, cotangent = problem(BF16, (1, 32, 40, 64, 150), seed=3)
    expected = single_device(BF16, diff, bounds, cotangent)
    fn = functools.partial(
        BF16.sharded_score, mesh=mesh, context_axis="context", head_axis="heads", interpret=True
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, grads, hlo = compiled_vjp(fn, diff, bounds, cotangent)
    messages = {str(w.message) for w in caught if "sharded_score" in str(w.message)}
    assert len(messages) == 1 and "B=1" in messages.pop()
    assert_matches(
        "data x context x heads", BF16, out, grads, expected, diff, bounds, cotangent, exact_forward=False
    )
    reduced = [shape.split("{")[0] for kind, shape in collectives(hlo)]
    assert set(kind for kind, _ in collectives(hlo)) == {"all-reduce"}
    assert "f32[1,20,150]" in reduced  # the partial scores: [B, S / cp, W] in float32
    assert "f32[1,150,64]" in reduced  # dk, over context and heads


def test_head_parallel_bfloat16_within_one_ulp():
    """All heads per grid step: the float32 sum over head shards is in another order than the
    kernel's, so bfloat16 scores may differ by one ulp where the sum lies at a rounding boundary."""
    module = VARIANTS["tpu_sm_bf16_q16_w128_hcall"]
    mesh = mesh_of((2, 4), ("data", "heads"))
    diff, bounds, _ = problem(module, (2, 32, 24, 64, 150), seed=8)
    expected = np.asarray(module.score(**diff, **bounds, interpret=True), np.float32)
    fn = jax.jit(lambda d, b: module.sharded_score(**d, **b, mesh=mesh, head_axis="heads", interpret=True))
    out = np.asarray(fn(diff, bounds), np.float32)
    masked = ~np.isfinite(expected)
    np.testing.assert_array_equal(out[masked], expected[masked])  # exactly -inf
    # One bfloat16 ulp is 2**-8 to 2**-7 of the value; entries that cancel to near zero may differ
    # by float32 rounding of their terms instead.
    bound = np.abs(expected[~masked]) * 2.0**-7 + 1e-6 * np.abs(expected[~masked]).max()
    assert np.all(np.abs(out[~masked] - expected[~masked]) <= bound), "more than one bfloat16 ulp apart"
    assert support.relative_error(out[~masked], expected[~masked]) <= 2e-3


def test_fp8_keys_with_a_scale_over_two_batch_axes_and_heads():
    """float8 keys and k_scale on an Explicit (2, 2, 2) mesh: the batch over two of the default batch
    axes at once, heads over a third axis; k and k_scale are replicated over it, so dk and dk_scale
    are summed over it."""
    mesh = mesh_of((2, 2, 2), ("data", "expert", "tensor"), AxisType.Explicit)
    diff, bounds, cotangent = problem(FP8, (4, 32, 24, 64, 150), seed=4)
    expected = single_device(FP8, diff, bounds, cotangent)
    fn = functools.partial(FP8.sharded_score, mesh=mesh, head_axis="tensor", interpret=True)
    out, grads, _ = compiled_vjp(fn, diff, bounds, cotangent)
    assert_matches(
        "fp8 batch x heads", FP8, out, grads, expected, diff, bounds, cotangent, exact_forward=False
    )
    assert out.sharding.spec[0] == ("data", "expert")
    assert grads["q"].dtype == jnp.bfloat16 and grads["k_scale"].dtype == jnp.float32


# ------------------------------------------------------------------------------------------------
# Bad arguments: a ValueError naming the axis or the sizes, before anything is traced.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh_shape, names, kwargs, shape, message",
    [
        (
            (8,),
            ("data",),
            dict(context_axis="context"),
            (2, 16, 40, 64, 150),
            "context_axis 'context' is not an axis",
        ),
        ((8,), ("data",), dict(head_axis="model"), (2, 16, 40, 64, 150), "head_axis 'model' is not an axis"),
        (
            (2, 4),
            ("data", "cp"),
            dict(context_axis="cp", head_axis="cp"),
            (2, 16, 40, 64, 150),
            "'cp' is used twice",
        ),
        (
            (2, 4),
            ("data", "cp"),
            dict(batch_axes=("data", "cp"), context_axis="cp"),
            (2, 16, 40, 64, 150),
            "'cp' is used twice",
        ),
        (
            (2, 4),
            ("data", "tp"),
            dict(batch_axes=("data", "tp"), head_axis="tp"),
            (2, 16, 40, 64, 150),
            "'tp' is used twice",
        ),
        (
            (2, 4),
            ("data", "cp"),
            dict(batch_axes=("data", "data")),
            (2, 16, 40, 64, 150),
            "'data' is used twice",
        ),
        (
            (2, 4),
            ("data", "cp"),
            dict(context_axis="cp"),
            (2, 16, 42, 64, 150),
            "4 shards, which do not divide the sequence length S=42",
        ),
        # (run on an all-heads variant: head chunk 16 would reject 18 heads before the mesh is looked at)
        ((2, 4), ("data", "tp"), dict(head_axis="tp"), (2, 18, 40, 64, 150), "do not divide the H=18 heads"),
        (
            (4, 2),
            ("data", "tp"),
            dict(head_axis="tp"),
            (2, 48, 40, 64, 150),
            "head chunk of 16 does not divide",
        ),
    ],
)
def test_bad_axes_raise_before_tracing(mesh_shape, names, kwargs, shape, message, monkeypatch):
    module = F32_HM if "H=18" in message else BF16
    mesh = mesh_of(mesh_shape, names)
    diff, bounds, _ = problem(module, shape, seed=5)
    monkeypatch.setattr(module, "_score_as", lambda *args, **kwargs: pytest.fail("traced before the check"))
    with pytest.raises(ValueError, match=re.escape(message)):
        module.sharded_score(**diff, **bounds, mesh=mesh, interpret=True, **kwargs)


def test_bad_mesh_and_bad_inputs_raise():
    diff, bounds, _ = problem(BF16, (2, 16, 40, 64, 150), seed=6)
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        BF16.sharded_score(**diff, mesh=None)
    mesh = mesh_of((8,), ("data",))
    with pytest.raises(ValueError, match="weights must be"):
        BF16.sharded_score(diff["q"], diff["k"], diff["weights"][:, :-1], mesh=mesh)
    with pytest.raises(ValueError, match="k_scale applies to float8 variants only"):
        BF16.sharded_score(**diff, k_scale=jnp.ones(diff["k"].shape[:2]), mesh=mesh)
    with pytest.raises(ValueError, match="kv_end must be"):
        BF16.sharded_score(**diff, kv_end=bounds["kv_end"][:, :3], mesh=mesh)


def test_the_fallback_warns_once_naming_the_sizes():
    mesh = mesh_of((2, 4), ("data", "fsdp"))
    diff, bounds, _ = problem(BF16, (6, 16, 8, 64, 20), seed=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jax.eval_shape(lambda d: BF16.sharded_score(**d, **bounds, mesh=mesh, interpret=True), diff)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert (
        "B=6" in messages[0]
        and "8 shards" in messages[0]
        and "'data': 2" in messages[0]
        and "'fsdp': 4" in messages[0]
    )
    assert out.shape == (6, 8, 20)


def test_sharded_score_topk_is_the_single_device_selection():
    """Data x context parallel top-k: the same indices and scores as one device, bit for bit, and the
    same gradient; the program's only collective is dk's sum over the context axis."""
    diff, bounds, _ = problem(BF16, CONTEXT_SHAPE, seed=5)
    top_k = 24
    mesh = mesh_of((2, 4), ("data", "context"))

    def run(fn):
        def loss(diff):
            index, values = fn(**diff, top_k=top_k, **bounds)
            return jnp.sum(jnp.where(index >= 0, values.astype(jnp.float32), 0.0)), (index, values)

        program = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (_, (index, values)), grads = program(diff)
        gradient_only = jax.jit(jax.grad(lambda diff: loss(diff)[0]))  # its collectives, not the loss's sum
        return index, values, grads, gradient_only.lower(diff).compile().as_text()

    single = run(functools.partial(BF16.score_topk, interpret=True))
    sharded = run(
        functools.partial(BF16.sharded_score_topk, mesh=mesh, context_axis="context", interpret=True)
    )
    np.testing.assert_array_equal(np.asarray(sharded[0]), np.asarray(single[0]))
    np.testing.assert_array_equal(np.asarray(sharded[1]), np.asarray(single[1]))
    assert (np.asarray(single[0]) >= 0).any() and (np.asarray(single[0]) < 0).any()
    for name in diff:
        support.assert_close(
            f"sharded_score_topk d{name}", sharded[2][name], single[2][name].astype(jnp.float32)
        )
    batch, _, _, head_dim, num_blocks = CONTEXT_SHAPE
    dk_partial = f"f32[{batch // 2},{num_blocks},{head_dim}]"
    assert [(kind, shape.split("{")[0]) for kind, shape in collectives(sharded[3])] == [
        ("all-reduce", dk_partial)
    ]


def test_sharded_score_topk_checks_its_axes():
    diff, bounds, _ = problem(BF16, CONTEXT_SHAPE, seed=5)
    mesh = mesh_of((2, 4), ("data", "context"))
    with pytest.raises(ValueError, match="context_axis 'seq' is not an axis of the mesh"):
        BF16.sharded_score_topk(**diff, top_k=4, mesh=mesh, context_axis="seq", **bounds, interpret=True)
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        BF16.sharded_score_topk(**diff, top_k=0, mesh=mesh, **bounds, interpret=True)
