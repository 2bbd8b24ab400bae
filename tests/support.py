"""What every test needs: random inputs for a variant, its reference, comparison and TPU lowering."""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np

from codegen import reference
from tests.tolerances import rtol

# CSA_ON_CHIP=1 (tests/conftest.py): the ``chip`` tests compile their kernels for the TPU they run on.
ON_CHIP = os.environ.get("CSA_ON_CHIP", "") == "1"
# What a ``chip`` test passes as ``interpret``: interpret mode on the CPU, Mosaic on the chip.
INTERPRET = not ON_CHIP


# TPU-faithful interpretation: uninitialised VMEM and outputs read as NaN, races and
# out-of-bounds block reads are reported. On the chip: the chip itself (False).
def tpu_interpret_params():
    if ON_CHIP:
        return False
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", out_of_bounds_reads="raise")


def races_found() -> bool:
    """Races the TPU interpreter saw (none can be seen on the chip, where nothing is interpreted)."""
    if ON_CHIP:
        return False
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    return bool(interpret_pallas_call.races is not None and interpret_pallas_call.races.races_found)


def on_cpu(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` computed on the CPU, whatever device the arrays are on: the references
    are float32 at HIGHEST precision, and the CPU's float32 matmul is exact float32 everywhere."""
    cpu = jax.devices("cpu")[0]
    to_cpu = lambda x: jax.device_put(x, cpu) if isinstance(x, (jax.Array, np.ndarray)) else x
    args, kwargs = jax.tree.map(to_cpu, (args, kwargs))
    with jax.default_device(cpu):
        return fn(*args, **kwargs)


def q_shape(variant: dict, batch: int, heads: int, seq_len: int, head_dim: int) -> tuple[int, ...]:
    if variant["q_layout"] == "head_major":
        return (batch, heads, seq_len, head_dim)
    return (batch, seq_len, heads, head_dim)


def make_inputs(variant: dict, shape: tuple[int, int, int, int, int], seed: int):
    """Random (q, k, weights) in the variant's dtypes; weights have both signs, never zeros."""
    batch, heads, seq_len, head_dim, num_blocks = shape
    kq, kk, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, q_shape(variant, batch, heads, seq_len, head_dim), jnp.float32)
    k = jax.random.normal(kk, (batch, num_blocks, head_dim), jnp.float32)
    weights = jax.random.normal(kw, (batch, seq_len, heads), jnp.float32)
    return (
        q.astype(variant["q_dtype"]),
        k.astype(variant["k_dtype"]),
        weights.astype(variant["weights_dtype"]),
    )


def key_scale(variant: dict, k) -> dict:
    """``{"k_scale": ...}`` for variants whose keys carry a per-token scale, else ``{}``.

    Deterministic in k's shape (so the kernel and the reference see the same scales), positive,
    and spread over two octaves so a scale applied to the wrong key shows.
    """
    if not variant["k_scale"]:
        return {}
    batch, num_blocks = k.shape[:2]
    return {
        "k_scale": jax.random.uniform(
            jax.random.PRNGKey(num_blocks), (batch, num_blocks), jnp.float32, 0.5, 2.0
        )
    }


def call(module, q, k, weights, **kwargs):
    """``module.score`` with the key scale its variant needs, under ``jax.jit`` (as users call it).

    One XLA program per call compiles in about half the time of the op-by-op dispatch of an eager
    call, whose every padding and range op is a program of its own; the kernels and every check run
    the same (the call contract raises its ValueError while tracing). Array arguments are traced;
    the others (``softmax_scale``, ``interpret``) are static.
    """
    kwargs = {**key_scale(module.VARIANT, k), **kwargs}
    arrays = {name: value for name, value in kwargs.items() if isinstance(value, (jax.Array, np.ndarray))}
    static = {name: value for name, value in kwargs.items() if name not in arrays}
    return jax.jit(lambda q, k, weights, arrays: module.score(q, k, weights, **arrays, **static))(
        q, k, weights, arrays
    )


def vjp_program(module, **kwargs):
    """``module.score`` and its VJP as one jitted program ``(q, k, weights, cotangent) -> (out, (dq, dk,
    dweights))``, as a training step compiles them; keyword arguments as for ``call``.

    One XLA compile of the forward and backward kernels together: ``jax.vjp`` of an eager call compiles
    the forward, its residuals and the backward as programs of their own, at several times the cost.
    Calling the program twice runs the same compiled kernels again, without compiling anything.
    """
    arrays = {name: value for name, value in kwargs.items() if isinstance(value, (jax.Array, np.ndarray))}
    static = {name: value for name, value in kwargs.items() if name not in arrays}

    def program(q, k, weights, cotangent, arrays):
        score = lambda q, k, weights: module.score(
            q, k, weights, **key_scale(module.VARIANT, k), **arrays, **static
        )
        out, vjp = jax.vjp(score, q, k, weights)
        return out, vjp(cotangent)

    compiled = jax.jit(program)
    return lambda q, k, weights, cotangent: compiled(q, k, weights, cotangent, arrays)


def reference_score(variant: dict, q, k, weights, **kwargs):
    """The float32 reference score, computed on the CPU."""
    scale = key_scale(variant, k)
    return on_cpu(
        lambda q, k, weights, kwargs: reference.score(q, k, weights, q_layout=variant["q_layout"], **kwargs),
        q, k, weights, {**scale, **kwargs},
    )  # fmt: skip


def reference_grads(variant: dict, q, k, weights, cotangent, **kwargs):
    """The reference VJP in float32 math, on the CPU: taken at float32 copies of the inputs, so gradients
    are not rounded to a float8 input's dtype (a float8 variant returns them as bfloat16)."""

    def grads(q, k, weights, cotangent, kwargs):
        upcast = [jnp.asarray(x, jnp.float32) for x in (q, k, weights)]
        scale = key_scale(variant, k)
        fn = lambda q, k, w: reference.score(q, k, w, q_layout=variant["q_layout"], **scale, **kwargs)
        return jax.vjp(fn, *upcast)[1](jnp.asarray(cotangent, jnp.float32))

    return on_cpu(grads, q, k, weights, cotangent, kwargs)


def bits(x) -> np.ndarray:
    """An array's bytes, to compare results bit for bit (a chip's host copy need not be contiguous)."""
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def relative_error(actual, expected) -> float:
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    scale = np.linalg.norm(expected)
    if scale == 0.0:  # an all-zero reference (say, the gradient of a fully masked problem)
        return float(np.linalg.norm(actual))
    return float(np.linalg.norm(actual - expected) / scale)


def assert_close(name: str, actual, expected_f32) -> None:
    """``actual`` (in its own dtype) against the float32 reference rounded to that dtype.

    NaN never passes; an infinity passes only where the reference holds the very same one (the
    masked entries), so the set of masked entries must match exactly.
    """
    assert actual.shape == expected_f32.shape, f"{name}: shape {actual.shape} != {expected_f32.shape}"
    values = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(jnp.asarray(expected_f32).astype(actual.dtype), jnp.float32))
    assert not np.isnan(values).any(), f"{name}: {np.isnan(values).sum()} NaN entries (unwritten?)"
    infinite = ~np.isfinite(expected)
    wrong = (infinite & (values != expected)) | (~infinite & ~np.isfinite(values))
    assert not wrong.any(), f"{name}: {wrong.sum()} entries masked where the reference is not, or the reverse"
    if (~infinite).any():
        error, bound = relative_error(values[~infinite], expected[~infinite]), rtol(actual.dtype)
        assert error <= bound, f"{name}: relative error {error:.3e} > {bound:.0e} ({actual.dtype})"


@contextlib.contextmanager
def tpu_lowering_target():
    """Mosaic's TPU lowering on a machine whose device is the CPU: a rank-1 block's legality (the sparse
    kernels' flat SMEM indices) depends on the chip's tiles, which the lowering asks the current device
    for. Inside this, a CPU device answers as a v5e does (the rule is the same on every TPU generation
    we target). Lowering only: nothing compiles or runs for that chip."""
    from jax._src.pallas.mosaic import tpu_info

    kind = jax.devices()[0].device_kind
    tpu_info.registry[kind] = lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    try:
        yield
    finally:
        tpu_info.registry.pop(kind, None)


def lower_tpu(fn, *args):
    """``jax.jit(fn)`` lowered for the TPU by Mosaic on this CPU-only machine (``tpu_lowering_target``)."""
    with tpu_lowering_target():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))


def lower_for_tpu(fn, *args) -> str:
    """Runs the Mosaic TPU lowering on this CPU-only machine; returns the StableHLO text."""
    return lower_tpu(fn, *args).as_text()


def mask_batch(seq_len: int, num_blocks: int, seed: int):
    """(kv_start, kv_end) [4, S] int32: one visibility pattern per batch element.

    0: random ranges, some empty, some reaching past either end of [0, W);
    1: causal CSA (compress rate 4) from position 0, so late w tiles are invisible;
    2: packed sequences: random segments, each seeing only blocks that start inside it;
    3: a context-parallel shard deep in a long context with a sliding window of 100 blocks.
    """
    from generated.csa_v4 import causal_kv_range

    rng = np.random.default_rng(seed)
    positions = np.arange(seq_len)
    random_start = rng.integers(-2, num_blocks, seq_len)
    random_end = rng.integers(0, num_blocks + 3, seq_len)
    causal = causal_kv_range(positions, 4)
    cuts = np.sort(rng.choice(np.arange(1, seq_len), size=min(3, seq_len - 1), replace=False))
    segment_starts = np.concatenate([[0], cuts])[np.searchsorted(cuts, positions, side="right")]
    packed = causal_kv_range(positions, 4, segment_starts)
    shard_end = causal_kv_range(4 * num_blocks - 4 * seq_len + positions, 4)[1]
    window = (jnp.maximum(shard_end - 100, 0), shard_end)
    kv_start = jnp.stack([jnp.asarray(random_start), causal[0], packed[0], window[0]]).astype(jnp.int32)
    kv_end = jnp.stack([jnp.asarray(random_end), causal[1], packed[1], window[1]]).astype(jnp.int32)
    return kv_start, kv_end


def pallas_calls(jaxpr):
    """Every pallas_call equation of a jaxpr, nested jaxprs (custom_vjp, pjit, scans) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for inner in _sub_jaxprs(eqn):
            yield from pallas_calls(inner)


def kernel_name(eqn, variant_name: str) -> str:
    """The kernel a pallas_call equation runs ("forward", "dq_dweights", "dk"), from its name."""
    return str(getattr(eqn.params["name"], "name", eqn.params["name"])).removeprefix(variant_name + "_")


def _sub_jaxprs(eqn):
    for param in eqn.params.values():
        for inner in param if isinstance(param, (tuple, list)) else (param,):
            inner = getattr(inner, "jaxpr", inner)
            if hasattr(inner, "eqns"):
                yield inner


def count_primitive(jaxpr, name: str) -> int:
    """How many times primitive ``name`` appears in a jaxpr, every nested jaxpr (cond branches, kernel
    bodies) included: what the traced program holds, whether or not a branch runs."""
    return sum(
        (eqn.primitive.name == name) + sum(count_primitive(j, name) for j in _sub_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def sparse_key_windows(monkeypatch, module, shape, top_k, windows):
    """Shrink the VMEM the sparse kernels of ``module`` (a variant module) plan for, so that the backward
    takes k of ``shape`` (B, H, S, D, W) in ``windows`` windows, one call each, and the forward (no dk
    held) in fewer (more than one where its gathered rows are as wide as the backward's); returns the
    rows of the backward's window."""
    from generated.csa_v4 import _gather, _geometry  # the family's own rule, not a copy of it

    _, heads, _, head_dim, num_blocks = shape
    rows = _geometry.round_up(-(-num_blocks // windows), _geometry.MIN_SUBLANES)
    q_dtype, pad = jnp.dtype(module.VARIANT["q_dtype"]), _geometry.sparse_top_k_pad(top_k)
    gathers = (module._sparse.SPARSE_GATHER_DTYPE, module._sparse.SPARSE_BACKWARD_GATHER_DTYPE)
    need = max(_geometry.sparse_vmem_bytes(rows, head_dim, heads, pad, dtype, q_dtype) for dtype in gathers)
    monkeypatch.setattr(_gather, "SPARSE_VMEM_CAPACITY_BYTES", int(need * _geometry.VMEM_HEADROOM) + 1)
    backward = _gather.sparse_key_windows(num_blocks, head_dim, heads, top_k, gathers[1], q_dtype, 1)
    forward = _gather.sparse_key_windows(num_blocks, head_dim, heads, top_k, gathers[0], q_dtype)
    assert backward[:2] == (rows, windows) and forward[1] < windows, (forward, backward)
    assert forward[1] > 1 or gathers[0] != gathers[1], (forward, backward)
    return rows
