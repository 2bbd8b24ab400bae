"""Suite-wide settings, applied before JAX starts its CPU backend, and the per-variant fixture."""

import os

# Interpret-mode kernels are tiny programs run once: XLA's CPU compile dominates the suite's time,
# and its backend optimisations (which do not change float semantics) cost more than they save.
os.environ["XLA_FLAGS"] = " ".join(
    flag for flag in (os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0") if flag
)
# The suite runs on the CPU. With libtpu installed (the tpu extra, for the compile tests) JAX would try,
# and fail, to start a TPU backend first; the TPU compiler runs in child processes of its own.
os.environ["JAX_PLATFORMS"] = "cpu"

import pytest  # noqa: E402

from generated.csa_v4 import VARIANTS  # noqa: E402


@pytest.fixture(params=sorted(VARIANTS))
def module(request):
    """Each generated variant module in turn: a test taking it runs once per variant (id: its name)."""
    return VARIANTS[request.param]
