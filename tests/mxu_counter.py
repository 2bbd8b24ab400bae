"""Counts the MXU work a call really executes: every ``dot_general`` is wrapped in a debug callback
that adds its FLOPs when it runs. In interpret mode only the branches that execute run, so a tile
skipped under ``pl.when`` counts nothing. (The project's own counter, in the manner of the shared
``mxu_work.py`` tool, so the tests run without it.)

Patching is process-wide and traces made before it do not count: use it in a fresh process
(``python -m tests.mxu_counter``, as ``test_work.py`` does).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import numpy as np
from jax._src.lax import lax as lax_internal

_ORIGINAL = lax_internal.dot_general
_LOCK = threading.Lock()
_COUNT = [0]


def _add(flops):
    with _LOCK:  # callbacks may run on several threads at once
        _COUNT[0] += int(flops)


def _counting_dot_general(lhs, rhs, dimension_numbers, *args, **kwargs):
    out = _ORIGINAL(lhs, rhs, dimension_numbers, *args, **kwargs)
    (lhs_contract, _), _ = dimension_numbers
    contract = int(np.prod([lhs.shape[d] for d in lhs_contract])) if lhs_contract else 1
    jax.debug.callback(_add, 2 * int(np.prod(out.shape)) * contract)
    return out


@contextlib.contextmanager
def installed():
    """Every dot_general reached through ``jax.lax`` counts its FLOPs while this is open."""
    saved = jax.lax.dot_general
    jax.lax.dot_general = _counting_dot_general
    try:
        yield
    finally:
        jax.lax.dot_general = saved


def executed_flops(fn) -> int:
    """MXU FLOPs the dots executed while running ``fn()`` (waits for its results and every count)."""
    with _LOCK:
        _COUNT[0] = 0
    jax.block_until_ready(fn())
    jax.effects_barrier()  # debug callbacks run asynchronously: wait for every count
    return _COUNT[0]


def _measure(name: str, shape: tuple[int, ...], causal: bool) -> dict[str, int]:
    """Executed MXU FLOPs of the forward and of forward + gradient of variant ``name``."""
    import jax.numpy as jnp

    from generated.csa_v4 import VARIANTS, causal_kv_range
    from tests import support

    module = VARIANTS[name]
    batch, _, seq_len, _, num_blocks = shape
    q, k, weights = support.make_inputs(module.VARIANT, shape, seed=0)
    if causal:
        kv_start, kv_end = causal_kv_range(jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len)))
    else:
        kv_start, kv_end = None, None
    score = lambda q, k, weights: support.call(
        module, q, k, weights, kv_start=kv_start, kv_end=kv_end, interpret=True
    )

    def loss(q, k, weights):
        out = score(q, k, weights).astype(jnp.float32)
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0))

    with installed():
        return {
            "forward": executed_flops(lambda: score(q, k, weights)),
            "gradient": executed_flops(lambda: jax.grad(loss, argnums=(0, 1, 2))(q, k, weights)),
        }


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="VARIANT:B,H,S,D,W")
    args = parser.parse_args()
    found = {}
    for run in args.runs:
        name, shape = run.split(":")
        shape = tuple(int(x) for x in shape.split(","))
        found[name] = {mask: _measure(name, shape, mask == "causal") for mask in ("unmasked", "causal")}
    print(json.dumps(found))
