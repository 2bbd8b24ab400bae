"""Runs tests/multidevice/sharding_checks.py on 8 simulated CPU devices, in a process of its own, and the
one-device mesh here (what runs on a single chip too).

XLA fixes the CPU device count when JAX starts, and the rest of the suite runs on one device, so
the multi-device checks get their own interpreter (and this suite's conftest flags, as it is the
same tests/ tree).
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from generated.csa_v4 import VARIANTS
from tests import support

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKS = "tests/multidevice/sharding_checks.py"


def test_sharding_on_eight_devices():
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f
    ]
    env = dict(os.environ, XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=8"]))
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", CHECKS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert (
        result.returncode == 0
    ), f"{CHECKS} failed on 8 devices:\n{result.stdout[-20000:]}\n{result.stderr[-5000:]}"
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


@pytest.mark.chip
def test_sharded_score_and_topk_on_a_one_device_mesh():
    """``sharded_score`` and ``sharded_score_topk`` on a mesh of this process's one device (data x context,
    both of size 1: what a single-chip user's mesh is) are ``score`` and ``score_topk``, bit for bit,
    forward and gradients, on causal, packed and windowed masks."""
    module = VARIANTS["tpu_sm_bf16_q16_w128_hc16"]
    shape = (2, 32, 40, 128, 300)
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed=41)
    kv_start, kv_end = (x[1:3] for x in support.mask_batch(shape[2], shape[4], seed=42))
    bounds = dict(kv_start=kv_start, kv_end=kv_end)
    cotangent = jax.random.normal(jax.random.PRNGKey(43), (2, 40, 300)).astype(module.VARIANT["out_dtype"])
    mesh = jax.make_mesh((1, 1), ("data", "context"), axis_types=(AxisType.Auto,) * 2)
    on_mesh = dict(mesh=mesh, context_axis="context", interpret=support.INTERPRET)

    def score_and_grads(fn):
        def run(q, k, weights, cotangent):
            out, vjp = jax.vjp(lambda q, k, w: fn(q, k, w, **bounds), q, k, weights)
            return out, vjp(cotangent)

        return jax.jit(run)(q, k, weights, cotangent)

    single = score_and_grads(functools.partial(module.score, interpret=support.INTERPRET))
    sharded = score_and_grads(functools.partial(module.sharded_score, **on_mesh))
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    support.assert_close(
        "sharded_score", sharded[0], support.reference_score(module.VARIANT, q, k, weights, **bounds)
    )

    top_k = 24
    topk = lambda fn: jax.jit(lambda q, k, w: fn(q, k, w, top_k, **bounds))(q, k, weights)
    single = topk(functools.partial(module.score_topk, interpret=support.INTERPRET))
    sharded = topk(functools.partial(module.sharded_score_topk, **on_mesh))
    assert (np.asarray(single[0]) >= 0).any() and (np.asarray(single[0]) < 0).any()
    for got, want in zip(sharded, single):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
