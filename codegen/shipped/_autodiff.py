"""The custom-VJP wiring of a variant's ``score`` and ``sparse_score``: the call checked, the inputs
made to vary together on a mesh, and a ``jax.custom_vjp`` over the variant's forward and backward
kernels whose residuals are the inputs only; and the float32 reference backward that variants with
``backward: reference`` use instead of kernels."""

import functools

import jax
import jax.numpy as jnp

from . import _geometry
from ._checks import check_call, check_indices, q_dims
from ._gather import sparse_vmem_rows
from ._kernel_ops import ACCUM_DTYPE
from ._mesh import interpretable, vary_together


def differentiable_score(variant, forward, backward):
    """A variant's ``score_as(out_dtype, q, k, weights, *, kv_start, kv_end, k_scale, softmax_scale,
    interpret)``: ``score`` with its output in ``out_dtype`` (float32 for partial sums over a sharded
    head axis), a ``jax.custom_vjp`` over the variant's ``forward`` and ``backward`` whose residuals
    are the inputs only (the backward recomputes logits rather than saving [B, H, S, W])."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
    def core(q, k, weights, kv_start, kv_end, k_scale, softmax_scale, interpret, out_dtype):
        arrays = (q, k, weights, kv_start, kv_end, k_scale)
        return interpretable(lambda a: forward(*a, softmax_scale, interpret, out_dtype), arrays, interpret)

    def core_fwd(q, k, weights, kv_start, kv_end, k_scale, softmax_scale, interpret, out_dtype):
        residuals = (q, k, weights, kv_start, kv_end, k_scale)
        out = interpretable(lambda a: forward(*a, softmax_scale, interpret, out_dtype), residuals, interpret)
        return out, residuals

    def core_bwd(softmax_scale, interpret, out_dtype, residuals, g):
        return interpretable(
            lambda a: backward(softmax_scale, interpret, out_dtype, *a), (residuals, g), interpret
        )

    core.defvjp(core_fwd, core_bwd)
    grad_dtypes = [jnp.dtype(variant[key]) for key in ("qk_grad_dtype", "qk_grad_dtype", "weights_dtype")]

    def score_as(out_dtype, q, k, weights, *, kv_start=None, kv_end=None, k_scale=None, softmax_scale=None,
                 interpret=False):  # fmt: skip
        checked = check_call(variant, q, k, weights, kv_start, kv_end, k_scale, softmax_scale)
        kv_start, kv_end, k_scale, softmax_scale = checked
        # Inside jax.shard_map, every input varies over the mesh axes any of them does: the kernels'
        # outputs and gradients declare that, and autodiff sums the gradient of an input replicated
        # over some of them (k over a context or head axis) over those axes, once, in float32.
        # Outside shard_map this does nothing.
        q, k, weights, kv_start, kv_end, k_scale = vary_together(
            (q, k, weights, kv_start, kv_end, k_scale), (*grad_dtypes, None, None, jnp.float32)
        )
        with jax.named_scope(variant["name"]):
            return core(q, k, weights, kv_start, kv_end, k_scale, softmax_scale, interpret, out_dtype)

    return score_as


def _chunk_score(q_chunk, k, weights_chunk, softmax_scale):
    """The reference score of one head chunk: q [B, C, S, D], k [B, W, D], weights [B, S, C], all float32."""
    logits = jnp.einsum("bhsd,bwd->bhsw", q_chunk, k, precision=jax.lax.Precision.HIGHEST)
    return softmax_scale * jnp.einsum(
        "bsh,bhsw->bsw", weights_chunk, jnp.maximum(logits, 0.0), precision=jax.lax.Precision.HIGHEST
    )


def reference_backward(cfg, softmax_scale, interpret, out_dtype, residuals, g):
    """The reference VJP in float32, scanned over head chunks so at most [B, chunk, S, W] is live: the
    backward of the variants whose spec asks for ``backward: reference``."""
    del interpret, out_dtype  # plain XLA: nothing to interpret; g arrives in out_dtype
    q, k, weights, kv_start, kv_end, k_scale = residuals
    del k_scale  # only float8 variants take one, and they use the fused backward
    batch, num_heads, seq_len, head_dim = q_dims(q, cfg.variant["q_layout"])
    chunk = cfg.variant["head_chunk"] or num_heads
    num_chunks = num_heads // chunk
    q32 = (
        q.astype(ACCUM_DTYPE) if cfg.head_major else jnp.swapaxes(q, 1, 2).astype(ACCUM_DTYPE)
    )  # [B, H, S, D]
    q_chunks = jnp.swapaxes(q32.reshape(batch, num_chunks, chunk, seq_len, head_dim), 0, 1)
    weights_chunks = (
        weights.astype(ACCUM_DTYPE).reshape(batch, seq_len, num_chunks, chunk).transpose(2, 0, 1, 3)
    )
    k32 = k.astype(ACCUM_DTYPE)
    # Masked entries get no gradient, whatever the cotangent holds there.
    blocks = jnp.arange(k.shape[1], dtype=jnp.int32)
    visible = (kv_start[..., None] <= blocks) & (blocks < kv_end[..., None])
    g32 = jnp.where(visible, g.astype(ACCUM_DTYPE), 0.0)

    def step(dk, chunk_inputs):
        q_chunk, weights_chunk = chunk_inputs
        _, vjp = jax.vjp(
            functools.partial(_chunk_score, softmax_scale=softmax_scale), q_chunk, k32, weights_chunk
        )
        dq_chunk, dk_chunk, dweights_chunk = vjp(g32)
        return dk + dk_chunk, (dq_chunk, dweights_chunk)

    dk, (dq, dweights) = jax.lax.scan(step, jnp.zeros_like(k32), (q_chunks, weights_chunks))
    dq = jnp.swapaxes(dq, 0, 1).reshape(batch, num_heads, seq_len, head_dim)
    if not cfg.head_major:
        dq = jnp.swapaxes(dq, 1, 2)
    dweights = dweights.transpose(1, 2, 0, 3).reshape(batch, seq_len, num_heads)
    return dq.astype(q.dtype), dk.astype(k.dtype), dweights.astype(weights.dtype), None, None, None


def differentiable_sparse_score(variant, forward, backward, gather_dtypes):
    """A variant's ``sparse_score`` over its two kernels: a ``jax.custom_vjp`` whose residuals are the
    inputs only (the backward gathers and recomputes the logits). ``gather_dtypes``: the dtypes the
    forward and the backward gather k rows in, for the VMEM check made before anything is traced."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
    def core(q, k, weights, indices, k_scale, softmax_scale, interpret):
        arrays = (q, k, weights, indices, k_scale)
        return interpretable(lambda a: forward(*a, softmax_scale, interpret), arrays, interpret)

    def core_fwd(q, k, weights, indices, k_scale, softmax_scale, interpret):
        residuals = (q, k, weights, indices, k_scale)
        return interpretable(lambda a: forward(*a, softmax_scale, interpret), residuals, interpret), residuals

    def core_bwd(softmax_scale, interpret, residuals, g):
        grads = interpretable(
            lambda a: backward(softmax_scale, interpret, *a[0], a[1]), (residuals, g), interpret
        )
        dq, dk, dweights, dk_scale = grads
        return dq, dk, dweights, None, dk_scale

    core.defvjp(core_fwd, core_bwd)
    grad_dtypes = [jnp.dtype(variant[key]) for key in ("qk_grad_dtype", "qk_grad_dtype", "weights_dtype")]

    def sparse_score(q, k, weights, indices, *, k_scale=None, softmax_scale=None, interpret=False):
        _, _, k_scale, softmax_scale = check_call(variant, q, k, weights, None, None, k_scale, softmax_scale)
        batch, _, seq_len, _ = q_dims(q, variant["q_layout"])
        indices = check_indices(indices, batch, seq_len)
        for dtype in gather_dtypes:  # raises ValueError when a query's gathered rows leave no room for k
            pad = _geometry.sparse_top_k_pad(indices.shape[2])
            sparse_vmem_rows(k.shape[2], q_dims(q, variant["q_layout"])[1], pad, dtype, q.dtype)
        # Inside jax.shard_map, as for score: every input varies over the axes any of them does, and the
        # gradient of one replicated over some (k over a sequence axis) is summed there, in float32.
        q, k, weights, indices, k_scale = vary_together(
            (q, k, weights, indices, k_scale), (*grad_dtypes, None, jnp.float32)
        )
        with jax.named_scope(f"{variant['name']}_sparse"):
            return core(q, k, weights, indices, k_scale, softmax_scale, interpret)

    return sparse_score
