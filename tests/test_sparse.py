"""Sparse selection: ``topk_indices``, every variant's ``sparse_score`` (forward and gradients against the
dense reference gathered at the indices), ``indexer_loss`` (dense and sparse, against a direct float32
computation), the TPU lowering of all of it, and the MXU work the sparse gradient executes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from codegen import cost, plan, reference
from generated.csa_v4 import VARIANTS, _gather, _geometry, _helpers, _take, topk_indices
from tests import support
from tests.conftest import ONE_PER_SPARSE_KERNELS, SPARSE_MODULES
from tests.spec_cases import ROOT, family

# Ragged everywhere: S and W off every tile, top_k off the gathered rows' sublane tiling.
SHAPE = (2, 16, 11, 32, 40)  # B, H, S, D, W
TOP_K = 7


def _indices(batch, seq_len, num_blocks, top_k, seed=0):
    """Random indices with every kind of slot: -1, below 0, at or past W, duplicates, a row with no
    valid index at all, and a row holding one block top_k times."""
    rng = np.random.default_rng(seed)
    indices = rng.integers(-3, num_blocks + 3, (batch, seq_len, top_k))
    indices[0, 0, :] = -1  # no block: an all -inf row, no gradient
    indices[0, 1, 2:] = -1  # the tail empty, as topk_indices leaves a row with few visible blocks
    indices[-1, 2, 1] = indices[-1, 2, 0] = 5  # a duplicate
    indices[-1, 3, :] = num_blocks - 1  # one block, top_k times
    return jnp.asarray(indices, jnp.int32)


def _scatter(values, indices, num_blocks):
    """``[B, S, top_k]`` values added into ``[B, S, W]`` at the valid indices (duplicates add up)."""
    valid = (indices >= 0) & (indices < num_blocks)
    batch, seq_len, _ = indices.shape
    out = jnp.zeros((batch, seq_len, num_blocks), jnp.float32)
    b, s = jnp.arange(batch)[:, None, None], jnp.arange(seq_len)[None, :, None]
    return out.at[b, s, jnp.where(valid, indices, 0)].add(jnp.where(valid, values.astype(jnp.float32), 0.0))


def _gathered(dense, indices):
    num_blocks = dense.shape[-1]
    valid = (indices >= 0) & (indices < num_blocks)
    return jnp.where(
        valid, jnp.take_along_axis(dense, jnp.clip(indices, 0, num_blocks - 1), axis=2), -jnp.inf
    )


# The dense route (the score of every block, the selected ones taken from it), for a float8 and a
# bfloat16 variant of each q layout: the same reference, the same tolerances.
DENSE_ROUTE = ("tpu_sm_fp8_q256_w2048c512f256_hcall", "tpu_hm_bf16_q256_w2048c512f256_hcall")


@pytest.mark.chip
@pytest.mark.parametrize(
    "name, windows, route",
    [(n, 1, "sparse") for n in SPARSE_MODULES]
    + [(n, 3, "sparse") for n in ONE_PER_SPARSE_KERNELS]
    + [(n, 1, "dense") for n in DENSE_ROUTE],
    ids=[f"{n}-resident_k" for n in SPARSE_MODULES]
    + [f"{n}-k_in_windows" for n in ONE_PER_SPARSE_KERNELS]
    + [f"{n}-dense_route" for n in DENSE_ROUTE],
)
def test_sparse_score_and_its_gradients_match_the_reference_gathered(name, windows, route, monkeypatch):
    """Against the dense reference at the indices: with all of k resident (a variant per layout, dtype
    policy and backward), and with k in three windows (one call per window, each seeing its slots; W
    past the VMEM that holds it, on a small VMEM), which the sparse kernel module's own code decides:
    a variant per module."""
    module = VARIANTS[name]
    variant = module.VARIANT
    batch, heads, seq_len, head_dim, num_blocks = SHAPE
    if windows > 1:
        support.sparse_key_windows(monkeypatch, module, SHAPE, TOP_K, windows)
    q, k, weights = support.make_inputs(variant, SHAPE, seed=1)
    scale = support.key_scale(variant, k)
    indices = _indices(batch, seq_len, num_blocks, TOP_K)
    args = (q, k, weights, *scale.values())

    def sparse(q, k, weights, *k_scale):
        extra = {"k_scale": k_scale[0]} if k_scale else {}
        return module.sparse_score(q, k, weights, indices, route=route, interpret=support.INTERPRET, **extra)

    out, vjp = jax.vjp(sparse, *args)
    assert out.dtype == jnp.dtype(variant["out_dtype"]) and out.shape == (batch, seq_len, TOP_K)
    support.assert_close(
        "sparse_score", out, _gathered(support.reference_score(variant, q, k, weights), indices)
    )

    # A cotangent with NaN at the empty slots: they must get no gradient, whatever g holds there.
    valid = (indices >= 0) & (indices < num_blocks)
    g = jax.random.normal(jax.random.PRNGKey(2), out.shape, jnp.float32)
    grads = vjp(jnp.where(valid, g, jnp.nan).astype(out.dtype))

    def dense(q, k, weights, *k_scale):
        extra = {"k_scale": k_scale[0]} if k_scale else {}
        return reference.score(q, k, weights, q_layout=variant["q_layout"], **extra)

    upcast = [jnp.asarray(x, jnp.float32) for x in args]
    g_dense = _scatter(g.astype(out.dtype), indices, num_blocks)  # the cotangent the kernel received
    expected = support.on_cpu(lambda args, g: jax.vjp(dense, *args)[1](g), upcast, g_dense)
    names = ("dq", "dk", "dweights", "dk_scale")
    dtypes = (variant["qk_grad_dtype"], variant["qk_grad_dtype"], variant["weights_dtype"], "float32")
    for name, dtype, actual, wanted in zip(names, dtypes, grads, expected):
        assert actual.dtype == jnp.dtype(dtype), f"{name}: {actual.dtype}"
        support.assert_close(name, actual, wanted)


@pytest.mark.chip
@pytest.mark.parametrize("windows", [1, 3], ids=["resident_k", "k_in_windows"])
def test_sparse_kernels_under_the_tpu_interpreter(windows, monkeypatch):
    """Uninitialised VMEM and outputs read as NaN, races and out-of-bounds reads reported: every
    slot's gathered row, every output column and the dk accumulators must be written before read,
    also where a window's call gathers only its slots' span."""
    module = VARIANTS["tpu_sm_bf16_q16_w128_hc16"]
    variant = module.VARIANT
    shape = (1, 16, 9, 32, 20)
    if windows > 1:
        support.sparse_key_windows(monkeypatch, module, shape, 5, windows)
    q, k, weights = support.make_inputs(variant, shape, seed=3)
    indices = _indices(1, 9, 20, 5, seed=4)
    sparse = lambda q, k, weights: module.sparse_score(
        q, k, weights, indices, route="sparse", interpret=support.tpu_interpret_params()
    ).astype(jnp.float32)
    out, vjp = jax.vjp(sparse, q, k, weights)
    grads = vjp(jnp.where(jnp.isfinite(out), 1.0, 0.0))
    assert not support.races_found()
    expected = _gathered(support.reference_score(variant, q, k, weights), indices)
    support.assert_close("sparse_score", out.astype(variant["out_dtype"]), expected)
    for grad in grads:
        assert np.isfinite(np.asarray(grad, np.float32)).all()


def _lowered_loss(module, shape, top_k):
    variant = module.VARIANT
    batch, _, seq_len, _, num_blocks = shape
    q, k, weights = support.make_inputs(variant, shape, seed=0)
    scale = support.key_scale(variant, k)
    indices = _indices(batch, seq_len, num_blocks, top_k)
    target = jnp.ones((batch, seq_len, top_k), jnp.float32)
    dense_target = jnp.ones((batch, seq_len, num_blocks), jnp.float32)
    kv_start, kv_end = support.mask_batch(seq_len, num_blocks, seed=0)
    kv_start, kv_end = kv_start[:batch], kv_end[:batch]

    def losses(q, k, weights):
        sparse = module.indexer_loss(
            q, k, weights, target, indices=indices, kv_start=kv_start, kv_end=kv_end, route="sparse", **scale
        )
        dense = module.indexer_loss(q, k, weights, dense_target, kv_start=kv_start, kv_end=kv_end, **scale)
        return sparse + dense

    return support.lower_for_tpu(jax.value_and_grad(losses, argnums=(0, 1, 2)), q, k, weights)


@pytest.mark.parametrize("num_blocks", [40, 2**31 // 64], ids=["one-key", "stable-argsort"])
def test_windowed_slot_orders_sort_by_block_ties_to_the_lower_slot(num_blocks):
    # the windowed route's per-query order of the slots: one unique int32 key (block, slot) sorted
    # unstably where it fits, a stable argsort where it does not; both are NumPy's stable argsort
    rng = np.random.default_rng(3)
    key = rng.integers(0, 41, (2, 5, 64)).astype(np.int32)  # duplicates; 40 stands for "no block"
    order, unorder = _gather.slot_orders(jnp.asarray(key), num_blocks)
    assert order.dtype == unorder.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(order), np.argsort(key, axis=-1, kind="stable"))
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(order), np.asarray(unorder), -1),
        np.broadcast_to(np.arange(64), key.shape),
    )


def test_sparse_score_and_indexer_loss_lower_for_tpu(sparse_module):
    """The sparse kernels (forward and backward, inside the gradient of both losses) pass Mosaic's TPU
    lowering at a realistic top_k (CI's compile gate compiles them with libtpu too)."""
    module = sparse_module
    shape = (1, 16, 16, 128, 300)
    text = _lowered_loss(module, shape, 128)
    name = module.VARIANT["name"]
    the_plan = family().plan(name)
    # the dense loss's forward and its backward at this W: dq_dk, or the split kernels (none: reference)
    dense = [k.name for k in cost.call_kernels(the_plan, shape)]
    assert dense[0] == "forward"
    assert len(dense) in ((1,) if module.VARIANT["backward"] == "reference" else (2, 3)), dense
    kernels = dense + [k.name for k in plan.sparse(the_plan.variant)]
    for kernel in kernels:
        assert f"{name}_{kernel}" in text, kernel


def test_sparse_score_checks_indices_and_takes_k_in_windows_past_vmem():
    module = VARIANTS["tpu_sm_bf16_q256_w2048c512f256_hc16"]
    q, k, weights = support.make_inputs(module.VARIANT, (1, 16, 8, 128, 64), seed=0)
    with pytest.raises(ValueError, match="indices must be an integer array"):
        module.sparse_score(q, k, weights, jnp.zeros((1, 8, 4), jnp.float32))
    with pytest.raises(ValueError, match=r"indices must be \[B=1, S=8, top_k>=1\]"):
        module.sparse_score(q, k, weights, jnp.zeros((1, 7, 4), jnp.int32))
    # 1M tokens at compress rate 4: W = 262144 keys of 128 bfloat16 lanes and their float32 dk are
    # 256 MiB as the kernels hold them, past the smallest target's 64 MiB: six windows of k, one call
    # each, at H = 64, top_k = 1024 (the gradient's check: the forward gathers in a narrower dtype).
    most = _gather.sparse_vmem_rows(128, 64, 1024, jnp.float32, jnp.bfloat16)
    assert 40000 < most < 50000 and _geometry.sparse_windows(262144, most) == (43696, 6)
    assert _geometry.sparse_windows(16384, most) == (16384, 1)  # the benchmark's long shape: resident
    big_k = jax.ShapeDtypeStruct((1, 262144, 128), jnp.bfloat16)
    loss = lambda q, k, w: module.sparse_score(q, k, w, jnp.zeros((1, 8, 1024), jnp.int32)).sum()
    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, big_k, weights)
    assert grads[1].shape == big_k.shape
    # A top_k whose gathered rows alone fill VMEM is refused before tracing, naming top_k.
    with pytest.raises(ValueError, match=r"top_k=400000 rows .* use a smaller top_k"):
        jax.eval_shape(
            lambda q, w: module.sparse_score(q, k, w, jnp.zeros((1, 8, 400000), jnp.int32), route="sparse"),
            q,
            weights,
        )


