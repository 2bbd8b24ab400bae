"""TPU tile geometry and byte units: the one place these numbers are written.

A vreg holds 8 sublanes x 128 lanes of 32 bits, so a narrower dtype packs more rows into one tile:
Mosaic lays out a VMEM block's last dimension in 128 lanes and the one before it in rows of this
granule. Blocks the generator shrinks to a small problem are rounded to it; the cost model pads
every VMEM block to it; the budget warns about blocks that are not a multiple of it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

KIB, MIB = 2**10, 2**20
LANES = 128
SUBLANES_BY_ITEMSIZE = {4: 8, 2: 16, 1: 32}
# Mosaic's legality rule: a block's last two dimensions are multiples of (8, 128) or span the array.
MIN_SUBLANES = SUBLANES_BY_ITEMSIZE[4]


def itemsize(dtype: str) -> int:
    """Bytes per element of a numpy or ml_dtypes name ("float32", "bfloat16", "float8_e4m3fn", ...)."""
    return np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize


def sublanes(dtype: str) -> int:
    """Rows of one native tile of ``dtype``."""
    return SUBLANES_BY_ITEMSIZE[itemsize(dtype)]


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
