"""The gradient error of each ``grad_matmul`` mode (dtype policy) and cotangent route, against float64.

The backward kernels multiply a float32 factor with bfloat16 k (for dq) or the stacked bfloat16 q
(for dk) on the MXU. dq is always the masked cotangent by k, u = (g where the logit is positive) . k,
with the head weights and q applied to u once (``_kernel_ops.masked_cotangent_by_k``,
``dq_dweights_from_u``). Where the cotangent is exact in bfloat16 (a bfloat16 score:
``Config.exact_cotangent``, every production variant), that is one exact pass, and dk takes the
weights on q (w_h * q, float32). Where it is not (a float32 score, or a key scale folded into it),
``split`` sends g as a bfloat16 head and tail (two exact passes) and ``bf16`` rounds it (one), and dk's
factor is dlogits = g * w_h where the logit is positive, split or rounded the same way. This runs the
shipped ``_kernel_ops`` functions on the kernels' own operands (heads stacked, causal mask applied) and
reports the relative Frobenius error of dq, dk and dweights against float64, before and after the
bfloat16 rounding of the returned gradient, beside the error that rounding alone makes. An error at
float32's level prints as the bound ``<1e-05``: its digits depend on the CPU's float32 summation order.

    python benchmarks/grad_matmul_error.py [--seq-len S] [--blocks W] [--heads H]

The default is DeepSeek-V4's heads and head dim (64 x 128) at S = 2048, W = 512, causal at compress
rate 4: the error is per element of dlogits, so a longer sequence changes it little, and the float64
reference of the full V4 shape (8192 x 2048) does not fit a CI machine.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

# The table is the CPU's float32 arithmetic (a TPU's default matmul precision would be another
# table); and with libtpu installed, JAX would otherwise probe for a TPU and log that it found none.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from generated.csa_v4 import _helpers, _kernel_ops  # noqa: E402


def rel(x, ref) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


# Below this an error is float32's own (at least 100x under bfloat16's rounding, ~1.7e-3 here), and its
# digits are the float32 matmuls' summation order, which differs between CPUs and XLA versions (a
# split f32 g's dk: 2.46e-06 on one x86 machine, 2.62e-06 on another): it prints as the bound.
FLOAT32_LEVEL = 1e-5


def fmt(error: float) -> str:
    """Three digits where bfloat16 rounding sets the error (the same on every machine); a float32-level
    error as the bound ``<1e-05``, the same on every machine."""
    return f"{error:.2e}" if error >= FLOAT32_LEVEL else f"   <{FLOAT32_LEVEL:.0e}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    H, S, D, W = args.heads, args.seq_len, args.head_dim, args.blocks
    kq, kk, kw, kg = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (H * S, D), jnp.bfloat16)  # heads stacked along rows, as the kernels do
    k = jax.random.normal(kk, (W, D), jnp.bfloat16)
    weights = jax.random.normal(kw, (H, S, 1), jnp.bfloat16).astype(jnp.float32)
    visible = np.arange(W)[None, :] < ((np.arange(S) + 1) // _helpers.COMPRESS_RATE)[:, None]
    g32 = jnp.where(visible, jax.random.normal(kg, (S, W), jnp.float32), 0.0)  # masked entries: no gradient
    cotangents = {"bf16 g": g32.astype(jnp.bfloat16).astype(jnp.float32), "f32 g": g32}

    logits = jnp.dot(q, k.T, preferred_element_type=jnp.float32).reshape(H, S, W)  # exact products
    print(
        f"H, S, D, W = {H}, {S}, {D}, {W}; causal, compress rate {_helpers.COMPRESS_RATE}; bf16 q, k, weights"
    )
    print("relative Frobenius error against float64: float32 result / returned in bfloat16 (rounding alone)")
    print(
        f"<{FLOAT32_LEVEL:.0e}: float32-accurate (the digits below that depend on the CPU's summation order)"
    )
    for route, g in cotangents.items():
        exact = route == "bf16 g"
        ref = reference(logits, g, weights, q, k)
        rounded_ref = {
            n: rel(np.asarray(jnp.asarray(r, jnp.float32).astype(jnp.bfloat16)), r) for n, r in ref.items()
        }
        for mode in ("split", "bf16"):
            parts = 1 if exact or mode == "bf16" else 2
            cfg = SimpleNamespace(
                grad_matmul=mode, precision=None, exact_cotangent=exact, cotangent_parts=parts
            )
            parts_of_g = _kernel_ops.cotangent_parts(cfg, g, k.dtype)
            u = _kernel_ops.masked_cotangent_by_k(cfg, logits, parts_of_g, k)
            dq, dweights = _kernel_ops.dq_dweights_from_u(u, q, weights)
            out = {"dq": dq, "dk": _kernel_ops.dk(cfg, logits, g, weights, q), "dweights": dweights[..., 0]}
            cells = [
                f"{n} {fmt(rel(x, ref[n]))} / {fmt(rel(x.astype(jnp.bfloat16), ref[n]))} ({fmt(rounded_ref[n])})"
                for n, x in out.items()
            ]
            print(f"  {route:6s} {mode:5s}  " + "   ".join(cells))


def reference(logits, g, weights, q, k) -> dict[str, np.ndarray]:
    """dq, dk and dweights in float64 from the same (exact) logits."""
    l64, g64, w64 = (np.asarray(a, np.float64) for a in (logits, g, weights))
    d64 = np.where(l64 > 0.0, g64 * w64, 0.0).reshape(-1, l64.shape[2])
    q64, k64 = (np.asarray(a, np.float64) for a in (q, k))
    return {"dq": d64 @ k64, "dk": d64.T @ q64, "dweights": np.sum(np.maximum(l64, 0.0) * g64, axis=2)}


if __name__ == "__main__":
    main()
