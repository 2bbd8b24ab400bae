"""Meshes: what lets the kernels run inside ``jax.shard_map`` (the manual axes an array varies over,
declared on every kernel output and gradient; interpret mode there), and ``sharded_score``, a variant's
score on a mesh with its checks."""

import functools
import inspect
import math
import warnings

import jax
import jax.numpy as jnp

from ._checks import check_call, q_dims

# Inside ``jax.shard_map(..., check_vma=True)`` (the default) the type of every array records the
# manual mesh axes it varies over. A pallas_call cannot infer that for its outputs, so each out_shape
# must declare it; a custom_vjp must return each gradient varying exactly as its input does. The
# spelling moved between JAX releases, and these three functions are the only code that names it:
#   JAX 0.10 .. 0.12 (run on 0.10.2 and 0.12.0.1): jax.typeof(x).manual_axis_type.varying,
#     jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes)),
#     jax.lax.pcast(x, axes, to="varying") (jax.lax.pvary was removed in 0.10.0).
#   JAX 0.6.1 .. 0.9 (not run here): jax.typeof(x).vma, jax.ShapeDtypeStruct(shape, dtype, vma=axes),
#     jax.lax.pvary(x, axes) (jax.lax.pcast from 0.8.2).
_SDS_TAKES_MANUAL_AXIS_TYPE = "manual_axis_type" in inspect.signature(jax.ShapeDtypeStruct).parameters


def varying_axes(x):
    """The manual mesh axes ``x`` varies over: empty outside ``jax.shard_map`` (and with check_vma=False)."""
    aval = jax.typeof(x)
    manual_axis_type = getattr(aval, "manual_axis_type", None)
    if manual_axis_type is not None:
        return frozenset(manual_axis_type.varying)
    return frozenset(getattr(aval, "vma", ()))


