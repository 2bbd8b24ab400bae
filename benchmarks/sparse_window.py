"""A prototype of the sparse forward for selections neighbouring queries share (issue 42), timed on a TPU
against the dense forward and today's ``sparse_score``: not part of the generated kernels.

Per q tile of ``T`` queries, one dense window of ``Wd`` compressed blocks ending at the tile's largest
selected block (its start a multiple of 16), every head stacked into one matmul a piece; each query's
slots outside the window (its "stragglers", at most ``NS``) gathered row by row from k resident in VMEM
and contracted ``G`` queries a matmul (only its diagonal used); then each slot's score taken out of
[window scores | straggler scores] by a lane gather (``jnp.take_along_axis`` on 128 lanes, which
Mosaic lowers to ``tpu.dynamic_gather``; a source of more than one vreg along lanes does not lower,
so a slot's chunk is selected among the 128-lane chunks). XLA prepares, per tile, the window's start
and, per slot, its column; it compacts each query's stragglers with a sort.

    python benchmarks/sparse_window.py --check   # CPU, interpret mode: against a gather and einsums
    python benchmarks/sparse_window.py           # TPU: the shared selection of `codegen bench`

On a TPU v5e (JAX 0.10.2; the kernel and preparation of this script before its names were tidied),
B 1, H 64, D 128, causal, the shared selection (``bench.shared_selection``:
each query's last top_k - 16 visible blocks and 16 others; at most 16 stragglers a query), bf16, ms
(measured):

    S 8192, W 2048, top_k 128, window 128:   dense forward 0.877 (production hc16; 0.882 q512),
        sparse_score 2.944, prototype 1.273 (its kernel 0.925, XLA's preparation 0.364)
    S 16384, W 8192, top_k 512, window 512:  dense forward 3.953 (3.959), sparse_score 13.460,
        prototype 4.803 (its kernel 2.261, XLA's preparation 2.316)

Scores agree with the reference to the bit at both shapes.
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

T = 64  # queries a grid step
NS = 16  # straggler slots a query
G = 8  # queries a straggler matmul: G * NS = 128 lanes
PIECE = 256  # window columns a matmul, at most


def prepare(idx, num_blocks, wd, compact="sort"):
    """(window start per tile, int32 [B * S / T]; each slot's column in [window | stragglers], int32
    [B, S, top_k]; each query's stragglers compacted, NS a query, block 0 where fewer, flat int32; the
    most stragglers of any query: more than NS is not supported by the prototype).

    ``compact``: "sort", a cumulative count and a sort per query (what was measured), or "one-hot",
    the count as a matmul against a triangle of ones (0/1 in bfloat16 summed in float32: exact) and
    the compaction as a sum over the slots per straggler place (elementwise work, no sort; not yet
    timed on a chip)."""
    import jax
    import jax.numpy as jnp

    batch, seq_len, top_k = idx.shape
    tiles = seq_len // T
    valid = idx >= 0
    hi = jnp.max(jnp.where(valid, idx + 1, 0).reshape(batch, tiles, T * top_k), axis=2)
    lo = jnp.clip((hi - wd) // 16 * 16, 0, num_blocks - wd)
    lo_q = jnp.repeat(lo, T, axis=1)[:, :, None]
    in_window = valid & (idx >= lo_q) & (idx < lo_q + wd)
    straggler = valid & ~in_window
    if compact == "sort":
        rank = jnp.cumsum(straggler, axis=2, dtype=jnp.int32) - 1
    else:
        triangle = jnp.triu(jnp.ones((top_k, top_k), jnp.bfloat16))  # [j', j]: j' <= j
        counts = jnp.einsum(
            "bsk,kj->bsj", straggler.astype(jnp.bfloat16), triangle, preferred_element_type=jnp.float32
        )
        rank = counts.astype(jnp.int32) - 1
    in_group = (jnp.arange(seq_len, dtype=jnp.int32) % G)[None, :, None]
    column = jnp.where(in_window, idx - lo_q, jnp.where(straggler, wd + in_group * NS + rank, 0))
    if compact == "sort":
        key = jnp.where(straggler, rank, top_k + jnp.arange(top_k, dtype=jnp.int32)[None, None, :])
        _, rows = jax.lax.sort((key, jnp.where(straggler, idx, 0)), dimension=2, num_keys=1)
        rows = rows[:, :, :NS]
    else:
        place = straggler[..., None] & (rank[..., None] == jnp.arange(NS, dtype=jnp.int32))  # [B, S, K, NS]
        rows = jnp.sum(jnp.where(place, idx[..., None], 0), axis=2, dtype=jnp.int32)
    most = jnp.max(jnp.sum(straggler, axis=2))
    return lo.reshape(-1).astype(jnp.int32), column.astype(jnp.int32), rows.reshape(-1), most


def _kernel(lo_ref, rows_ref, q_ref, k_ref, w_ref, column_ref, out_ref, gathered_ref, *, wd, scale):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    b, i = pl.program_id(0), pl.program_id(1)
    lo = pl.multiple_of(lo_ref[b * pl.num_programs(1) + i], 16)
    _, heads, head_dim = q_ref.shape
    stacked = q_ref[...].reshape(T * heads, head_dim)
    weights = w_ref[...].astype(jnp.float32)[:, :, None]
    contract = (((1,), (1,)), ((), ()))
    chunks = []  # [T, 128] float32 scores: the window's, then the stragglers'
    piece = min(PIECE, wd)
    for p in range(wd // piece):
        keys = k_ref[pl.ds(lo + p * piece, piece), :].astype(jnp.bfloat16)
        logits = jax.lax.dot_general(stacked, keys, contract, preferred_element_type=jnp.float32)
        scores = jnp.sum(jnp.maximum(logits.reshape(T, heads, piece), 0.0) * weights, axis=1)
        chunks += [scores[:, c * 128 : (c + 1) * 128] for c in range(piece // 128)]
    groups = []
    for g in range(T // G):

        def gather(r, carry, g=g):
            for u in range(16):
                row = rows_ref[g * G * NS + r * 16 + u]
                gathered_ref[pl.ds(r * 16 + u, 1), :] = k_ref[pl.ds(row, 1), :]
            return carry

        jax.lax.fori_loop(0, G * NS // 16, gather, 0)
        queries = stacked[g * G * heads : (g + 1) * G * heads]
        logits = jax.lax.dot_general(
            queries, gathered_ref[...].astype(jnp.bfloat16), contract, preferred_element_type=jnp.float32
        )
        logits = logits.reshape(G, heads, G * NS)
        groups.append(jnp.sum(jnp.maximum(logits, 0.0) * weights[g * G : (g + 1) * G], axis=1))
    chunks.append(jnp.concatenate(groups, axis=0))
    column = column_ref[...]
    chunk, lane = column >> 7, column & 127
    out = jnp.zeros(column.shape, jnp.float32)
    for c, scores in enumerate(chunks):
        got = jnp.take_along_axis(scores, lane, axis=1, mode="promise_in_bounds")
        out = jnp.where(chunk == c, got, out)
    out_ref[...] = scale * out


def window_scores(q, k32, weights, lo, column, rows, wd, scale, interpret=False):
    """The prototype's pallas_call: q [B, S, H, D] bf16, k32 [B, W, D] float32 (resident)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    batch, seq_len, heads, head_dim = q.shape
    top_k, num_blocks, tiles = column.shape[2], k32.shape[1], seq_len // T
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, tiles),
        in_specs=[
            pl.BlockSpec((T * NS,), lambda b, i, lo: (b * tiles + i,), memory_space=pltpu.SMEM),
            pl.BlockSpec((None, T, heads, head_dim), lambda b, i, lo: (b, i, 0, 0)),
            pl.BlockSpec(
                (None, num_blocks, head_dim), lambda b, i, lo: (b, 0, 0), pipeline_mode=pl.Buffered(1)
            ),
            pl.BlockSpec((None, T, heads), lambda b, i, lo: (b, i, 0)),
            pl.BlockSpec((None, T, top_k), lambda b, i, lo: (b, i, 0)),
        ],
        out_specs=pl.BlockSpec((None, T, top_k), lambda b, i, lo: (b, i, 0)),
        scratch_shapes=[pltpu.VMEM((G * NS, head_dim), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_kernel, wd=wd, scale=scale),
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((batch, seq_len, top_k), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=100 * 2**20
        ),
        interpret=interpret,
    )(lo, rows, q, k32, weights, column)


