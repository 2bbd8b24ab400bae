"""What every test needs: random inputs for a variant, its reference, comparison and TPU lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from codegen import reference
from tests.tolerances import rtol


# TPU-faithful interpretation: uninitialised VMEM and outputs read as NaN, races and
# out-of-bounds block reads are reported.
def tpu_interpret_params():
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", out_of_bounds_reads="raise")


def races_found() -> bool:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    return bool(interpret_pallas_call.races is not None and interpret_pallas_call.races.races_found)


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


def reference_score(variant: dict, q, k, weights, **kwargs):
    return reference.score(q, k, weights, q_layout=variant["q_layout"], **kwargs)


def relative_error(actual, expected) -> float:
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def assert_close(name: str, actual, expected_f32) -> None:
    """``actual`` (in its own dtype) against the float32 reference rounded to that dtype."""
    assert actual.shape == expected_f32.shape, f"{name}: shape {actual.shape} != {expected_f32.shape}"
    values = np.asarray(jnp.asarray(actual, jnp.float32))
    assert np.all(
        np.isfinite(values)
    ), f"{name}: {np.sum(~np.isfinite(values))} non-finite entries (unwritten?)"
    expected = jnp.asarray(expected_f32).astype(actual.dtype)
    error, bound = relative_error(actual, expected), rtol(actual.dtype)
    assert error <= bound, f"{name}: relative error {error:.3e} > {bound:.0e} ({actual.dtype})"


def lower_for_tpu(fn, *args) -> str:
    """Runs the Mosaic TPU lowering on this CPU-only machine; returns the StableHLO text."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
