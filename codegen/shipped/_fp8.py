"""float8: the per-token quantisation callers make float8 keys with, and the exact widening of
float8_e4m3fn operands inside the kernels (chosen per chip as a kernel is traced)."""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_per_token(x):
    """Quantises ``x [..., D]`` to float8_e4m3fn with one float32 scale per token (the last axis).

    Returns ``(x_fp8, scale)`` with ``x ~= x_fp8 * scale[..., None]``: each token's largest magnitude
    maps to 448, so the relative error is at most 2**-4 per element (3 mantissa bits). Use it for
    keys (``k_scale`` of the float8 variants). For queries, quantise ``[B, S, H, D]`` the same way
    and fold the scale into the weights: ``weights * q_scale`` is exact for relu, as the scale is positive.
    An all-zero token gets scale 1.
    """
    x = jnp.asarray(x, jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    x_fp8 = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return x_fp8, scale


# float8 q and k meet the MXU as bfloat16. v5e, v5p and v6e unpack float8 only as e4m3b11fnuz (exponent
# bias 11, no infinities, its one NaN at 0x80), so Mosaic lowers an e4m3fn convert to that unpack and
# seven float32 operations a vreg that fix it up (scale, zero, NaN). Read as e4m3b11fnuz, e4m3fn's bits
# are x / 16 (the same mantissa, the exponent 4 lower, subnormals included) once the two codes that
# differ are moved in the packed bytes (-0, NaN there, to +0; NaN, a finite 30 there, to 0x80), and a
# multiply by 16 is exact: 43% fewer vector operations (compiled, v6e: 2,176 against 3,840 per 512K
# elements). 7x unpacks e4m3fn to bfloat16 itself, so it and unknown chips keep astype.
E4M3B11_UNPACK_CHIPS = frozenset({"TPU_V5E", "TPU_V5P", "TPU_V6E"})


def upcast(x, dtype):
    """``x`` in the wider ``dtype``, exactly: float8_e4m3fn in the operations the chip being compiled
    for unpacks fastest (see E4M3B11_UNPACK_CHIPS; NaN stays NaN, -0 becomes +0), any other by astype."""
    if x.dtype != jnp.float8_e4m3fn or not unpacks_e4m3b11():
        return x.astype(dtype)
    bits = jax.lax.bitcast_convert_type(x, jnp.int8)
    bits = jnp.where(bits == -128, jnp.int8(0), bits)  # -0
    bits = jnp.where((bits & 0x7F) == 0x7F, jnp.int8(-128), bits)  # NaN
    sixteenth = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3b11fnuz).astype(jnp.float32)
    return (sixteenth * 16.0).astype(dtype)


def unpacks_e4m3b11():
    """Whether the chip being traced for is one of E4M3B11_UNPACK_CHIPS. Off a TPU (interpret mode)
    too, so that the CPU checks run the route three of the four target chips compile."""
    try:
        return pltpu.get_tpu_info().chip_version.name in E4M3B11_UNPACK_CHIPS
    except ValueError:  # not a TPU
        return True
