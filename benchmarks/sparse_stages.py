"""Where the sparse kernels' time goes, on a TPU: each kernel timed whole, without its row gather,
without its dk scatter-add, and without both.

The gather (``_gather.gather_rows``) and the scatter-add (``_gather.scatter_add_rows``) are replaced by
nothing before tracing, so the kernels compute on whatever the scratch holds: the figures are times,
not results. The forward is timed alone; "gradient" is the backward kernel alone (the VJP of the
sparse score, whose forward output is unused and so not run). Indices are uniform over W (duplicates
allowed), which costs the kernels what any selection of as many slots does.

    python benchmarks/sparse_stages.py [--variant NAME] [--shape S,W,TOP_K ...]

On a TPU v5e (JAX 0.10.2), tpu_sm_bf16_q512_w2048c512_hc16, ms (measured; at top_k 128 this script
measured the gradient rows again as 7.09, 5.65, 5.08 and 2.57):

    S 8192, W 2048, top_k 128   forward 2.90, without the gather 0.56; gradient 7.18, without the
                                gather 5.67, without the scatter 5.07, without both 2.51
    S 16384, W 8192, top_k 512  forward 13.35, without the gather 1.38; gradient 36.99, without the
                                gather 27.19, without the scatter 22.21, without both 6.97
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

NOTHING = lambda *args, **kwargs: None  # noqa: E731 - a stage left out
STAGES = {  # name: the _gather functions replaced by nothing
    "whole": (),
    "without the gather": ("gather_rows",),
    "without the scatter": ("scatter_add_rows",),
    "without both": ("gather_rows", "scatter_add_rows"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="tpu_sm_bf16_q512_w2048c512_hc16")
    parser.add_argument("--shape", nargs="*", default=["8192,2048,128", "16384,8192,512"])
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from codegen.bench import median_ms

    if jax.devices()[0].platform != "tpu":
        print("sparse_stages times the kernels on a TPU; this machine has none", file=sys.stderr)
        return 2
    sys.path.insert(0, "generated")
    import csa_v4
    from csa_v4 import _gather

    module = csa_v4.VARIANTS[args.variant]
    for shape in args.shape:
        seq_len, width, top_k = map(int, shape.split(","))
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((1, seq_len, 64, 128)), jnp.bfloat16)
        if module.VARIANT["q_layout"] == "head_major":
            q = jnp.swapaxes(q, 1, 2)
        k = jnp.asarray(rng.standard_normal((1, width, 128)), jnp.bfloat16)
        weights = jnp.asarray(rng.standard_normal((1, seq_len, 64)), jnp.bfloat16)
        indices = jnp.asarray(rng.integers(0, width, (1, seq_len, top_k)), jnp.int32)
        cotangent = jnp.ones((1, seq_len, top_k), jnp.dtype(module.VARIANT["out_dtype"]))
        for stage, removed in STAGES.items():
            with contextlib.ExitStack() as patches:
                for name in removed:
                    patches.enter_context(mock.patch.object(_gather, name, NOTHING))
                # a new function each stage: jax.jit would reuse the last one's program
                sparse = lambda q, k, w, i: module.sparse_score(q, k, w, i, route="sparse")  # noqa: E731
                gradient = jax.jit(
                    lambda q, k, w, i: jax.vjp(lambda *a: sparse(*a, i), q, k, w)[1](cotangent)
                )
                times = [f"gradient {median_ms(gradient, (q, k, weights, indices), 3):.2f}"]
                if "scatter_add_rows" not in removed:  # the forward has no scatter-add
                    times.insert(0, f"forward {median_ms(jax.jit(sparse), (q, k, weights, indices), 5):.2f}")
            print(f"S {seq_len}, W {width}, top_k {top_k}, {stage}: {', '.join(times)} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