@pytest.mark.chip
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "shape",
    # ragged everywhere; several w tiles of each kernel, 64-row blocks; a band sliding down the rows (row s
    # selects from [20 s, 20 s + 700)), so that row blocks skip w tiles before and after what they select
    [(2, 11, 40, 7, None), (1, 64, 2304, 600, None), (1, 192, 4608, 300, 700)],
    ids=["ragged", "tiles", "band"],
)
def test_dense_route_take_is_the_slots_bit_for_bit_and_its_transpose_adds_them_up(shape, dtype):
    """``_take.take``: each slot's score exactly, 0 at an index outside [0, W) (-1, below 0, at or past
    W); its gradient puts each slot's cotangent at its block, a block selected twice getting the sum,
    rounded once to the scores' dtype, and nothing anywhere else (outputs NaN until written, off the chip),
    zeros in the w tiles a row block selects nothing from."""
    batch, seq_len, width, top_k, band = shape
    indices = _indices(batch, seq_len, width, top_k, seed=5)
    if band:
        rng = np.random.default_rng(6)
        banded = 20 * np.arange(seq_len)[None, :, None] + rng.integers(0, band, (batch, seq_len, top_k))
        indices = jnp.asarray(np.where(rng.random(banded.shape) < 0.1, -1, banded), jnp.int32)
    scores = jax.random.normal(jax.random.PRNGKey(0), (batch, seq_len, width), jnp.float32).astype(dtype)
    interpret = support.tpu_interpret_params()
    taken, vjp = jax.vjp(lambda s: _take.take(s, indices, interpret), scores)
    valid = (indices >= 0) & (indices < width)
    expected = jnp.where(valid, jnp.take_along_axis(scores, jnp.clip(indices, 0, width - 1), axis=2), 0)
    assert taken.dtype == scores.dtype
    np.testing.assert_array_equal(np.asarray(taken, np.float32), np.asarray(expected, np.float32))

    g = jax.random.normal(jax.random.PRNGKey(1), indices.shape, jnp.float32).astype(dtype)
    (put,) = vjp(g)
    summed = np.zeros((batch, seq_len, width), np.float64)
    index, g_host = np.asarray(indices), np.asarray(g, np.float64)
    for b, s, j in zip(*np.nonzero(np.asarray(valid))):
        summed[b, s, index[b, s, j]] += g_host[b, s, j]
    assert put.dtype == scores.dtype
    if dtype == "bfloat16":  # a float32 sum of bfloat16 terms, rounded once
        np.testing.assert_array_equal(np.asarray(put, np.float32), summed.astype(np.float32).astype(dtype))
    else:  # each slot exact (three bfloat16 pieces); a duplicate's sum in float32's order of terms
        np.testing.assert_allclose(
            np.asarray(put), summed, rtol=2**-22, atol=2**-22 * float(jnp.max(jnp.abs(g)))
        )


