"""The pure-JAX definition of the CSA StreamIndex score: every generated variant is held to it.

    score[b, s, w] = softmax_scale * sum_h weights[b, s, h] * relu(q[b, h, s, :] . k[b, w, :])

Entries outside the visible range ``kv_start[b, s] <= w < kv_end[b, s]`` are ``masked_value`` and
get no gradient. The math is float32 at HIGHEST precision whatever the input dtypes, so a test
compares a kernel with the exact function of the (possibly rounded) inputs it was given.
This materialises ``[B, H, S, W]``: it is a definition, never a kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HEAD_MAJOR = "head_major"
SEQ_MAJOR = "seq_major"


def to_head_major(q: jax.Array, q_layout: str) -> jax.Array:
    """Returns q as ``[B, H, S, D]`` from either layout."""
    if q_layout == HEAD_MAJOR:
        return q
    if q_layout == SEQ_MAJOR:
        return jnp.swapaxes(q, 1, 2)
    raise ValueError(f"q_layout must be {HEAD_MAJOR!r} or {SEQ_MAJOR!r}, got {q_layout!r}")


def visible(kv_start: jax.Array | None, kv_end: jax.Array | None, num_blocks: int) -> jax.Array | None:
    """``[B, S, W]`` boolean: query (b, s) may see compressed block w. None when unmasked."""
    if kv_start is None and kv_end is None:
        return None
    w = jnp.arange(num_blocks, dtype=jnp.int32)
    mask = True
    if kv_start is not None:
        mask = mask & (w >= kv_start[..., None])
    if kv_end is not None:
        mask = mask & (w < kv_end[..., None])
    return mask


def score(
    q: jax.Array,
    k: jax.Array,
    weights: jax.Array,
    *,
    q_layout: str = HEAD_MAJOR,
    softmax_scale: float | None = None,
    kv_start: jax.Array | None = None,
    kv_end: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    masked_value: float = float("-inf"),
) -> jax.Array:
    """Returns the float32 ``[B, S, W]`` score; see the module docstring."""
    q = to_head_major(q, q_layout).astype(jnp.float32)
    k = k.astype(jnp.float32)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("bhsd,bwd->bhsw", q, k, precision=jax.lax.Precision.HIGHEST)
    activated = jax.nn.relu(logits)
    if k_scale is not None:
        activated = activated * k_scale.astype(jnp.float32)[:, None, None, :]
    out = softmax_scale * jnp.einsum(
        "bsh,bhsw->bsw",
        weights.astype(jnp.float32),
        activated,
        precision=jax.lax.Precision.HIGHEST,
    )
    mask = visible(kv_start, kv_end, k.shape[1])
    if mask is not None:
        out = jnp.where(mask, out, jnp.float32(masked_value))
    return out