def sparse_forward(q, k, weights, idx, wd, scale, interpret=False):
    """The prototype's sparse score, -inf at empty slots."""
    import jax.numpy as jnp

    lo, column, rows, _ = prepare(idx, k.shape[1], wd)
    out = window_scores(q, k.astype(jnp.float32), weights, lo, column, rows, wd, scale, interpret)
    return jnp.where(idx >= 0, out, -jnp.inf)


def reference(q, k, weights, idx, scale):
    """The same scores from a gather and two einsums, in float32."""
    import jax.numpy as jnp

    rows = jnp.take_along_axis(k[:, None], jnp.maximum(idx, 0)[..., None], axis=2)  # [B, S, top_k, D]
    logits = jnp.einsum(
        "bshd,bskd->bshk", q.astype(jnp.float32), rows.astype(jnp.float32), precision="highest"
    )
    w = weights.astype(jnp.float32)
    scores = scale * jnp.einsum("bsh,bshk->bsk", w, jnp.maximum(logits, 0.0), precision="highest")
    return jnp.where(idx >= 0, scores, -jnp.inf)


def shared_indices(seq_len, top_k, rng):
    """``bench.shared_selection`` of the causal bounds (rate 4), its slots in a random order."""
    from codegen.bench import shared_selection

    end = (np.arange(seq_len) + 1) // 4
    chosen = shared_selection(np.zeros((1, seq_len), np.int64), end[None], top_k)
    return np.take_along_axis(
        chosen, rng.permuted(np.tile(np.arange(top_k), (1, seq_len, 1)), axis=2), axis=2
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="CPU, interpret mode, a small shape")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from codegen.bench import median_ms

    if not args.check and jax.devices()[0].platform != "tpu":
        print(
            "sparse_window times the prototype on a TPU; this machine has none (see --check)", file=sys.stderr
        )
        return 2
    shapes = (
        [(1024, 256, 48, 128, 4)] if args.check else [(8192, 2048, 128, 128, 64), (16384, 8192, 512, 512, 64)]
    )
    for seq_len, num_blocks, top_k, wd, heads in shapes:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((1, seq_len, heads, 128)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((1, num_blocks, 128)), jnp.bfloat16)
        weights = jnp.asarray(rng.standard_normal((1, seq_len, heads)), jnp.bfloat16)
        idx = jnp.asarray(shared_indices(seq_len, top_k, rng), jnp.int32)
        lo, column, rows, most = jax.jit(prepare, static_argnums=(1, 2))(idx, num_blocks, wd)
        one_hot = jax.jit(prepare, static_argnums=(1, 2, 3))(idx, num_blocks, wd, "one-hot")
        assert all(np.array_equal(a, b) for a, b in zip((lo, column, rows, most), one_hot))
        got = jax.jit(sparse_forward, static_argnums=(4, 5, 6))(q, k, weights, idx, wd, 1.0, args.check)
        want = np.asarray(reference(q, k, weights, idx, 1.0))
        seen = np.isfinite(want)
        assert int(most) <= NS and (np.isfinite(np.asarray(got)) == seen).all()
        err = np.max(np.abs(np.asarray(got)[seen] - want[seen])) / np.max(np.abs(want[seen]))
        print(f"S {seq_len}, W {num_blocks}, top_k {top_k}, window {wd}: at most {int(most)} stragglers a "
              f"query, relative error {err:.1e}", flush=True)  # fmt: skip
        assert err < 1e-2
        if args.check:
            continue
        sys.path.insert(0, "generated")
        import csa_v4

        ks, ke = csa_v4.causal_kv_range(jnp.arange(seq_len, dtype=jnp.int32)[None])
        times = {}
        for name in ("tpu_sm_bf16_q256_w2048c512f256_hc16", "tpu_sm_bf16_q512_w2048c512_hc16"):
            module = csa_v4.VARIANTS[name]
            dense = functools.partial(lambda m, *a: m.score(*a[:3], kv_start=a[3], kv_end=a[4]), module)
            times[f"dense forward, {name}"] = median_ms(jax.jit(dense), (q, k, weights, ks, ke), 10)
        sparse = csa_v4.VARIANTS["tpu_sm_bf16_q512_w2048c512_hc16"].sparse_score
        times["sparse_score"] = median_ms(jax.jit(sparse), (q, k, weights, idx), 10)
        proto = jax.jit(sparse_forward, static_argnums=(4, 5))
        times["prototype"] = median_ms(proto, (q, k, weights, idx, wd, 1.0), 10)
        times["its preparation"] = median_ms(
            jax.jit(prepare, static_argnums=(1, 2)), (idx, num_blocks, wd), 10
        )
        times["its preparation, one-hot"] = median_ms(
            jax.jit(prepare, static_argnums=(1, 2, 3)), (idx, num_blocks, wd, "one-hot"), 10
        )
        kernel = jax.jit(window_scores, static_argnums=(6, 7))
        times["its kernel"] = median_ms(
            kernel, (q, k.astype(jnp.float32), weights, lo, column, rows, wd, 1.0), 10
        )
        for what, ms in times.items():
            print(f"  {what}: {ms:.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
