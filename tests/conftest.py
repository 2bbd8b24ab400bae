"""Suite-wide settings, applied before JAX starts its backend, and the per-variant fixtures.

Two ways to run the suite:

- on the CPU (the default, and CI): the kernels run in Pallas' interpret mode; every test runs.
- on a TPU, ``CSA_ON_CHIP=1 python -m pytest -m chip -p no:xdist``: the tests marked ``chip`` run their
  kernels compiled by Mosaic on the chip (no interpret mode), in one process, since one program at a
  time holds a TPU. Only ``chip`` tests run then (``-m chip`` is implied); the references still
  compute on the CPU, in float32 at HIGHEST precision.
"""

import os

ON_CHIP = os.environ.get("CSA_ON_CHIP", "") == "1"

if not ON_CHIP:
    # Interpret-mode kernels are tiny programs run once: XLA's CPU compile dominates the suite's time,
    # and its backend optimisations (which do not change float semantics) cost more than they save.
    os.environ["XLA_FLAGS"] = " ".join(
        flag for flag in (os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0") if flag
    )
    # The suite runs on the CPU. With libtpu installed (the tpu extra, for the compile tests) JAX would
    # try, and fail, to start a TPU backend first; the TPU compiler runs in child processes of its own.
    os.environ["JAX_PLATFORMS"] = "cpu"
else:
    # The chip for the kernels, the CPU beside it for the float32 references.
    os.environ["JAX_PLATFORMS"] = "tpu,cpu"

import pytest  # noqa: E402

from generated.csa_v4 import VARIANTS  # noqa: E402


def pytest_configure(config):
    """On the chip only the ``chip`` tests run; without a TPU there the run stops at once, saying so."""
    if not ON_CHIP:
        return
    import jax

    if jax.default_backend() != "tpu":
        raise pytest.UsageError(
            f"CSA_ON_CHIP=1 needs a TPU, but JAX's default backend is {jax.default_backend()!r}"
        )
    if config.pluginmanager.hasplugin("xdist") and getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("CSA_ON_CHIP=1 runs in one process (one program holds the chip): drop -n")
    config.option.markexpr = f"({config.option.markexpr}) and chip" if config.option.markexpr else "chip"


@pytest.fixture(params=sorted(VARIANTS))
def module(request):
    """Each generated variant module in turn: a test taking it runs once per variant (id: its name)."""
    return VARIANTS[request.param]


def _one_per(keys):
    """The first variant (by name) of each distinct value of ``keys`` in its VARIANT."""
    chosen = {}
    for name in sorted(VARIANTS):
        chosen.setdefault(tuple(VARIANTS[name].VARIANT[k] for k in keys), name)
    return sorted(chosen.values())


@pytest.fixture(params=_one_per(("q_layout", "q_dtype", "weights_dtype", "out_dtype", "k_scale")))
def layout_module(request):
    """One variant module per layout and dtype policy, for what the shared runtime does the same for
    every tiling, head chunk and backward (the checks of a call, say)."""
    return VARIANTS[request.param]


@pytest.fixture(
    params=sorted({min(n for n in VARIANTS if VARIANTS[n]._dense is m._dense) for m in VARIANTS.values()})
)
def kernels_module(request):
    """One variant module per shared dense kernel module (``_dense_*``): for what the kernels' code
    decides (grids, index maps, prefetch), whatever the tiling and dtypes the variant passes in."""
    return VARIANTS[request.param]


# One variant per shared sparse kernel module (``_sparse_*``): for what its code decides whatever the
# variant passes in (the windows of k, say).
ONE_PER_SPARSE_KERNELS = sorted(
    {min(n for n in VARIANTS if VARIANTS[n]._sparse is m._sparse) for m in VARIANTS.values()}
)


# One variant per layout, dtype policy and backward: what the sparse kernels depend on.
SPARSE_MODULES = _one_per(("q_layout", "q_dtype", "weights_dtype", "out_dtype", "k_scale", "backward"))


@pytest.fixture(params=SPARSE_MODULES)
def sparse_module(request):
    """One variant module per layout, dtype policy and backward: what the sparse kernels depend on
    (they use none of a variant's tiling or head chunk)."""
    return VARIANTS[request.param]


# The suite's longest tests (each minutes, or close: a subprocess of its own or the masked gradients of
# the 1024-wide variants), slowest first. They are collected first so that pytest-xdist starts them
# first, one per worker, and the hundreds of short tests fill in around them: collected in file order,
# the last of them started near the end and left the other core idle for minutes.
_LONGEST_FIRST = (
    "tests/test_sharding.py::",
    "tests/test_work.py::test_executed_mxu_work",
    "tests/test_sparse.py::test_sparse_gradient_executes_mxu_work",
    "tests/test_readme.py::",
    "tests/test_compiled.py::test_compiled_schedule",
    "tests/test_masking.py::test_masked_forward_top_k_gradients_and_skipped_tiles[tpu_sm_",
    "tests/test_masking.py::test_masked_forward_top_k_gradients_and_skipped_tiles[tpu_hm_fp8",
)


def pytest_collection_modifyitems(items):
    """Moves the longest tests to the front, in the order of ``_LONGEST_FIRST`` (a stable sort: the same
    order on every xdist worker, as xdist requires)."""

    def rank(item):
        return next((i for i, prefix in enumerate(_LONGEST_FIRST) if item.nodeid.startswith(prefix)), None)

    items.sort(key=lambda item: (rank(item) is None, rank(item) or 0))