def test_route_auto_takes_the_dense_route_up_to_its_crossover():
    """``route="auto"``: the dense route (the score over each query's span of selected blocks, then
    ``_take``) at W / top_k <= DENSE_ROUTE_MAX_RATIO where the [B, S, W] scores fit DENSE_ROUTE_BYTES, the
    sparse kernels otherwise; "dense" and "sparse" as named; a route that is none of the three is a
    ValueError before tracing."""
    ratio, budget = _helpers.DENSE_ROUTE_MAX_RATIO, _helpers.DENSE_ROUTE_BYTES
    route = lambda r, width, top_k, seq_len=8192, dtype="bfloat16": _helpers.sparse_route(
        r, 1, seq_len, width, top_k, dtype
    )
    assert [route("auto", 2048, t) for t in (2048 // ratio, 2048 // ratio - 1)] == ["dense", "sparse"]
    big = budget // 2 // 2048  # the most queries whose bfloat16 scores at W 2048 fit the budget
    assert [route("auto", 2048, 512, seq_len=s) for s in (big, big + 1)] == ["dense", "sparse"]
    assert route("auto", 2048, 512, seq_len=big, dtype="float32") == "sparse"
    assert [route(r, 2048, 1) for r in ("dense", "sparse")] == ["dense", "sparse"]

    module = VARIANTS["tpu_hm_bf16_q256_w2048c512f256_hcall"]
    q, k, weights = support.make_inputs(module.VARIANT, (1, 16, 8, 128, 64), seed=0)
    name = module.VARIANT["name"]

    def kernels(top_k, route):
        indices = jnp.zeros((1, 8, top_k), jnp.int32)
        lowered = lambda q, k, w: module.sparse_score(q, k, w, indices, route=route)
        text = support.lower_for_tpu(lowered, q, k, weights)
        return f"{name}_forward" in text and "take_slots" in text, "sparse" in text.replace(
            "sparse_score", ""
        )

    # W 64: top_k 1 (W / top_k 64) the sparse kernels only; 4 (16) and 64 (1) the dense route only
    assert [kernels(top_k, "auto") for top_k in (1, 4, 64)] == [(False, True), (True, False), (True, False)]
    assert kernels(1, "dense") == (True, False)
    for call in (
        lambda: module.sparse_score(q, k, weights, jnp.zeros((1, 8, 4), jnp.int32), route="gather"),
        lambda: module.indexer_loss(q, k, weights, jnp.zeros((1, 8, 64)), route="Sparse"),
    ):
        with pytest.raises(ValueError, match="route must be one of 'auto', 'dense', 'sparse'"):
            call()


def _numpy_topk(scores, top_k):
    """A stable sort on descending score (lower block first among equals), -1 past the finite ones."""
    scores = np.asarray(scores, np.float64)
    out = np.full(scores.shape[:2] + (top_k,), -1, np.int64)
    for b, s in np.ndindex(*scores.shape[:2]):
        row = scores[b, s]
        finite = np.flatnonzero(np.isfinite(row))
        order = finite[np.argsort(-row[finite], kind="stable")][:top_k]
        out[b, s, : len(order)] = order
    return out


@pytest.mark.parametrize("top_k", [1, 5, 12, 40])
def test_topk_indices_is_a_stable_sort(top_k):
    rng = np.random.default_rng(top_k)
    scores = rng.integers(0, 6, (2, 9, 30)).astype(np.float32)  # many ties
    scores[rng.random(scores.shape) < 0.3] = -np.inf
    scores[0, 0] = -np.inf  # nothing visible
    scores[0, 1, 3] = np.nan  # not a visible block either
    scores[1, 1, 7] = np.inf
    got = topk_indices(jnp.asarray(scores), top_k)
    assert got.dtype == jnp.int32 and got.shape == (2, 9, top_k)
    np.testing.assert_array_equal(np.asarray(got), _numpy_topk(scores, top_k))
    np.testing.assert_array_equal(np.asarray(topk_indices(jnp.asarray(scores), top_k)), np.asarray(got))
    approx = np.asarray(topk_indices(jnp.asarray(scores, jnp.bfloat16), top_k, method="approx"))
    # Exact on a CPU; on any backend the same slots are filled, each row's scores non-increasing.
    np.testing.assert_array_equal(approx >= 0, _numpy_topk(scores, top_k) >= 0)
    for b, s in np.ndindex(2, 9):
        picked = approx[b, s][approx[b, s] >= 0]
        assert np.all(np.diff(scores[b, s, picked]) <= 0) and len(set(picked)) == len(picked)


def test_indexer_loss_checks_target_before_anything_runs(monkeypatch):
    module = VARIANTS["tpu_sm_bf16_q256_w2048c512f256_hc16"]
    q, k, weights = support.make_inputs(module.VARIANT, (1, 16, 8, 128, 64), seed=0)
    indices = jnp.zeros((1, 8, 4), jnp.int32)
    ran = []
    monkeypatch.setattr(module, "score", lambda *a, **kw: ran.append("score"))
    monkeypatch.setattr(module, "sparse_score", lambda *a, **kw: ran.append("sparse_score"))
    with pytest.raises(
        ValueError, match=r"target must be \[B, S, top_k\] like indices, \(1, 8, 4\), got \(1, 8, 5\)"
    ):
        module.indexer_loss(q, k, weights, jnp.zeros((1, 8, 5)), indices=indices)
    with pytest.raises(
        ValueError, match=r"target must be \[B, S, W\] like the score, \(1, 8, 64\), got \(1, 8, 4\)"
    ):
        module.indexer_loss(q, k, weights, jnp.zeros((1, 8, 4)))
    with pytest.raises(ValueError, match="target must be a float array"):
        module.indexer_loss(q, k, weights, indices, indices=indices)
    with pytest.raises(ValueError, match=r"indices must be \[B=1, S=8"):
        module.indexer_loss(q, k, weights, jnp.zeros((1, 7, 4)), indices=indices[:, :7])
    with pytest.raises(ValueError, match=r"^weights must be"):
        module.indexer_loss(q, k, weights[:, :4], jnp.zeros((1, 8, 64)))
    assert ran == []


def test_topk_indices_rejects_bad_arguments():
    scores = jnp.zeros((1, 2, 3))
    assert topk_indices(scores, np.int64(2)).shape == (1, 2, 2)  # a NumPy integer is a static top_k too
    for bad, match in (
        ((scores, 0), "top_k"),
        ((scores, 1.5), "top_k"),
        ((scores[0], 2), r"\[B, S, W\]"),
        ((scores, 2, "fast"), "method"),
    ):
        with pytest.raises(ValueError, match=match):
            topk_indices(*bad[:2], method=bad[2] if len(bad) > 2 else "exact")


def _direct_loss(logits, target, in_set):
    """The loss written out in float64 numpy, row by row."""
    logits, target, in_set = (np.asarray(x, np.float64) for x in (logits, target, in_set))
    total, rows = 0.0, 0
    for b, s in np.ndindex(*logits.shape[:2]):
        keep = in_set[b, s] > 0
        mass = target[b, s][keep].sum()
        rows += bool(keep.any())  # averaged over the rows with a non-empty set
        if not keep.any() or mass <= 0:  # a row with no target mass on its set adds 0
            continue
        p = target[b, s][keep] / mass
        x = logits[b, s][keep]
        log_q = x - x.max() - np.log(np.exp(x - x.max()).sum())
        total += np.sum(np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - log_q), 0.0))
    return total / max(rows, 1)


