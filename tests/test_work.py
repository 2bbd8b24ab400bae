"""The work model against the MXU work the kernels really execute (counted as each dot runs, in a
fresh process: see ``tests/mxu_counter.py``), unmasked and under a causal mask."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

from codegen import cost
from generated.csa_v4 import VARIANTS, causal_kv_range, tile_ranges
from tests.spec_cases import ROOT, family

# One head chunk of 16 and two w tiles: causal CSA (S queries see at most S / 4 blocks) leaves the
# second w tile with no work for every q block.
SHAPES = {
    "tpu_hm_bf16_q16_w128_hc16": (1, 16, 64, 64, 256),
    "tpu_sm_f32_q16_w128_hcall": (1, 16, 64, 64, 256),
    "tpu_sm_fp8_q128_w1024_hc16": (1, 16, 256, 64, 2048),
}


def _active_fraction(module, shape) -> float:
    """The share of tiles the kernels' own scalar-prefetch ranges give work under the causal mask."""
    batch, _, seq_len, _, num_blocks = shape
    kv_start, kv_end = causal_kv_range(jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len)))
    block_q, block_w = module.tiles(seq_len, num_blocks)
    num_w_blocks = -(-num_blocks // block_w)
    w_lo, w_hi, _, _ = tile_ranges(kv_start, jnp.clip(kv_end, 0, num_blocks), block_q, block_w, num_w_blocks)
    return float(np.sum(np.asarray(w_hi) - np.asarray(w_lo))) / (w_lo.size * num_w_blocks)


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
    for name, shape in SHAPES.items():
        the_plan = family().plan(name)
        model = {c.kernel: c.mxu_flops for c in cost.variant_costs(the_plan, shape)}
        expected = {"forward": model["forward"], "gradient": sum(model.values())}  # grad runs the forward too
        assert executed[name]["unmasked"] == expected, name
        fraction = _active_fraction(VARIANTS[name], shape)
        assert 0 < fraction < 1, name  # the mask must leave tiles to skip, or this checks nothing
        assert executed[name]["causal"] == {
            kind: int(flops * fraction) for kind, flops in expected.items()
        }, name
