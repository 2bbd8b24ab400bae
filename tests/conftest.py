"""Suite-wide settings, applied before JAX starts its CPU backend."""

import os

# Interpret-mode kernels are tiny programs run once: XLA's CPU compile dominates the suite's time,
# and its backend optimisations (which do not change float semantics) cost more than they save.
os.environ["XLA_FLAGS"] = " ".join(
    flag for flag in (os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0") if flag
)
