"""The work model against the MXU work the kernels really execute (counted as each dot runs, in a
fresh process: see ``tests/mxu_counter.py``), unmasked and under a causal mask; and the work the
production tiling leaves at the DeepSeek-V4 causal prefill shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from codegen import cost
from generated.csa_v4 import VARIANTS
from tests import support
from tests.spec_cases import ROOT, family

PRODUCTION = "tpu_hm_bf16_q128_w1024_hc16"
# Causal CSA (S queries see at most S / 4 blocks) leaves compute blocks with no work: with one head
# chunk of 16 and the small tiling, whole w tiles; with the production tiling, compute blocks inside
# its 1024-wide DMA tile (S = 1024 sees up to 256 of 1024 blocks: 2 of 8 compute blocks at most).
SHAPES = {
    "tpu_hm_bf16_q16_w128_hc16": (1, 16, 64, 64, 256),
    "tpu_sm_f32_q16_w128_hcall": (1, 16, 64, 64, 256),
    "tpu_sm_fp8_q128_w1024_hc16": (1, 16, 256, 64, 2048),
    PRODUCTION: (1, 16, 1024, 8, 1024),
}


def _model(name, shape, kinds):
    """MXU FLOPs of the forward and of forward + gradient (grad runs the forward too), from the plan."""
    flops = {c.kernel: c.mxu_flops for c in cost.variant_costs(family().plan(name), shape, kinds)}
    return {"forward": flops["forward"], "gradient": sum(flops.values())}


@pytest.mark.version_free
def test_executed_mxu_work_is_the_plans_work_model():
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.mxu_counter",
            *(f"{n}:{','.join(map(str, s))}" for n, s in SHAPES.items()),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    executed = json.loads(result.stdout.splitlines()[-1])
    rate = family().spec.computation.compress_rate
    for name, shape in SHAPES.items():
        t = cost.tiling(family().plan(name), shape)
        assert executed[name]["unmasked"] == _model(name, shape, None), name
        kinds = cost.causal_kinds(t, rate)
        assert kinds.empty and kinds.work, name  # the mask must leave blocks to skip, or this checks nothing
        assert executed[name]["causal"] == _model(name, shape, kinds), name
    # Inside one DMA tile: the production tiling skips compute blocks, not only whole tiles.
    kinds = cost.causal_kinds(cost.tiling(family().plan(PRODUCTION), SHAPES[PRODUCTION]), rate)
    assert kinds.tiles_with_work == kinds.tiles and kinds.empty > 0


@pytest.mark.version_free
def test_causal_prefill_at_the_production_tiling_leaves_at_most_055_of_the_work():
    """DeepSeek-V4 prefill, S = 8192, W = 2048, causal: the executed-work model (held to the executed
    count above) against the same call unmasked, per kernel, for the production DMA tiling."""
    shape = (1, 64, 8192, 128, 2048)
    the_plan = family().plan(PRODUCTION)
    kinds = cost.causal_kinds(cost.tiling(the_plan, shape), family().spec.computation.compress_rate)
    masked, unmasked = _model(PRODUCTION, shape, kinds), _model(PRODUCTION, shape, None)
    ratios = {kind: masked[kind] / unmasked[kind] for kind in masked}
    assert all(ratio <= 0.55 for ratio in ratios.values()), ratios
    assert np.isclose(ratios["forward"], 0.53125), ratios  # 544 of 1024 (q block, compute block) pairs


@pytest.mark.parametrize("name", sorted(n for n, m in VARIANTS.items() if m.VARIANT["backward"] == "fused"))
def test_the_dk_kernel_transposes_the_cotangent_once_per_compute_block(name):
    """dk computes transposed logits (k . q_h^T), so no tile is transposed per head: the traced dk
    kernel holds one transpose per compute block (of the cotangent), whatever the number of heads."""
    module = VARIANTS[name]
    found = {}
    for heads in (16, 32):
        shape = (1, heads, 40, 128, 300)
        q, k, weights = support.make_inputs(module.VARIANT, shape, seed=0)
        loss = lambda q, k, weights: jnp.sum(support.call(module, q, k, weights).astype(jnp.float32))
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, weights)
        [dk] = [e for e in support.pallas_calls(jaxpr.jaxpr) if support.kernel_name(e, name) == "dk"]
        found[heads] = support.count_primitive(dk.params["jaxpr"], "transpose")
    _, block_w = module.tiles(40, 300)
    compute_blocks = block_w // module.COMPUTE_W
    assert found == {16: compute_blocks, 32: compute_blocks}, found