def vary(x, axes):
    """``x`` cast to vary over ``axes`` as well. Autodiff transposes the cast into a sum of the
    cotangent over the axes it added: the gradient of a replicated input is reduced there, once."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x), key=str))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def out_struct(shape, dtype, like):
    """The ``out_shape`` of a pallas_call output that varies over the manual axes ``like`` varies over."""
    axes = varying_axes(like)
    if _SDS_TAKES_MANUAL_AXIS_TYPE:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes))
    return jax.ShapeDtypeStruct(shape, dtype, vma=axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _upcast(x, cotangent_dtype):
    """``x`` as float32; its cotangent comes back as ``cotangent_dtype`` (float8 inputs have bfloat16 gradients)."""
    return x.astype(jnp.float32)


def _upcast_fwd(x, cotangent_dtype):
    return x.astype(jnp.float32), None


def _upcast_bwd(cotangent_dtype, _, cotangent):
    return (cotangent.astype(cotangent_dtype),)


_upcast.defvjp(_upcast_fwd, _upcast_bwd)


def vary_together(arrays, grad_dtypes=None):
    """``arrays`` (None passes through) cast to vary over every manual axis any of them varies over, so
    that the kernels' outputs and gradients, which declare that union, are right.

    The gradient of an input cast this way is summed over the axes it gained (k replicated over a
    context or head axis). That sum is done in float32: a narrower input is upcast first, the kernels
    (which compute in its own dtype; see a variant's ``prepare``) return its gradient in float32, and it is
    rounded to ``grad_dtypes[i]`` once, after the sum; summing bfloat16 partials would cost ~2e-3.
    ``grad_dtypes`` None: no upcast, where autodiff never sees the cast (inside a custom_vjp's rules).
    """
    axes = frozenset().union(*(varying_axes(x) for x in arrays if x is not None))
    if not axes:
        return tuple(arrays)
    out = []
    for x, grad_dtype in zip(arrays, grad_dtypes or (None,) * len(arrays)):
        if x is not None and axes - varying_axes(x):
            if grad_dtypes and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.float32:
                x = _upcast(x, grad_dtype)
            x = vary(x, axes)
        out.append(x)
    return tuple(out)


def interpretable(fn, arrays, interpret):
    """``fn(arrays)``, where ``fn`` runs pallas_calls interpreted as ``interpret`` says.

    Pallas's HLO interpreter (``interpret=True``) cannot evaluate a kernel inside ``jax.shard_map``
    with check_vma=True once its inputs vary over a manual axis (JAX 0.10.2 and 0.12.0.1): every
    primitive it binds must see operands of one vma, and its loop indices and constants vary over
    none ("Primitive mul requires varying manual axes to match"). In that case only, ``fn`` runs in
    a nested ``jax.shard_map`` over no new axes with check_vma=False, on inputs that no longer
    record their axes, and its outputs are declared varying again over the axes the inputs varied
    over: the same values, no communication. That last cast has a transpose (a sum) that would be
    wrong here, so call this only where autodiff never sees it: inside a custom_vjp's rules.
    (The TPU interpreter, ``pltpu.InterpretParams``, runs under check_vma as it is; but its barriers
    across devices can deadlock against XLA collectives that another device runs in another order.)
    """
    axes = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(arrays)))
    if interpret is not True or not axes:
        return fn(arrays)
    forget = lambda x: jax.lax.mul(x, jnp.ones((), x.dtype))  # any primitive drops the vma without the check
    P = jax.sharding.PartitionSpec
    unchecked = jax.shard_map(
        lambda arrays: fn(jax.tree.map(forget, arrays)),
        in_specs=(P(),),
        out_specs=P(),
        axis_names=set(),
        check_vma=False,
    )
    # Under jax.jit: an eager shard_map refuses a nested one with another check_vma.
    return jax.tree.map(lambda y: vary(y, axes), jax.jit(unchecked)(arrays))


DEFAULT_BATCH_AXES = ("data", "fsdp", "fsdp_transpose", "expert")


def mesh_plan(mesh, batch, seq_len, num_heads, *, batch_axes, context_axis, head_axis, head_chunk):
    """Checks the mesh and the axis names against the problem; returns the axes to shard the batch over.

    Raises ValueError naming the axis (or the sizes) before anything is traced. Warns, and returns no
    batch axes, when the batch does not divide over them.
    """
    names = getattr(mesh, "axis_names", None)
    sizes = getattr(mesh, "shape", None)
    if names is None or not hasattr(sizes, "get"):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(names)
    if isinstance(batch_axes, str):
        batch_axes = (batch_axes,)
    try:
        batch_axes = tuple(batch_axes)
    except TypeError:
        raise ValueError(f"batch_axes must be a tuple of mesh axis names, got {batch_axes!r}") from None
    for role, axis in (("context_axis", context_axis), ("head_axis", head_axis)):
        if axis is not None and axis not in names:
            raise ValueError(f"{role} {axis!r} is not an axis of the mesh, whose axes are {names}")
    if context_axis is not None and context_axis == head_axis:
        raise ValueError(f"axis {context_axis!r} is used twice: as context_axis and as head_axis")
    for position, axis in enumerate(batch_axes):
        if axis in batch_axes[:position]:
            raise ValueError(f"axis {axis!r} is used twice in batch_axes {batch_axes}")
        for role, other in (("context_axis", context_axis), ("head_axis", head_axis)):
            if axis == other and axis in names:
                raise ValueError(
                    f"axis {axis!r} is used twice: in batch_axes {batch_axes} and as {role}; the batch is "
                    f"never sharded over the {role.split('_')[0]} axis, so leave it out of batch_axes"
                )
    if context_axis is not None and seq_len % sizes[context_axis]:
        raise ValueError(
            f"context_axis {context_axis!r} has {sizes[context_axis]} shards, which do not divide the "
            f"sequence length S={seq_len}"
        )
    if head_axis is not None:
        shards = sizes[head_axis]
        if num_heads % shards:
            raise ValueError(
                f"head_axis {head_axis!r} has {shards} shards, which do not divide the H={num_heads} heads"
            )
        if head_chunk is not None and (num_heads // shards) % head_chunk:
            raise ValueError(
                f"head_axis {head_axis!r} leaves {num_heads // shards} of the H={num_heads} heads on each of "
                f"its {shards} shards, which this variant's head chunk of {head_chunk} does not divide"
            )
    present = tuple(axis for axis in batch_axes if axis in names)
    shards = math.prod(sizes[axis] for axis in present)
    if batch % shards:
        warnings.warn(
            f"sharded_score: the batch B={batch} does not divide over the {shards} shards of the batch "
            f"axes {dict((axis, sizes[axis]) for axis in present)}; the batch is replicated instead "
            "(every device scores the whole batch)",
            stacklevel=4,
        )
        return ()
    return present


def place(x, mesh, spec):
    """``x`` laid out as ``spec`` on ``mesh``. ``jax.shard_map`` rejects inputs sharded otherwise on
    Explicit axes; ``jax.device_put`` reshards on Explicit and Auto axes alike, eagerly or under jit,
    and costs nothing when ``x`` is laid out so already."""
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))


def mesh_operands(
    variant, mesh, q, k, weights, kv_start, kv_end, k_scale, *, batch_axes, context_axis, head_axis
):
    """The call's arrays placed on ``mesh`` for a ``jax.shard_map`` over it, their PartitionSpecs, and the
    (batch, context) entries of a [B, S, ...] output's spec; the checks are ``mesh_plan``'s."""
    q_layout = variant["q_layout"]
    batch, num_heads, seq_len, _ = q_dims(q, q_layout)
    batch_axes = mesh_plan(
        mesh, batch, seq_len, num_heads, batch_axes=batch_axes, context_axis=context_axis,
        head_axis=head_axis, head_chunk=variant["head_chunk"] or None,
    )  # fmt: skip
    b = batch_axes[0] if len(batch_axes) == 1 else (batch_axes or None)
    s, h = context_axis, head_axis
    P = jax.sharding.PartitionSpec
    arrays = dict(q=q, k=k, weights=weights, kv_start=kv_start, kv_end=kv_end, k_scale=k_scale)
    specs = dict(
        q=P(b, h, s, None) if q_layout == "head_major" else P(b, s, h, None),
        k=P(b, None, None),  # replicated over the context and head axes
        weights=P(b, s, h),
        kv_start=P(b, s),  # global compressed-block indices: each shard masks its own queries right
        kv_end=P(b, s),
        k_scale=P(b, None),
    )
    arrays = {name: place(x, mesh, specs[name]) for name, x in arrays.items() if x is not None}
    return arrays, {name: specs[name] for name in arrays}, (b, s)


def sharded_score(
    variant, score_as, q, k, weights, *, mesh, batch_axes=DEFAULT_BATCH_AXES, context_axis=None, head_axis=None,
    kv_start=None, kv_end=None, k_scale=None, softmax_scale=None, interpret=False,
):  # fmt: skip
    """A variant's ``score`` inside a ``jax.shard_map`` over ``mesh``; returns the global ``[B, S, W]``.

    Args:
      variant: the variant's ``VARIANT``: its q layout, head chunk (which must divide each shard's
        heads) and output dtype (partial sums over a head axis are float32 until the end).
      score_as: the variant's ``score_as(out_dtype, q, k, weights, *, kv_start, kv_end, k_scale,
        softmax_scale, interpret)``, applied to each device's shard.
      mesh: a ``jax.sharding.Mesh`` with Auto or Explicit axes. Inputs laid out otherwise (or not on
        the mesh at all) are resharded to fit, eagerly or under ``jax.jit``.
      batch_axes: B is sharded over those of these axes that the mesh has (any may be missing). When
        B does not divide over them, the batch is replicated instead, with a warning naming the sizes.
      context_axis: None, or an axis to shard S over: q, weights, kv_start, kv_end and the output are
        split along S, while k (and k_scale) are replicated on it (their gradients are summed over it,
        once, in float32). The axis must divide S. Bounds stay global compressed-block indices, so
        every shard masks, and skips tiles, right; visibility is per query, so the queries may come in
        any order: for causal load balance give each shard a chunk from the start of the sequence and
        one from the end (both q and the bounds permuted), and the scores come back in that order.
      head_axis: None, or an axis to shard H over (q's and weights'). Each shard scores its heads; the
        float32 partial scores are summed over the axis, then cast to the output dtype; masked entries
        stay exactly masked. The axis must divide H, and the head chunk the heads per shard. Cost: an
        all-reduce of the float32 ``[B/dp, S/cp, W]`` partial scores in the forward, and of dk
        (``[B/dp, W, D]``) in the backward. Context parallelism moves only the latter (W x D floats
        against S x W per sequence: 64x fewer at S = 8192, D = 128), so prefer it; see
        ``python benchmarks/sharding.py``. Only the float32 summation order of the partials differs
        from the single-device score: an entry of a bfloat16 score can differ by one ulp (2**-8
        relative) where its sum lies at a rounding boundary, within the suite's bfloat16 tolerance.
    An axis the mesh does not have, or one used twice, is a ValueError naming it, raised before
    anything is traced; so is a size that does not divide.
    """
    # On the global shapes, before anything is traced; the scale resolved on the global q (D is never sharded).
    softmax_scale = check_call(variant, q, k, weights, kv_start, kv_end, k_scale, softmax_scale)[3]
    out_dtype = jnp.dtype(variant["out_dtype"])
    arrays, specs, (b, s) = mesh_operands(
        variant, mesh, q, k, weights, kv_start, kv_end, k_scale,
        batch_axes=batch_axes, context_axis=context_axis, head_axis=head_axis,
    )  # fmt: skip
    P = jax.sharding.PartitionSpec
    partial_dtype = out_dtype if head_axis is None else jnp.float32

    def shard(arrays):
        out = score_as(
            partial_dtype, arrays["q"], arrays["k"], arrays["weights"],
            kv_start=arrays.get("kv_start"), kv_end=arrays.get("kv_end"), k_scale=arrays.get("k_scale"),
            softmax_scale=softmax_scale, interpret=interpret,
        )  # fmt: skip
        if head_axis is not None:  # partial sums over this shard's heads; masked entries stay -inf
            out = jax.lax.psum(out, head_axis).astype(out_dtype)
        return out

    return jax.shard_map(shard, mesh=mesh, in_specs=(specs,), out_specs=P(b, s, None))(arrays)