@pytest.mark.chip
@pytest.mark.parametrize(
    "name",
    [
        "tpu_hm_f32_q16_w128_hcall",
        "tpu_sm_bf16_q256_w2048c512f256_hc16",
        "tpu_sm_fp8_q256_w2048c512f256_hcall",
    ],
)
def test_indexer_loss_matches_a_direct_computation(name):
    module = VARIANTS[name]
    variant = module.VARIANT
    batch, heads, seq_len, head_dim, num_blocks = SHAPE
    q, k, weights = support.make_inputs(variant, SHAPE, seed=5)
    scale = support.key_scale(variant, k)
    rng = np.random.default_rng(6)
    indices = _indices(batch, seq_len, num_blocks, TOP_K, seed=6)
    kv_start, kv_end = support.mask_batch(seq_len, num_blocks, seed=6)
    kv_start, kv_end = kv_start[:batch], kv_end[:batch]
    target = jnp.asarray(rng.random((batch, seq_len, TOP_K)), jnp.float32)
    target = target.at[1, 4].set(0.0)  # no mass: the row adds 0 (and is averaged over)
    dense_target = jnp.asarray(rng.random((batch, seq_len, num_blocks)), jnp.float32)

    kwargs = dict(interpret=support.INTERPRET, **scale)
    sparse_loss = lambda q, k, w: module.indexer_loss(
        q, k, w, target, indices=indices, kv_start=kv_start, kv_end=kv_end, route="sparse", **kwargs
    )
    dense_loss = lambda q, k, w: module.indexer_loss(
        q, k, w, dense_target, kv_start=kv_start, kv_end=kv_end, **kwargs
    )
    sparse_value, sparse_grads = jax.value_and_grad(sparse_loss, argnums=(0, 1, 2))(q, k, weights)
    dense_value, dense_grads = jax.value_and_grad(dense_loss, argnums=(0, 1, 2))(q, k, weights)

    full = support.reference_score(variant, q, k, weights)  # float32, unmasked
    in_set = (
        (indices >= 0)
        & (indices < num_blocks)
        & (indices >= kv_start[..., None])
        & (indices < kv_end[..., None])
    )
    sparse_logits = jnp.take_along_axis(full, jnp.clip(indices, 0, num_blocks - 1), axis=2)
    visible = reference.visible(kv_start, kv_end, num_blocks)
    # The kernels' score is rounded to the output dtype before the float32 log-softmax.
    rounded = lambda x: np.asarray(jnp.asarray(x).astype(variant["out_dtype"]).astype(jnp.float32))
    tolerance = 1e-5 if variant["out_dtype"] == "float32" else 1e-3
    np.testing.assert_allclose(
        float(sparse_value), _direct_loss(rounded(sparse_logits), target, in_set), rtol=tolerance, atol=1e-6
    )
    np.testing.assert_allclose(
        float(dense_value), _direct_loss(rounded(full), dense_target, visible), rtol=tolerance
    )
    for grad in (*sparse_grads, *dense_grads):
        assert np.isfinite(np.asarray(grad, np.float32)).all()

    # The sparse loss's gradient is the reference's through a float32 loss on the gathered scores.
    def reference_loss(q, k, w):
        scores = reference.score(q, k, w, q_layout=variant["q_layout"], **scale)
        picked = jnp.take_along_axis(scores, jnp.clip(indices, 0, num_blocks - 1), axis=2)
        return _helpers.kl_over_sets(picked, target, in_set)

    def dense_reference_loss(q, k, w):
        scores = reference.score(
            q, k, w, q_layout=variant["q_layout"], kv_start=kv_start, kv_end=kv_end, **scale
        )
        return _helpers.kl_over_sets(scores, dense_target, visible)

    upcast = [jnp.asarray(x, jnp.float32) for x in (q, k, weights)]
    expected = support.on_cpu(jax.grad(reference_loss, argnums=(0, 1, 2)), *upcast)
    dense_expected = support.on_cpu(jax.grad(dense_reference_loss, argnums=(0, 1, 2)), *upcast)
    names = ("sparse dq", "sparse dk", "sparse dweights", "dense dq", "dense dk", "dense dweights")
    for name_, actual, wanted in zip(names, (*sparse_grads, *dense_grads), (*expected, *dense_expected)):
        # float32 throughout: summation order only. A bfloat16 score (rounded before the softmax) or
        # gradient (rounded after) moves it by up to ~2**-8 relative: 2e-2 still catches a wrong term.
        exact = variant["out_dtype"] == "float32" and actual.dtype == jnp.float32
        error = support.relative_error(actual, wanted)
        assert error <= (1e-4 if exact else 2e-2), f"{name_}: {error:.2e}"


