"""Which compute blocks a q block's queries may see: the rule the kernels skip and mask by, stated once.

``codegen render`` copies these functions, source and all, into each family's ``_runtime.py``, where
the kernels classify every (q block, compute block) as empty, full or partial from four int32 per q
block; the cost model (``codegen explain --causal``) and the tests run the very same functions on
whole problems. They use only ``jax.numpy``, on arrays or on scalars read from SMEM alike.
"""

from __future__ import annotations

import jax.numpy as jnp


def query_block_bounds(kv_start, kv_end, block_q):
    """What the queries of each q block see, in four int32 per q block, flattened to ``[B * S // block_q]``.

    ``kv_start``, ``kv_end``: int32 [B, S], S a multiple of ``block_q``; query (b, s) sees the
    compressed blocks ``[kv_start, kv_end)`` (empty when ``kv_start >= kv_end``). Returns
    (any_lo, any_hi, all_lo, all_hi): no query of the q block sees a block outside
    ``[any_lo, any_hi)`` (0, 0 when none sees any), and every query sees all of ``[all_lo, all_hi)``
    (empty, ``all_lo >= all_hi``, when some query sees nothing).
    """
    batch, seq_len = kv_start.shape
    start, end = (x.reshape(batch * (seq_len // block_q), block_q) for x in (kv_start, kv_end))
    nonempty = end > start
    seen = jnp.any(nonempty, axis=1)
    any_lo = jnp.where(seen, jnp.min(jnp.where(nonempty, start, jnp.iinfo(jnp.int32).max), axis=1), 0)
    any_hi = jnp.where(seen, jnp.max(jnp.where(nonempty, end, 0), axis=1), 0)
    all_lo, all_hi = jnp.max(start, axis=1), jnp.min(end, axis=1)
    return tuple(x.astype(jnp.int32) for x in (any_lo, any_hi, all_lo, all_hi))


def block_kind(any_lo, any_hi, all_lo, all_hi, lo, hi):
    """(empty, full) of the compressed blocks ``[lo, hi)`` for a q block with these bounds.

    Empty: no query of the q block may see any of them, so they do no work at all. Full: every
    query sees every one of them, so no mask is built. Neither: partial, the only case that masks.
    """
    empty = (hi <= any_lo) | (any_hi <= lo)
    full = (all_lo <= lo) & (hi <= all_hi)
    return empty, full
