"""``score_topk``: each query's top_k blocks and scores without the [B, S, W] array and without a sort of W.

Checked against an independent selection (NumPy's sort of the dense scores, ties to the lower block)
and against ``topk_indices(score(...))``, bit for bit, on random, causal, packed and windowed masks with
ties and rows that see fewer than top_k blocks; its gradient against the dense score's at the selected
entries; and, lowered for the TPU at S = 65,536, W = 16,384, the program it builds: no array of S x W
elements and no sort wider than W / 4.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.lib.mlir import ir

from codegen import hlo_audit
from generated.csa_v4 import VARIANTS, topk_indices
from generated.csa_v4 import _topk as topk_module
from tests import support

SMALL = sorted(n for n in VARIANTS if "_q16_w128_" in n and not n.endswith("refbwd"))
FP8 = "tpu_sm_fp8_q256_w2048c512f256_hcall"
# score_topk's selection against the dense one: every pair of q layout, dtype and head chunking once
# (each layout with both dtypes and both chunkings, each dtype with both of the others), and float8.
PAIRWISE = [
    "tpu_hm_bf16_q16_w128_hc16", "tpu_hm_f32_q16_w128_hcall", "tpu_sm_bf16_q16_w128_hcall", "tpu_sm_f32_q16_w128_hc16"
]  # fmt: skip
# On the chip: one variant per q layout and dtype kind (float32, bfloat16, float8 with its scales).
ON_CHIP = {"tpu_hm_f32_q16_w128_hcall", "tpu_sm_bf16_q16_w128_hc16", FP8}


def _chip_marked(names):
    return [pytest.param(n, marks=pytest.mark.chip) if n in ON_CHIP else n for n in names]


def _numpy_topk(scores, top_k):
    """Per row, the top_k finite entries by value (+0.0 above -0.0, as ``lax.top_k`` orders them), a
    tie to the lower index: (indices, values), -1 and -inf past the finite ones."""
    scores = np.asarray(scores.astype(jnp.float32))
    *lead, width = scores.shape
    rows = scores.reshape(-1, width)
    index = np.full((rows.shape[0], top_k), -1, np.int64)
    for r, row in enumerate(rows):
        finite = np.flatnonzero(np.isfinite(row))
        order = np.lexsort((finite, np.signbit(row[finite]), -row[finite]))[:top_k]
        index[r, : len(order)] = finite[order]
    index = index.reshape(*lead, top_k)
    values = np.where(index >= 0, np.take_along_axis(scores, np.maximum(index, 0), axis=-1), -np.inf)
    return index, values


def _call(module, q, k, weights, top_k, working_bytes=topk_module.DEFAULT_WORKING_BYTES, **arrays):
    """``score_topk`` under ``jax.jit`` (interpret mode off the chip), with the key scale its variant needs."""
    arrays = {**support.key_scale(module.VARIANT, k), **arrays}

    def run(q, k, w, arrays):
        return module.score_topk(
            q, k, w, top_k, **arrays, working_bytes=working_bytes, interpret=support.INTERPRET
        )

    return jax.jit(run)(q, k, weights, arrays)


@pytest.mark.parametrize("name", _chip_marked(PAIRWISE + ["tpu_sm_bf16_q16_w128_hc16", FP8]))
def test_score_topk_is_the_dense_selection_bit_for_bit(name):
    module = VARIANTS[name]
    shape = (4, 16, 40, 128, 300)
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed=1)
    if module.VARIANT["q_dtype"] == "bfloat16":  # a coarse grid of q makes many equal scores: ties
        q = (q * 2).round().astype(q.dtype) / 2
    kv_start, kv_end = support.mask_batch(shape[2], shape[4], seed=2)
    bounds = dict(kv_start=kv_start, kv_end=kv_end)
    dense = support.call(module, q, k, weights, **bounds, interpret=support.INTERPRET)
    for top_k in (1, 7, 64, 400):  # 400 > W: every visible block, then -1 slots
        # a small working set forces several query chunks, the last one ragged
        index, values = _call(module, q, k, weights, top_k, **bounds, working_bytes=16 * 300 * 4 * 6 * 4)
        assert index.dtype == jnp.int32 and values.dtype == dense.dtype
        assert index.shape == values.shape == (4, 40, top_k)
        expected_index, expected_values = _numpy_topk(dense, top_k)
        np.testing.assert_array_equal(np.asarray(index), expected_index)
        np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), expected_values)
        np.testing.assert_array_equal(np.asarray(index), np.asarray(topk_indices(dense, top_k)))
    # some rows see fewer than 7 blocks (and some none), some tie: the cases this is about
    counts = np.isfinite(np.asarray(dense.astype(jnp.float32))).sum(-1)
    assert (counts == 0).any() and ((counts > 0) & (counts < 7)).any()


@pytest.mark.parametrize("name", _chip_marked(["tpu_hm_f32_q16_w128_hcall", "tpu_sm_bf16_q16_w128_hc16"]))
@pytest.mark.parametrize("seq_len, tiled", [(48, True), (40, False)])
def test_score_topk_reads_q_in_place_where_chunks_tile_s(name, seq_len, tiled):
    """Chunks of whole q blocks that tile S read q where it lies, in either layout (the forward's q block
    index moves by the chunk's first block, scalar-prefetched): no chunk of q is sliced out, and the
    selection is the dense one bit for bit. A ragged S (the last chunk overlaps the one before) scores
    slices of q."""
    module = VARIANTS[name]
    in_place = tiled
    shape = (4, 16, seq_len, 128, 300)
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed=3)
    kv_start, kv_end = support.mask_batch(seq_len, shape[4], seed=4)
    bounds = dict(kv_start=kv_start, kv_end=kv_end)
    working_bytes = 4 * 300 * 4 * 6 * 16  # 16 queries a chunk: three chunks, the last ragged at S 40
    index, values = _call(module, q, k, weights, 64, **bounds, working_bytes=working_bytes)
    expected_index, expected_values = _numpy_topk(
        support.call(module, q, k, weights, **bounds, interpret=support.INTERPRET), 64
    )
    np.testing.assert_array_equal(np.asarray(index), expected_index)
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), expected_values)
    jaxpr = str(
        jax.make_jaxpr(lambda q: _call(module, q, k, weights, 64, **bounds, working_bytes=working_bytes))(q)
    )
    q_chunk = list(q.shape)
    q_chunk[2 if module.VARIANT["q_layout"] == "head_major" else 1] = 16
    sliced = (
        f"{jnp.dtype(q.dtype).name.replace('bfloat16', 'bf16').replace('float32', 'f32')}{q_chunk}".replace(
            " ", ""
        )
    )
    assert (sliced + " = dynamic_slice" in jaxpr.replace(", ", ",")) is not in_place


@pytest.mark.chip
@pytest.mark.parametrize("top_k", [64, 512])
def test_score_topk_selects_chunks_scored_transposed(top_k):
    """Where head-major chunks are read in place in q blocks of 128 queries or more, the forward writes
    each chunk's score transposed, [B, W, chunk], and the selection kernel takes it as it stands: no
    XLA transpose of the score (nor of the selection: the kernel writes [rows, top_k]), and the
    selection is the dense one bit for bit, over four batch rows and two chunks."""
    module = VARIANTS["tpu_hm_bf16_q256_w2048c512f256_hcall"]
    shape = (4, 4, 512, 128, 300)  # two chunks of 256 queries, one q block each
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed=5)
    kv_start, kv_end = support.mask_batch(shape[2], shape[4], seed=6)
    bounds = dict(kv_start=kv_start, kv_end=kv_end)
    working_bytes = 4 * 300 * 4 * 6 * 256
    index, values = _call(module, q, k, weights, top_k, **bounds, working_bytes=working_bytes)
    expected_index, expected_values = _numpy_topk(
        support.call(module, q, k, weights, **bounds, interpret=support.INTERPRET), top_k
    )
    np.testing.assert_array_equal(np.asarray(index), expected_index)
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), expected_values)

    def score_transposed_by_xla(working_bytes):  # a [W, rows] transpose of a chunk's score
        call = functools.partial(
            _call, module, k=k, weights=weights, top_k=top_k, working_bytes=working_bytes
        )
        return re.search(r"bf16\[300,\d+\] = transpose", str(jax.make_jaxpr(lambda q: call(q, **bounds))(q)))

    assert not score_transposed_by_xla(working_bytes)
    assert score_transposed_by_xla(working_bytes // 2)  # chunks of 128: not whole q blocks, so not in place


@pytest.mark.parametrize(
    "dtype, rows, width, top_k",
    [
        (jnp.bfloat16, 64, 300, 512),  # top_k beyond W: the slots past W are -1
        (jnp.float32, 130, 1000, 100),  # a partial block of rows, W not whole vregs
        pytest.param(jnp.bfloat16, 1024, 2048, 512, marks=pytest.mark.chip),  # the production rows
        pytest.param(jnp.float32, 256, 8192, 1024, marks=pytest.mark.chip),
    ],
)
def test_select_kernel_is_the_exact_top_k(dtype, rows, width, top_k):
    """The in-VMEM selection kernel (``_select``, what ``select`` takes where a row fits VMEM) against
    NumPy's sort: rows with random visible ranges and causal ones, ties (rounded scores), rows that see
    fewer blocks than top_k and rows that see none; the passes skip what no row of a block sees."""
    rng = np.random.default_rng(7)
    scores = rng.standard_normal((rows, width)).astype(np.float32)
    scores[:, ::5] = np.round(scores[:, ::5]) + 0.0  # ties (and no -0.0: its order is _numpy_topk's)
    start = rng.integers(0, width, rows)
    end = np.minimum(width, start + rng.integers(0, width + 1, rows))
    causal = np.arange(rows) % 2 == 0
    start[causal], end[causal] = 0, (np.arange(rows)[causal] + 1) * width // rows
    end[rows // 3] = start[rows // 3]  # a row that sees nothing
    column = np.arange(width)
    scores = np.where((column >= start[:, None]) & (column < end[:, None]), scores, -np.inf)
    x = jnp.asarray(scores, dtype)
    assert topk_module.selection_kernel(width, top_k, dtype) == "topk_select"
    bounds = (jnp.asarray(start, jnp.int32), jnp.asarray(end, jnp.int32))
    index, values = jax.jit(lambda x, a, b: topk_module.select(x, top_k, support.INTERPRET, "t", a, b))(
        x, *bounds
    )
    expected_index, expected_values = _numpy_topk(x, top_k)
    np.testing.assert_array_equal(np.asarray(index), expected_index)
    np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)), expected_values)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_select_orders_ties_zeros_and_non_finite_entries(dtype):
    # bfloat16 sorts one unique key (its score's bits and the slot), float32 a stable sort of the key
    key = jnp.zeros((1, 8), jnp.uint32)
    assert topk_module._order_keys(key, dtype, 8)[1] == (dtype == jnp.bfloat16)
    scores = jnp.array([[0.0, -0.0, 1.0, 1.0, -jnp.inf, jnp.nan, jnp.inf, -2.0, 0.0]], dtype)
    index, values = topk_module.select(scores, 8, interpret=True)
    np.testing.assert_array_equal(np.asarray(index), [[2, 3, 0, 8, 1, 7, -1, -1]])
    assert np.signbit(np.asarray(values)[0, 4]) and np.isneginf(np.asarray(values)[0, 6:]).all()
    np.testing.assert_array_equal(np.asarray(index), np.asarray(topk_indices(scores[None], 8))[0])


def test_bfloat16_scores_search_16_bits_to_the_same_threshold():
    """bfloat16 scores' keys differ in their top 16 bits only: the 16-pass search finds the threshold
    the 32-pass one does, for every wanted count (0, a tie, all visible) and signs, zeros and masks."""
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((6, 300)).astype(np.float32)
    scores[0, :150] = -np.abs(scores[0, :150])  # the threshold among negative scores
    scores[1] = np.round(scores[1])  # ties
    scores[2, ::3] = -np.inf  # masked
    scores[3, :] = -0.0
    scores[4, :250] = -np.inf  # fewer visible than wanted
    scores = jnp.asarray(scores, jnp.bfloat16)
    keys = topk_module._keys(scores)
    visible = jnp.sum(keys > 0, axis=-1, keepdims=True, dtype=jnp.int32)
    for top_k in (0, 1, 7, 64, 150, 300):
        wanted = jnp.minimum(visible, top_k)
        full = topk_module._threshold(keys, wanted)
        np.testing.assert_array_equal(np.asarray(topk_module._threshold(keys, wanted, 16)), np.asarray(full))
    assert topk_module.SIGNIFICANT_BITS[jnp.dtype(jnp.bfloat16)] == 16


@pytest.mark.chip
@pytest.mark.parametrize("dtype,width", [(jnp.bfloat16, 300), (jnp.float32, 2100)])
def test_threshold_kernel_is_the_search_in_xla(dtype, width):
    """The Pallas threshold kernel (interpreted) finds each row's threshold and visible count as the
    XLA search does: negative, tied, masked, signed-zero, NaN and nearly empty rows, a W off the lane
    tiles (padded), rows off the row block, and top_k from 1 to more than W."""
    rng = np.random.default_rng(1)
    scores = rng.standard_normal((13, width)).astype(np.float32)
    scores[0] = -np.abs(scores[0])
    scores[1] = np.round(scores[1])
    scores[2, ::3] = -np.inf
    scores[3] = -0.0
    scores[4, : width - 5] = -np.inf
    scores[5, 7] = np.nan
    scores = jnp.asarray(scores, dtype)
    keys = topk_module._keys(scores)
    visible = jnp.sum(keys > 0, axis=-1, keepdims=True, dtype=jnp.int32)
    bits = topk_module.SIGNIFICANT_BITS.get(jnp.dtype(dtype), 32)
    for top_k in (1, 7, 150, width + 1):
        t, count = topk_module.threshold(scores, top_k, interpret=support.INTERPRET)
        expected = topk_module._threshold(keys, jnp.minimum(visible, top_k), bits)
        np.testing.assert_array_equal(np.asarray(t), np.asarray(expected))
        np.testing.assert_array_equal(np.asarray(count), np.asarray(visible))


@pytest.mark.parametrize("width", [5000, 16384])
def test_threshold_kernel_skips_only_slices_no_row_of_a_block_sees(width):
    """Given the rows' visible blocks, the kernel's passes skip the slice groups no row of a block sees
    (``threshold_spans``, which the compiled cost reads too): the same thresholds and counts as with
    every slice read, on rows with windows, empty rows and a block of empty rows."""
    rng = np.random.default_rng(2)
    rows = 3 * topk_module.threshold_geometry(width)[3] + 5  # four blocks, the last one partial
    kv_start = rng.integers(0, width, rows)
    kv_end = kv_start + rng.integers(-50, width // 3, rows)
    block = topk_module.threshold_geometry(width)[3]
    kv_start[:block] = rng.integers(0, width // 4, block)  # the first block sees the first half at most
    kv_end[:block] = kv_start[:block] + rng.integers(0, width // 8, block)
    kv_end[block : 2 * block] = kv_start[block : 2 * block]  # the second block sees nothing
    scores = rng.standard_normal((rows, width)).astype(np.float32)
    w = np.arange(width)
    scores[(w < kv_start[:, None]) | (w >= kv_end[:, None])] = -np.inf
    spans = topk_module.threshold_spans(kv_start, kv_end, width)
    assert spans.shape == (4, 2) and tuple(spans[1]) == (0, 0) and (spans[:, 0] <= spans[:, 1]).all()
    group = topk_module.threshold_geometry(width)[1] * topk_module.threshold_geometry(width)[2]
    assert spans[0, 1] - spans[0, 0] < -(-width // group)  # something skipped, not only the empty block
    np.testing.assert_array_equal(
        np.asarray(topk_module.threshold_spans(jnp.asarray(kv_start), jnp.asarray(kv_end), width)), spans
    )
    scores = jnp.asarray(scores, jnp.bfloat16)
    for top_k in (1, 40, width + 1):
        got = topk_module.threshold(scores, top_k, True, "t", jnp.asarray(kv_start), jnp.asarray(kv_end))
        every = topk_module.threshold(scores, top_k, interpret=True)
        for a, b in zip(got, every):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.chip
@pytest.mark.parametrize("name", ["tpu_hm_f32_q16_w128_hcall", "tpu_sm_bf16_q16_w128_hc16"])
def test_score_topk_gradient_is_the_dense_scores_at_the_selection(name):
    module = VARIANTS[name]
    shape = (2, 16, 24, 128, 200)
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed=3)
    kv_start, kv_end = (x[:2] for x in support.mask_batch(shape[2], shape[4], seed=4))
    bounds = dict(kv_start=kv_start, kv_end=kv_end)
    top_k = 16
    cotangent = jax.random.normal(jax.random.PRNGKey(5), (2, 24, top_k), jnp.float32)
    index, _ = _call(module, q, k, weights, top_k, **bounds)

    def via_topk(q, k, weights):
        _, values = module.score_topk(q, k, weights, top_k, **bounds, interpret=support.INTERPRET)
        return jnp.sum(jnp.where(index >= 0, values.astype(jnp.float32) * cotangent, 0.0))

    def via_dense(q, k, weights):
        dense = module.score(q, k, weights, **bounds, interpret=support.INTERPRET).astype(jnp.float32)
        picked = jnp.take_along_axis(dense, jnp.maximum(index, 0), axis=-1)
        return jnp.sum(jnp.where(index >= 0, picked * cotangent, 0.0))

    got = jax.jit(jax.grad(via_topk, argnums=(0, 1, 2)))(q, k, weights)
    want = jax.jit(jax.grad(via_dense, argnums=(0, 1, 2)))(q, k, weights)
    for label, a, b in zip(("dq", "dk", "dweights"), got, want):
        assert a.dtype == b.dtype, label
        support.assert_close(f"{name} {label}", a, b.astype(jnp.float32))


def test_bad_calls_raise_before_tracing():
    module = VARIANTS[SMALL[0]]
    q, k, weights = support.make_inputs(module.VARIANT, (1, 16, 8, 128, 64), seed=0)
    for top_k in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="top_k must be a positive integer"):
            module.score_topk(q, k, weights, top_k, interpret=True)
    with pytest.raises(ValueError, match=r"working_bytes=100 holds less than one query's working set"):
        module.score_topk(q, k, weights, 4, working_bytes=100, interpret=True)


def _walk(module: ir.Module):
    """Every operation of every function of ``module``, nested regions included."""

    def ops(block):
        for op in block.operations:
            yield op
            for region in op.operation.regions:
                for inner in region.blocks:
                    yield from ops(inner)

    for fn in module.body.operations:
        for region in fn.operation.regions:
            for block in region.blocks:
                yield from ops(block)


@pytest.mark.parametrize("gradient", [False, True])
def test_no_score_array_and_no_wide_sort_at_s65536_w16384(gradient):
    """Lowered for the TPU (Mosaic's lowering runs; nothing executes) at the issue's shape, top_k 1024:
    no value of S x W elements or more anywhere in the program, the Pallas kernels' operands included,
    and no sort (rows of 16384 blocks fit the in-VMEM selection kernel, which sorts top_k itself; the
    gradient's sparse kernels sort nothing wider than W / 4); the forward's largest array is a query
    chunk's scores ([B, W, chunk], as the forward writes them for the selection kernel)."""
    name = "tpu_sm_bf16_q256_w2048c512f256_hc16"
    module = VARIANTS[name]
    batch, heads, seq_len, head_dim, num_blocks, top_k = 1, 64, 65536, 128, 16384, 1024
    v = module.VARIANT
    args = [
        jax.ShapeDtypeStruct((batch, seq_len, heads, head_dim), jnp.dtype(v["q_dtype"])),
        jax.ShapeDtypeStruct((batch, num_blocks, head_dim), jnp.dtype(v["k_dtype"])),
        jax.ShapeDtypeStruct((batch, seq_len, heads), jnp.dtype(v["weights_dtype"])),
        jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
        jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
    ]

    def forward(q, k, w, start, end):
        return module.score_topk(q, k, w, top_k, kv_start=start, kv_end=end)

    def loss(q, k, w, start, end):
        return jnp.sum(forward(q, k, w, start, end)[1].astype(jnp.float32))

    fn = jax.grad(loss, argnums=(0, 1, 2)) if gradient else forward
    lowered = support.lower_tpu(fn, *args).compiler_ir("stablehlo")
    chunk = topk_module.queries_per_chunk(batch, seq_len, num_blocks, block_q=v["block_q"])
    # 1280 x 16384 scores (five 256-query tiles), 6 words each, fit 512 MiB; S / 64 = 1024 tiles S evenly
    assert chunk == 1024
    assert topk_module.selection_kernel(num_blocks, top_k, v["out_dtype"]) == "topk_select"
    sorts, largest = [], 0  # largest: of the values with a W axis in their last two (a chunk's scores)
    for op in _walk(lowered):
        for value in list(op.operation.results) + list(op.operation.operands):
            info = hlo_audit._tensor(value)
            if info is not None:
                assert info[0] < seq_len * num_blocks, (op.operation.name, info[2])
                if num_blocks in ir.RankedTensorType(value.type).shape[-2:]:
                    largest = max(largest, info[0])
        if op.operation.name == "stablehlo.sort":
            sorts.append(ir.RankedTensorType(op.operation.operands[0].type).shape[-1])
        assert op.operation.name not in ("chlo.top_k", "stablehlo.top_k"), op.operation.name
    assert max(sorts, default=0) <= num_blocks // 4, sorts
    if not gradient:
        assert largest == batch * chunk * num_blocks, (largest, chunk)