@pytest.mark.chip
def test_indexer_loss_of_nothing_is_zero_not_nan():
    module = VARIANTS["tpu_sm_f32_q16_w128_hcall"]
    batch, heads, seq_len, head_dim, num_blocks = SHAPE
    q, k, weights = support.make_inputs(module.VARIANT, SHAPE, seed=7)
    empty = jnp.full((batch, seq_len, TOP_K), -1, jnp.int32)
    target = jnp.ones((batch, seq_len, TOP_K), jnp.float32)
    nothing_visible = jnp.zeros((batch, seq_len), jnp.int32)
    cases = {
        "no index": lambda q, k, w: module.indexer_loss(
            q, k, w, target, indices=empty, interpret=support.INTERPRET
        ),
        "no target mass": lambda q, k, w: module.indexer_loss(
            q,
            k,
            w,
            0.0 * target,
            indices=_indices(batch, seq_len, num_blocks, TOP_K),
            interpret=support.INTERPRET,
        ),
        "nothing visible": lambda q, k, w: module.indexer_loss(
            q,
            k,
            w,
            jnp.ones((batch, seq_len, num_blocks)),
            kv_start=nothing_visible,
            kv_end=nothing_visible,
            interpret=support.INTERPRET,
        ),
    }
    for case, loss in cases.items():
        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, weights)
        assert float(value) == 0.0, case
        for grad in grads:
            assert not np.asarray(grad, np.float32).any(), case


