"""Where the dense forward's time goes, on a TPU: the production variants' causal forward timed whole,
and with one stage of its compute blocks replaced by something nearly free.

- "without the head sum": ``_contract_heads`` (relu, the head weights, the sum over heads: the VPU's
  work per logit) keeps the first head's logits only;
- "without the matmul": ``_logits`` is q's float32 values tiled along lanes, not q . k (no MXU);
- "without the mask": ``_kernel_ops.mask`` (the bounds' compare and select per score) is the scores.

The kernels then compute something else: the figures are times, not results. What a stage costs is
the whole less the time without it, as far as the others do not overlap it.

    python benchmarks/dense_stages.py [--shape B,H,S,D,W] [--variants A,B] [--interpret]

``--interpret`` runs each once in Pallas interpret mode on the CPU (a check of the replacements'
shapes; no times).

On a TPU v5e (JAX 0.10.2), S 8192, W 2048, causal, ms (measured):

    tpu_hm_bf16_q256_w2048c512f256_hcall  whole 0.967, without the head sum 0.963, without the matmul
                                      0.454, without the mask 0.969
    tpu_sm_bf16_q512_w2048c512_hc16   whole 1.400, without the head sum 1.395, without the matmul
                                      0.910, without the mask 1.386
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

PRODUCTION = ("tpu_hm_bf16_q256_w2048c512f256_hcall", "tpu_sm_bf16_q512_w2048c512_hc16")


def stages(jnp):
    """name -> {(owner, attribute): replacement}, owner "dense" (the variant's kernel module) or "ops"
    (its ``_kernel_ops``)."""
    no_head_sum = lambda logits, weights: logits[0]  # noqa: E731

    def no_matmul(cfg, q, k, heads):
        tiled = jnp.tile(q.astype(jnp.float32), (1, k.shape[0] // q.shape[1]))
        return tiled.reshape(heads, q.shape[0] // heads, k.shape[0])

    return {
        "whole": {},
        "without the head sum": {("dense", "_contract_heads"): no_head_sum},
        "without the matmul": {("dense", "_logits"): no_matmul},
        "without the mask": {("ops", "mask"): lambda block, x, kv_bounds_ref, fill: x},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1,64,8192,128,2048")
    parser.add_argument("--variants", default=",".join(PRODUCTION))
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from codegen.bench import median_ms

    if not args.interpret and jax.devices()[0].platform != "tpu":
        print(
            "dense_stages times the kernels on a TPU; this machine has none (see --interpret)",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, "generated")
    import csa_v4

    batch, heads, seq_len, head_dim, width = map(int, args.shape.split(","))
    for name in args.variants.split(","):
        module = csa_v4.VARIANTS[name]
        owners = {"dense": module._dense, "ops": module._dense._kernel_ops}  # the variant's kernel module
        rng = np.random.default_rng(0)
        hm = module.VARIANT["q_layout"] == "head_major"
        q_shape = (batch, heads, seq_len, head_dim) if hm else (batch, seq_len, heads, head_dim)
        q = jnp.asarray(rng.standard_normal(q_shape), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((batch, width, head_dim)), jnp.bfloat16)
        weights = jnp.asarray(rng.standard_normal((batch, seq_len, heads)), jnp.bfloat16)
        positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
        kv_start, kv_end = csa_v4.causal_kv_range(positions)
        for stage, replaced in stages(jnp).items():
            with contextlib.ExitStack() as patches:
                for (owner, attribute), value in replaced.items():
                    patches.enter_context(mock.patch.object(owners[owner], attribute, value))

                def score(q, k, w, s, e):  # a new function each stage: jax.jit would reuse the last one's
                    return module.score(q, k, w, kv_start=s, kv_end=e, interpret=args.interpret)

                fn = jax.jit(score)
                if args.interpret:
                    jax.block_until_ready(fn(q, k, weights, kv_start, kv_end))
                    print(f"{name} {stage}: ran", flush=True)
                else:
                    ms = median_ms(fn, (q, k, weights, kv_start, kv_end), 5)
                    print(f"{name}, S {seq_len}, W {width}, causal, {stage}: {ms:.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
