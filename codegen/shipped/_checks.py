"""The call contract: every check of a call's arguments, on shapes and dtypes, before anything is
traced. A wrong argument is a ValueError that names it; what passes comes back completed (int32
bounds, the default scale). Nothing here touches an array's values."""

import operator

import jax.numpy as jnp

from . import _family

DEFAULT_SOFTMAX_SCALE = _family.DEFAULT_SOFTMAX_SCALE  # None: head_dim ** -0.5, taken from q at call time


def q_dims(q, q_layout):
    """(batch, num_heads, seq_len, head_dim) of q in ``q_layout``."""
    if q_layout == "head_major":
        batch, num_heads, seq_len, head_dim = q.shape
    else:
        batch, seq_len, num_heads, head_dim = q.shape
    return batch, num_heads, seq_len, head_dim


def check_inputs(q, k, weights, variant):
    """Raises ValueError naming the argument whose rank, shape or dtype does not fit ``variant``."""
    q_layout = "[B, H, S, D]" if variant["q_layout"] == "head_major" else "[B, S, H, D]"
    for name, array, layout in (("q", q, q_layout), ("k", k, "[B, W, D]"), ("weights", weights, "[B, S, H]")):
        if not hasattr(array, "shape") or not hasattr(array, "dtype"):
            raise ValueError(f"{name} must be an array {layout}, got {type(array).__name__}")
        if array.ndim != layout.count(",") + 1:
            raise ValueError(
                f"{name} must have rank {layout.count(',') + 1} {layout}, got shape {tuple(array.shape)}"
            )
    for name, array in (("q", q), ("k", k), ("weights", weights)):
        dtype = variant[f"{name}_dtype"]
        if array.dtype != jnp.dtype(dtype):
            raise ValueError(f"{name} must be {dtype} for variant {variant['name']}, got {array.dtype}")
    batch, num_heads, seq_len, head_dim = q_dims(q, variant["q_layout"])
    if seq_len < 1 or num_heads < 1 or head_dim < 1:
        raise ValueError(f"q must have at least one query, head and feature, got shape {tuple(q.shape)}")
    if k.shape[0] != batch or k.shape[2] != head_dim or k.shape[1] < 1:
        raise ValueError(
            f"k must be [B={batch}, W>=1, D={head_dim}] to match q {tuple(q.shape)}, got shape {tuple(k.shape)}"
        )
    if tuple(weights.shape) != (batch, seq_len, num_heads):
        other = "seq_major" if variant["q_layout"] == "head_major" else "head_major"
        b, h, s, _ = q_dims(q, other)
        if tuple(weights.shape) == (b, s, h):  # q fits the other layout: say so, not that weights is wrong
            raise ValueError(
                f"q {tuple(q.shape)} looks {other}, but variant {variant['name']} is {variant['q_layout']}: it "
                f"takes q as {q_layout}; transpose q (jnp.swapaxes(q, 1, 2)) or use a {other} variant"
            )
        raise ValueError(
            f"weights must be [B={batch}, S={seq_len}, H={num_heads}] to match q {tuple(q.shape)}, "
            f"got shape {tuple(weights.shape)}"
        )
    chunk = variant["head_chunk"]
    if chunk and num_heads % chunk:
        raise ValueError(
            f"q has {num_heads} heads, which head_chunk {chunk} of variant {variant['name']} does not divide"
        )


def check_scale(softmax_scale):
    """The scale is static (it is baked into the kernel): a positive, finite Python number."""
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise ValueError(f"softmax_scale must be a positive Python float, got {softmax_scale!r}") from None
    if not 0.0 < scale < float("inf"):
        raise ValueError(f"softmax_scale must be positive and finite, got {scale}")
    return scale


def check_kv_bound(name, bound, shape, default):
    """An integer [B, S] visibility bound as int32; ``default`` everywhere when None."""
    if bound is None:
        return jnp.full(shape, default, jnp.int32)
    if not hasattr(bound, "shape") or not hasattr(bound, "dtype"):
        raise ValueError(f"{name} must be an integer array [B, S], got {type(bound).__name__}")
    if tuple(bound.shape) != shape:
        raise ValueError(
            f"{name} must be [B={shape[0]}, S={shape[1]}] to match q, got shape {tuple(bound.shape)}"
        )
    if not jnp.issubdtype(bound.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array (int32), got {bound.dtype}")
    return jnp.asarray(bound, jnp.int32)


def check_k_scale(k_scale, shape, variant):
    """float32 [B, W] per-token key scales, required by variants whose keys carry one and refused by
    the others (passing one there is a mistake, not something to ignore)."""
    if not variant["k_scale"]:
        if k_scale is not None:
            raise ValueError(
                f"k_scale applies to float8 variants only; variant {variant['name']} stores k as {variant['k_dtype']}"
            )
        return None
    if k_scale is None:
        raise ValueError(
            f"k_scale is required by variant {variant['name']}: its float8 keys carry a per-token scale"
        )
    if not hasattr(k_scale, "shape") or tuple(k_scale.shape) != tuple(shape) or k_scale.dtype != jnp.float32:
        raise ValueError(
            f"k_scale must be float32 [B={shape[0]}, W={shape[1]}] to match k, got "
            f"{getattr(k_scale, 'dtype', type(k_scale).__name__)} {tuple(getattr(k_scale, 'shape', ()))}"
        )
    return k_scale


def check_call(variant, q, k, weights, kv_start, kv_end, k_scale, softmax_scale):
    """Raises ValueError naming the argument that does not fit ``variant``; returns ``(kv_start, kv_end,
    k_scale, softmax_scale)`` completed: int32 bounds (the defaults filled in) and the scale as a float."""
    check_inputs(q, k, weights, variant)
    batch, _, seq_len, _ = q_dims(q, variant["q_layout"])
    kv_start = check_kv_bound("kv_start", kv_start, (batch, seq_len), 0)
    kv_end = check_kv_bound("kv_end", kv_end, (batch, seq_len), k.shape[1])
    k_scale = check_k_scale(k_scale, k.shape[:2], variant)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5 if DEFAULT_SOFTMAX_SCALE is None else DEFAULT_SOFTMAX_SCALE
    return kv_start, kv_end, k_scale, check_scale(softmax_scale)


def check_top_k(top_k):
    """top_k as a static positive int (a Python or NumPy integer, not a bool); ValueError otherwise."""
    try:
        value = operator.index(top_k)
    except TypeError:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}") from None
    if isinstance(top_k, bool) or value < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    return value


def check_indices(indices, batch, seq_len):
    """Integer ``[B, S, top_k]`` indices (top_k >= 1) as int32; ValueError naming what does not fit."""
    if not hasattr(indices, "shape") or not hasattr(indices, "dtype"):
        raise ValueError(f"indices must be an integer array [B, S, top_k], got {type(indices).__name__}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"indices must be an integer array (int32) [B, S, top_k], got {indices.dtype}")
    if indices.ndim != 3 or tuple(indices.shape[:2]) != (batch, seq_len) or indices.shape[2] < 1:
        raise ValueError(
            f"indices must be [B={batch}, S={seq_len}, top_k>=1] to match q, got shape {tuple(indices.shape)}"
        )
    return jnp.asarray(indices, jnp.int32)
