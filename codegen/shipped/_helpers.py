"""The family's functions for callers, beside each variant's own (the package re-exports them): its
variants by name, causal visible ranges, top-k selection from scores held, and the KL indexer loss
that every variant's ``indexer_loss`` computes over its ``score`` or ``sparse_score``."""

import difflib

import jax
import jax.numpy as jnp

from . import _family, _take
from ._checks import check_indices, check_inputs, check_kv_bound, check_top_k, q_dims
from ._kernel_ops import ACCUM_DTYPE
from ._operands import pad_to

COMPRESS_RATE = _family.COMPRESS_RATE  # tokens per compressed block in this family's spec


class Variants(dict):
    """The family's variant modules by name; an unknown name is a KeyError that suggests close ones."""

    def __missing__(self, name):
        close = difflib.get_close_matches(str(name), self.keys(), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"the {len(self)} names are VARIANTS.keys()"
        raise KeyError(f"no variant named {name!r}; {hint}")


def causal_kv_range(positions, compress_rate=COMPRESS_RATE, segment_starts=None):
    """The causal CSA visible range ``[kv_start, kv_end)`` of each query, for ``score``.

    Compressed block w summarises tokens ``[w * r, (w + 1) * r)`` and is complete only once
    position ``(w + 1) * r - 1`` has been seen, so a query at position p sees the blocks
    ``w < (p + 1) // r``: never the block it is still inside. With packed sequences, a query also
    sees only the blocks that start inside its own segment: ``w >= ceil(segment_start / r)``.

    Args:
      positions: integer [B, S] (or any shape) token positions, in the stream the blocks index.
      compress_rate: r, tokens per compressed block.
      segment_starts: optional integer array like ``positions``: the position of the first token
        of each query's segment. None: one segment from position 0.

    Returns:
      (kv_start, kv_end), int32 arrays shaped like ``positions``. A query that sees nothing has
      kv_start >= kv_end: its scores are all masked and it gets no gradient.
    """
    if compress_rate < 1:
        raise ValueError(f"compress_rate must be a positive integer, got {compress_rate}")
    positions = jnp.asarray(positions, jnp.int32)
    kv_end = (positions + 1) // compress_rate
    if segment_starts is None:
        return jnp.zeros_like(kv_end), kv_end
    segment_starts = jnp.asarray(segment_starts, jnp.int32)
    if segment_starts.shape != positions.shape:
        raise ValueError(
            f"segment_starts must be shaped like positions {positions.shape}, got {segment_starts.shape}"
        )
    return -(-segment_starts // compress_rate), kv_end


APPROX_RECALL_TARGET = 0.95  # topk_indices(method="approx"): jax.lax.approx_max_k's recall target


def topk_indices(scores, top_k, *, method="exact"):
    """The ``top_k`` highest-scoring compressed blocks of each query: int32 ``[B, S, top_k]``.

    Args:
      scores: ``[B, S, W]`` scores (any float dtype), e.g. a variant's ``score``; a non-finite entry
        (``-inf`` where masked, NaN, ``+inf``) is not a visible block and is never selected.
      top_k: blocks to select per query, ``>= 1``; it may exceed W (the extra slots are -1).
      method: ``"exact"``: ``jax.lax.top_k``, highest score first, equal scores in increasing block
        index (the lower block wins a tie). ``"approx"``: ``jax.lax.approx_max_k`` with recall target
        ``APPROX_RECALL_TARGET`` (0.95: the expected share of the true top_k that is selected, on TPU;
        on other backends it is exact), highest first; ties there are in no stated order.

    Returns:
      int32 ``[B, S, top_k]``: slot j of a row holds a block index while j is below the row's number
      of visible (finite) entries, and -1 ("no block") after. Deterministic: the same scores give
      the same indices.
    """
    if not hasattr(scores, "shape") or not hasattr(scores, "dtype") or scores.ndim != 3:
        raise ValueError(
            f"scores must be an array [B, S, W], got shape {tuple(getattr(scores, 'shape', ()))}"
        )
    if not jnp.issubdtype(scores.dtype, jnp.floating):
        raise ValueError(f"scores must be a float array [B, S, W], got {scores.dtype}")
    top_k = check_top_k(top_k)
    if method not in ("exact", "approx"):
        raise ValueError(f'method must be "exact" or "approx", got {method!r}')
    scores = scores.astype(jnp.float32)
    visible = jnp.isfinite(scores)
    scores = jnp.where(visible, scores, -jnp.inf)
    num_blocks = scores.shape[-1]
    if top_k > num_blocks:  # top_k and approx_max_k take at most W
        scores = pad_to(scores, 2, top_k) + jnp.where(jnp.arange(top_k) < num_blocks, 0.0, -jnp.inf)
    if method == "exact":
        _, indices = jax.lax.top_k(scores, top_k)
    else:
        _, indices = jax.lax.approx_max_k(scores, top_k, recall_target=APPROX_RECALL_TARGET)
    count = jnp.sum(visible, axis=-1, keepdims=True)
    return jnp.where(jnp.arange(top_k) < count, indices, -1).astype(jnp.int32)


# How ``sparse_score`` and the sparse ``indexer_loss`` score the selected blocks: "sparse" gathers each
# query's top_k keys (the sparse kernels: work that grows with top_k, never W), "dense" scores the blocks
# between each query's lowest and highest selected one and takes the selected ones from those scores
# (``_take``; the [B, S, W] scores in HBM), "auto" the faster where it was measured. On a TPU v5e (JAX
# 0.10.2, causal top_k selections, bfloat16, ``codegen bench``'s sparse and sparse.dense cases; docs/
# performance.md, "The dense route"), forward and forward + gradient, ms, dense route against sparse:
# W / top_k 4 (S 8192, W 2048): 1.06 / 7.48 against 6.67 / 28.2; 16: 0.91 / 5.51 against 2.90 / 11.1
# (S 16384, W 8192: 5.40 / 35.0 against 13.4 / 54.0); 32: 0.91 / 5.37 against 0.95 / 3.28 (S 16384:
# 4.80 / 29.1 against 8.36 / 32.0). The sparse kernels' work falls with top_k, the dense route's
# does not: "auto" takes the dense route at W / top_k <= DENSE_ROUTE_MAX_RATIO where the scores fit
# DENSE_ROUTE_BYTES, else the sparse kernels. Chips we have not measured take the same choice.
ROUTES = ("auto", "dense", "sparse")
DENSE_ROUTE_MAX_RATIO = 16
DENSE_ROUTE_BYTES = 512 * 2**20  # the [B, S, W] scores (and, for the gradient, their cotangent)


def check_route(route):
    """ValueError for a route not in ``ROUTES``."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {', '.join(map(repr, ROUTES))}, got {route!r}")


def sparse_route(route, batch, seq_len, width, top_k, score_dtype):
    """The route ``route`` takes for top_k of W blocks per query: "dense" or "sparse" ("auto": see
    ``ROUTES``); ValueError for a route not in ``ROUTES``."""
    check_route(route)
    if route != "auto":
        return route
    fits = batch * seq_len * width * jnp.dtype(score_dtype).itemsize <= DENSE_ROUTE_BYTES
    return "dense" if fits and width <= DENSE_ROUTE_MAX_RATIO * top_k else "sparse"


def routed_sparse_score(variant, score, sparse_score, q, k, weights, indices, *, route, k_scale,
                        softmax_scale, interpret):  # fmt: skip
    """A variant's ``sparse_score`` by ``route`` (``sparse_route``): its sparse kernels, or its dense
    ``score`` over each query's span of selected blocks with the selected ones taken from it (``_take``;
    -inf, and no gradient, in an empty slot; a block selected twice gets both slots' gradients, as the
    sparse kernels give them)."""
    check_inputs(q, k, weights, variant)
    batch, _, seq_len, _ = q_dims(q, variant["q_layout"])
    indices = check_indices(indices, batch, seq_len)
    width, top_k = k.shape[1], indices.shape[2]
    kwargs = dict(k_scale=k_scale, softmax_scale=softmax_scale, interpret=interpret)
    if sparse_route(route, batch, seq_len, width, top_k, variant["out_dtype"]) == "sparse":
        return sparse_score(q, k, weights, indices, **kwargs)
    kv_start, kv_end = _take.span(indices, width)  # W and 0: a query with none sees none
    scores = score(q, k, weights, kv_start=kv_start, kv_end=kv_end, **kwargs)
    selected = _take.take(scores, indices, interpret)  # nothing at an index outside [0, W)
    picked = (indices >= 0) & (indices < width)
    return jnp.where(picked, selected, _family.MASKED_VALUE).astype(scores.dtype)


def indexer_loss(variant, score, sparse_score, q, k, weights, target, *, indices=None, kv_start=None,
                 kv_end=None, k_scale=None, softmax_scale=None, interpret=False):  # fmt: skip
    """A variant's ``indexer_loss`` over its ``score`` and ``sparse_score`` (see there; a route is bound
    into the latter). Every input, ``target`` included, is checked before anything is traced."""
    check_inputs(q, k, weights, variant)
    batch, _, seq_len, _ = q_dims(q, variant["q_layout"])
    if (
        not hasattr(target, "shape")
        or not hasattr(target, "dtype")
        or not jnp.issubdtype(target.dtype, jnp.floating)
    ):
        raise ValueError(
            f"target must be a float array, got {getattr(target, 'dtype', type(target).__name__)}"
        )
    if indices is None:
        want, like = (batch, seq_len, k.shape[1]), "[B, S, W] like the score"
    else:
        indices = check_indices(indices, batch, seq_len)
        want, like = tuple(indices.shape), "[B, S, top_k] like indices"
    if tuple(target.shape) != want:
        raise ValueError(f"target must be {like}, {want}, got {tuple(target.shape)}")
    kwargs = dict(k_scale=k_scale, softmax_scale=softmax_scale, interpret=interpret)
    if indices is None:
        logits = score(q, k, weights, kv_start=kv_start, kv_end=kv_end, **kwargs)
        in_set = jnp.isfinite(logits)  # the visible blocks
    else:
        logits = sparse_score(q, k, weights, indices, **kwargs)
        in_set = (indices >= 0) & (indices < k.shape[1])
        shape = indices.shape[:2]
        if kv_start is not None:
            in_set &= indices >= check_kv_bound("kv_start", kv_start, shape, 0)[..., None]
        if kv_end is not None:
            in_set &= indices < check_kv_bound("kv_end", kv_end, shape, k.shape[1])[..., None]
    return kl_over_sets(logits, target, in_set)


def kl_over_sets(logits, target, in_set):
    """The mean over rows with a non-empty set of KL(target || softmax(logits)), both restricted to the
    row's set, the target renormalised there; float32. A row whose target has no mass on its set adds
    0 (and is still one of the rows averaged over). Never NaN: entries outside the set are replaced
    before any arithmetic (their gradient is exactly 0), and with no non-empty set the loss is 0."""
    target = jax.lax.stop_gradient(jnp.where(in_set, target.astype(ACCUM_DTYPE), 0.0))
    logits = jnp.where(in_set, logits.astype(ACCUM_DTYPE), 0.0)  # -inf outside the set never reaches exp
    mass = jnp.sum(target, axis=-1, keepdims=True)
    nonempty = jnp.any(in_set, axis=-1, keepdims=True)
    counts = nonempty & (mass > 0)
    p = target / jnp.where(counts, mass, 1.0)
    top = jax.lax.stop_gradient(jnp.max(jnp.where(in_set, logits, -jnp.inf), axis=-1, keepdims=True))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jnp.sum(jnp.where(in_set, jnp.exp(logits - top), 0.0), axis=-1, keepdims=True)
    log_q = logits - top - jnp.log(jnp.where(counts, total, 1.0))
    positive = p > 0
    terms = jnp.where(positive, p * (jnp.log(jnp.where(positive, p, 1.0)) - log_q), 0.0)
    per_row = jnp.where(counts, jnp.sum(terms, axis=-1, keepdims=True), 0.0)
    return jnp.sum(per_row) / jnp.maximum(jnp.sum(nonempty), 1).astype(ACCUM_DTYPE)