# (variant, B,H,S,D,W, top_k): top_k/W = 1/4 and 1/16 at the production tiling.
WORK_CASES = [
    ("tpu_sm_bf16_q256_w2048c512f256_hc16", (1, 16, 64, 64, 512), 128, 0.35),
    ("tpu_sm_bf16_q256_w2048c512f256_hc16", (1, 16, 64, 64, 512), 32, 0.1),
]

_MEASURE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from tests import mxu_counter, support
from generated.csa_v4 import VARIANTS
out, dense_flops = [], {}  # the dense gradient's count depends on the variant and shape only: once each
for name, shape, top_k in json.loads(sys.argv[1]):
    module = VARIANTS[name]
    q, k, w = support.make_inputs(module.VARIANT, tuple(shape), seed=0)
    scale = support.key_scale(module.VARIANT, k)
    indices = jnp.asarray(np.random.default_rng(0).integers(0, shape[4], (shape[0], shape[2], top_k)), jnp.int32)
    dense = lambda q, k, w: jnp.sum(support.call(module, q, k, w, interpret=True).astype(jnp.float32))
    sparse = lambda q, k, w: jnp.sum(
        module.sparse_score(q, k, w, indices, route="sparse", interpret=True, **scale).astype(jnp.float32)
    )
    with mxu_counter.installed():
        count = lambda f: mxu_counter.executed_flops(lambda: jax.grad(f, argnums=(0, 1, 2))(q, k, w))
        if (name, tuple(shape)) not in dense_flops:
            dense_flops[name, tuple(shape)] = count(dense)
        out.append([dense_flops[name, tuple(shape)], count(sparse)])
