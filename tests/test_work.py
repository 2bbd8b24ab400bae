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

PRODUCTION = "tpu_hm_bf16_q256_w2048c512f256_hc16"
# Causal CSA (S queries see at most S / 4 blocks) leaves compute blocks with no work: whole w tiles
# (at the production tiling S = 1024 sees up to 256 of 4096 blocks, so the second 2048-wide tile of
# every q block is empty) and compute blocks inside the first.
SHAPES = {
    "tpu_hm_bf16_q16_w128_hc16": (1, 16, 64, 64, 256),
    "tpu_sm_f32_q16_w128_hcall": (1, 16, 64, 64, 256),
    "tpu_sm_fp8_q256_w2048c512f256_hcall": (1, 16, 256, 64, 2048),
    PRODUCTION: (1, 16, 1024, 8, 4096),
}


def _model(name, shape, bounds):
    """MXU FLOPs of the forward and of forward + gradient (grad runs the forward too), from the plan."""
    the_plan = family().plan(name)
    calls = cost.call_kernels(the_plan, shape)  # the forward, and the backward kernels this W takes
    flops = {k.name: cost.kernel_cost(the_plan, k, shape, bounds).mxu_flops for k in calls}
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
        assert executed[name]["causal"] == _model(name, shape, cost.causal_bounds(t.shape, rate)), name
    # The production tiling's backward skips whole tiles no query sees, and compute blocks inside tiles
    # with work.
    the_plan = family().plan(PRODUCTION)
    t = cost.tiling(the_plan, SHAPES[PRODUCTION], the_plan.kernel("dk"))
    kinds = cost.causal_kinds(t, rate)
    assert kinds.empty > t.block_w // t.compute_w * (kinds.tiles - kinds.tiles_with_work) > 0


@pytest.mark.version_free
def test_causal_prefill_at_the_production_tiling_leaves_nine_sixteenths_of_the_backward_work():
    """DeepSeek-V4 prefill, S = 8192, W = 2048, causal: the executed-work model (held to the executed
    count above) against the same call unmasked, per pass, for the production tiling. Its 256 x 2048
    tiles are eight 256-wide compute blocks each in the backward (docs/performance.md, "A width per
    pass"): q block i sees 64 (i + 1) blocks, so the backward has work in ceil((i + 1) / 4) of its 8
    compute blocks, 144 of 256, and the forward's pieces cover ceil((i + 1) / 2) of its 16 lane groups,
    272 of 512."""
    shape = (1, 64, 8192, 128, 2048)
    bounds = cost.causal_bounds(cost.Shape(*shape), family().spec.computation.compress_rate)
    masked, unmasked = _model(PRODUCTION, shape, bounds), _model(PRODUCTION, shape, None)
    # dq/dweights' finish runs once per q block and head chunk, mask or not: B*S*H*D entries, one-hot
    # broadcast of the chunk's 16 heads' weights (2 * 16 FLOPs each)
    finish = 8192 * 64 * 128 * 2 * 16
    backward = (masked["gradient"] - masked["forward"] - finish) / (
        unmasked["gradient"] - unmasked["forward"] - finish
    )
    assert np.isclose(masked["forward"] / unmasked["forward"], 272 / 512), masked
    assert np.isclose(backward, 144 / 256), backward


@pytest.mark.parametrize("name", sorted(n for n, m in VARIANTS.items() if m.VARIANT["backward"] == "fused"))
def test_the_dk_kernel_transposes_twice_per_head_group(name):
    """dk multiplies the stacked q by dlogits transposed, so the traced dk kernel holds one transpose per
    head group for its float32 dlogits (once, before any split into a bfloat16 head and tail), and a
    head-major one a second: the group's [block_q, heads] weights, into a column per head (sequence-major
    stacking wants each query's weights along sublanes, a reshape)."""
    module = VARIANTS[name]
    found = {}
    for heads in (16, 32):
        shape = (1, heads, 40, 128, 300)
        q, k, weights = support.make_inputs(module.VARIANT, shape, seed=0)
        loss = lambda q, k, weights: jnp.sum(support.call(module, q, k, weights).astype(jnp.float32))
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, weights)
        # dk, or dq_dk where one w tile covers W (it transposes for dk alone: dq's u needs none)
        [dk] = [
            e for e in support.pallas_calls(jaxpr.jaxpr) if support.kernel_name(e, name) in ("dk", "dq_dk")
        ]
        found[heads] = support.count_primitive(dk.params["jaxpr"], "transpose")
    # a step holds one head chunk (or all heads), stacked GRAD_HEAD_GROUP = 16 per matmul; its compute
    # blocks run one body (a loop where there are several), so the transposes are written once
    groups = {h: -(-(module.VARIANT["head_chunk"] or h) // 16) for h in (16, 32)}
    per_group = 2 if module.VARIANT["q_layout"] == "head_major" else 1
    assert found == {h: per_group * n for h, n in groups.items()}, found
