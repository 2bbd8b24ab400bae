"""Where the dense route's forward + gradient goes, on a TPU: ``sparse_score(route="dense")`` timed
whole, beside the dense score's own forward + gradient and the route's parts, each as a program of its
own.

The route is the dense score over each query's span of selected blocks, ``_take.take`` of the
selected slots, and, in the gradient, the take's transpose (``put``: the slots' cotangent back in a
``[B, S, W]`` one) and the dense backward reading it. ``codegen bench`` timed the whole at 7.43 ms at
S 8192 / W 2048 / top_k 512, where the dense score's forward + gradient (4.76) and the take and its
transpose alone (0.20 and 0.92, in an earlier probe) add up to about 5.9: the rows below say which part
grows inside the route. Indices are the causal top_k of the variant's own scores, as `codegen bench`
makes them.

    python benchmarks/route_stages.py [--variant NAME] [--shape S,W,TOP_K ...]
    python benchmarks/route_stages.py --interpret --shape 256,256,16   # CPU: runs, times nothing real
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="tpu_sm_bf16_q256_w2048c512f256_hc16")
    parser.add_argument("--shape", nargs="*", default=["8192,2048,512", "16384,8192,512"])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (no TPU needed)")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from codegen.bench import median_ms, with_gradient

    if jax.devices()[0].platform != "tpu" and not args.interpret:
        print(
            "route_stages times the kernels on a TPU; this machine has none (--interpret runs them)",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, "generated")
    import csa_v4
    from csa_v4 import _take

    module = csa_v4.VARIANTS[args.variant]
    variant, interpret = module.VARIANT, args.interpret
    samples = 1 if interpret else 5
    for shape in args.shape:
        seq_len, width, top_k = map(int, shape.split(","))
        rng = np.random.default_rng(0)
        normal = lambda *shape, dtype: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(
            dtype
        )  # noqa: E731
        q = normal(1, seq_len, args.heads, 128, dtype=variant["q_dtype"])
        if variant["q_layout"] == "head_major":
            q = jnp.swapaxes(q, 1, 2)
        k = normal(1, width, 128, dtype=variant["k_dtype"])
        weights = normal(1, seq_len, args.heads, dtype=variant["weights_dtype"])
        k_scale = jnp.ones((1, width), jnp.float32) if variant["k_scale"] else None
        out_dtype = jnp.dtype(variant["out_dtype"])

        def score(q, k, w, kv_start, kv_end):
            return module.score(
                q, k, w, kv_start=kv_start, kv_end=kv_end, k_scale=k_scale, interpret=interpret
            )

        causal = csa_v4.causal_kv_range(jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (1, seq_len)))
        indices = csa_v4.topk_indices(jax.jit(score)(q, k, weights, *causal), top_k)
        span = _take.span(indices, width)  # what the route scores: each query's selected blocks' span
        ones_w = jnp.ones((1, seq_len, width), out_dtype)
        ones_k = jnp.ones((1, seq_len, top_k), out_dtype)
        transpose = lambda g, i: jax.vjp(lambda s: _take.take(s, i, interpret), ones_w)[1](g)[0]  # noqa: E731
        put = jax.jit(transpose)(ones_k, indices)  # the cotangent the route's dense backward reads
        route = lambda q, k, w, i: module.sparse_score(  # noqa: E731
            q, k, w, i, k_scale=k_scale, route="dense", interpret=interpret
        )
        rows = [
            ("the route, forward + gradient", with_gradient(route), (q, k, weights, ones_k, indices)),
            (
                "the dense score, causal, forward + gradient",
                with_gradient(score),
                (q, k, weights, ones_w, *causal),
            ),
            ("the same over the route's span", with_gradient(score), (q, k, weights, ones_w, *span)),
            ("the same, the put's cotangent", with_gradient(score), (q, k, weights, put, *span)),
            ("the route, forward", route, (q, k, weights, indices)),
            ("the take", lambda s, i: _take.take(s, i, interpret), (ones_w, indices)),
            ("its transpose", transpose, (ones_k, indices)),
        ]
        for name, fn, inputs in rows:
            ms = median_ms(jax.jit(fn), inputs, samples)
            print(f"S {seq_len}, W {width}, top_k {top_k}, {name}: {ms:.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