print(json.dumps(out))
"""


@pytest.mark.version_free
def test_sparse_gradient_executes_mxu_work_in_proportion_to_top_k():
    """The MXU work the gradient through sparse_score executes (each dot counted as it runs, in a fresh
    process) against the gradient of the dense score, unmasked: top_k / W for bfloat16 (0.25 at 1/4,
    0.0625 at 1/16): six passes each, the dense dq being one exact pass."""
    cases = [(name, shape, top_k) for name, shape, top_k, _ in WORK_CASES]
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0")
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps(cases)], capture_output=True, text=True, cwd=ROOT, env=env,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for (name, shape, top_k, bound), (dense, sparse) in zip(
        WORK_CASES, json.loads(result.stdout.splitlines()[-1])
    ):
        ratio = sparse / dense
        assert (
            ratio <= bound
        ), f"{name} top_k={top_k}/W={shape[4]}: sparse/dense MXU work {ratio:.3f} > {bound}"
        # Exactly the work model: per query 6 passes of [top_k, H, D] (the [top_k, H] head sums and
        # outer products run on the VPU), against the dense 5 passes of [W, H, D] where one w tile
        # covers W (forward 1, then dq_dk: the logits once, u 1, dk 2 split), as here.
        # (The cases are sequence-major, whose dq/dweights finish does no MXU work: each query's head
        # weights lie along sublanes already, where head-major broadcasts them by a one-hot matmul.)
        num_blocks = shape[4]
        assert VARIANTS[name].VARIANT["q_layout"] == "seq_major"
        assert [k.name for k in cost.call_kernels(family().plan(name), shape)] == ["forward", "dq_dk"]
        assert 5 * sparse * num_blocks == 6 * dense * top_k, (sparse, dense)


@pytest.mark.chip
def test_sparse_score_is_deterministic():
    """The forward and every gradient, run twice, are equal bit for bit (the dk rows are added in slot
    order, duplicates included), and topk_indices of equal scores is the same selection."""
    module = VARIANTS["tpu_sm_fp8_q256_w2048c512f256_hcall"]
    q, k, weights = support.make_inputs(module.VARIANT, (1, 16, 9, 32, 20), seed=9)
    k_scale = support.key_scale(module.VARIANT, k)["k_scale"]
    indices = _indices(1, 9, 20, 6, seed=10)
    sparse = lambda q, k, weights, k_scale: module.sparse_score(
        q, k, weights, indices, k_scale=k_scale, route="sparse", interpret=support.INTERPRET
    )

    @jax.jit  # one compiled program of the forward and the backward, run twice
    def program(q, k, weights, k_scale):
        out, vjp = jax.vjp(sparse, q, k, weights, k_scale)
        return out, vjp(jnp.where(jnp.isfinite(out), 1.0, 0.0).astype(out.dtype))

    runs = []
    for _ in range(2):
        out, grads = program(q, k, weights, k_scale)
        runs.append([support.bits(a) for a in (out, *grads)])
    for first, second in zip(*runs):
        assert np.array_equal(first, second)


def test_window_prototype_is_the_gathered_score_and_its_gradient():
    """Issue 42's prototype (``benchmarks/sparse_window.py``: a dense window per q tile, stragglers
    gathered, a custom VJP), in interpret mode at a shape with stragglers and a window: its score equal
    to a gather and einsums in float32, the error norms of dq, dk and dweights within 1e-2 of the
    reference's (the script's own check; it exits 1 otherwise)."""
    done = subprocess.run(
        [sys.executable, "benchmarks/sparse_window.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "at most 16 stragglers a query" in done.stdout


def test_route_stages_runs_every_part_of_the_dense_route():
    """``benchmarks/route_stages.py``, the chip's account of the dense route (its whole against the dense
    score's and its parts), runs all seven programs in interpret mode at a small shape."""
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/route_stages.py",
            "--interpret",
            "--shape",
            "256,256,16",
            "--heads",
            "16",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("S 256, W 256, top_k 16, ")]
    assert len(rows) == 7 and all(line.endswith(" ms") for line in rows), done.stdout
