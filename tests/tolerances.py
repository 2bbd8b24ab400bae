"""Every tolerance of the suite, stated once, keyed by the dtype of the array compared.

The metric is the relative Frobenius error ``||x - ref|| / ||ref||``. The reference computes in
float32 at HIGHEST precision on the very inputs the kernel received (bfloat16 inputs upcast
exactly), and its result is rounded to the dtype the kernel returns. What is left to the kernel
is the order of float32 summation over D and heads: about sqrt(H * D) * 2**-24 ~ 1e-6 relative
for H * D = 4096, so float32 allows 1e-5, ten times that and still ~1000x below the ~1/H error
of a dropped head or a dropped D slice. A bfloat16 result may additionally round the other way
where a float32 sum lands near a rounding boundary: one ulp (2**-7 relative at most) on a small
fraction of elements, which 2e-3 covers while a missing term (>= 1/64 relative) does not pass.
"""

import numpy as np

RTOL = {"float32": 1e-5, "bfloat16": 2e-3}


def rtol(dtype) -> float:
    return RTOL[np.dtype(dtype).name]
