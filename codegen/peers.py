"""What ``codegen bench`` times our kernels against: the straightforward ways a user would compute the same
thing on a TPU. Each needs only JAX, like the generated kernels.

- ``stacked_forward``: a Pallas forward in the style of MaxText's kernel (the seed PR): every head of a
  q tile stacked into one matmul against a k tile, relu, the head weights, the sum over heads; every
  tile computed, nothing skipped, no mask. The baseline every ratio is read against.
- ``xla_score``: the pure-XLA score (``codegen.reference``'s formula in the input dtype, float32
  accumulation): it materialises the ``[B, H, S, W]`` logits, which is what the kernels avoid.
- ``xla_sparse_score``: the selected rows of k gathered with ``take_along_axis``, then the two einsums.
- ``matmul``: a bf16 ``n x n x n`` matmul, the chip's calibration.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

STACKED_BLOCK_Q = 128  # queries per tile (MaxText's, at H >= 32)
STACKED_BLOCK_W = 1024  # compressed blocks per tile
STACKED_VMEM_LIMIT_BYTES = 100 * 2**20  # the [block_q * H, block_w] float32 logits: 32 MiB at H = 64


def _stacked_kernel(q_ref, k_ref, w_ref, o_ref, *, scale):
    block_q, heads, head_dim = q_ref.shape
    q = q_ref[...].reshape(block_q * heads, head_dim)  # every head of the tile: one matmul
    logits = jax.lax.dot_general(
        q, k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )  # [block_q * H, block_w]
    weighted = jnp.maximum(logits, 0.0) * w_ref[...]  # the head weights, a column per (query, head)
    out = jnp.sum(weighted.reshape(block_q, heads, -1), axis=1)
    o_ref[...] = (scale * out).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_q", "block_w", "interpret"))
def stacked_forward(q, k, weights, *, block_q=STACKED_BLOCK_Q, block_w=STACKED_BLOCK_W, interpret=False):
    """The every-block stacked-heads forward: q ``[B, S, H, D]``, k ``[B, W, D]``, weights ``[B, S, H]`` ->
    ``[B, S, W]`` in q's dtype, S a multiple of ``block_q`` and W of ``block_w``."""
    batch, seq_len, heads, head_dim = q.shape
    num_blocks = k.shape[1]
    if seq_len % block_q or num_blocks % block_w:
        raise ValueError(
            f"stacked_forward: S={seq_len}, W={num_blocks} must be multiples of {block_q}, {block_w}"
        )
    column = weights.astype(jnp.float32).reshape(batch, seq_len * heads, 1)  # (query, head) rows
    return pl.pallas_call(
        functools.partial(_stacked_kernel, scale=head_dim**-0.5),
        grid=(batch, seq_len // block_q, num_blocks // block_w),
        in_specs=[
            pl.BlockSpec((None, block_q, heads, head_dim), lambda b, i, j: (b, i, 0, 0)),
            pl.BlockSpec((None, block_w, head_dim), lambda b, i, j: (b, j, 0)),
            pl.BlockSpec((None, block_q * heads, 1), lambda b, i, j: (b, i, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_q, block_w), lambda b, i, j: (b, i, j)),
        out_shape=jax.ShapeDtypeStruct((batch, seq_len, num_blocks), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel"),
            vmem_limit_bytes=STACKED_VMEM_LIMIT_BYTES,
        ),
        interpret=interpret,
        name="stacked_heads_forward",
    )(q, k, column)


def xla_score(q, k, weights, kv_start=None, kv_end=None):
    """The score in plain XLA, q ``[B, S, H, D]``: bf16 matmul with float32 accumulation, then relu, the
    weights and the head sum in float32; -inf outside ``[kv_start, kv_end)``; q's dtype out."""
    logits = jnp.einsum("bshd,bwd->bhsw", q, k, preferred_element_type=jnp.float32)
    out = q.shape[-1] ** -0.5 * jnp.einsum("bsh,bhsw->bsw", weights.astype(jnp.float32), jax.nn.relu(logits))
    if kv_start is not None:
        w = jnp.arange(k.shape[1])
        out = jnp.where((w >= kv_start[..., None]) & (w < kv_end[..., None]), out, -jnp.inf)
    return out.astype(q.dtype)


def xla_sparse_score(q, k, weights, indices):
    """Each query's selected rows of k gathered (``[B, S, top_k, D]``), then the two einsums, float32
    accumulation; -inf at the -1 slots; q's dtype out."""
    valid = indices >= 0
    rows = jnp.take_along_axis(k[:, None], jnp.maximum(indices, 0)[..., None], axis=2)
    logits = jnp.einsum("bshd,bskd->bshk", q, rows, preferred_element_type=jnp.float32)
    out = q.shape[-1] ** -0.5 * jnp.einsum("bsh,bshk->bsk", weights.astype(jnp.float32), jax.nn.relu(logits))
    return jnp.where(valid, out, -jnp.inf).astype(q.dtype)


def matmul(a, b):
    """The calibration: a bf16 matmul, float32 accumulation, bf16 out."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
