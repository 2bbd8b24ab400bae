"""What the compiled schedule cannot show, measured on the TPU at hand: the HBM bandwidth a copy reaches,
what an empty grid step costs, and what a step that brings in one block by DMA costs, by block size.

The compiled-schedule model (``codegen explain --compiled``) counts a kernel's bundles at one per cycle
with its DMAs overlapped; these three figures are the terms it lacks (docs/performance.md, "The model
against the chip"). Each is a Pallas kernel of its own, timed like ``codegen bench`` does.

    python benchmarks/chip_constants.py [--json FILE]      # on a TPU; exits 2 without one
"""

from __future__ import annotations

import argparse
import json
import sys

from codegen import bench

COPY_BYTES = 256 * 2**20  # large enough that a call's fixed cost is lost in it
STEPS = 4096  # grid steps of the empty kernel
DMA_BLOCKS = (2**14, 2**16, 2**18, 2**20, 2**22)  # bytes per step of the one-DMA kernel


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def hbm_copy():
    """GB/s of a Pallas copy of COPY_BYTES bf16 (read and written once: 2 * COPY_BYTES bytes moved)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    rows = COPY_BYTES // (2 * 1024)
    x = jnp.ones((rows, 1024), jnp.bfloat16)
    block = 2048
    copy = pl.pallas_call(
        _copy_kernel,
        grid=(rows // block,),
        in_specs=[pl.BlockSpec((block, 1024), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((block, 1024), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    )
    ms = bench.median_ms(jax.jit(copy), (x,), 10)
    return {"ms": ms, "gb_per_s": 2 * COPY_BYTES / (ms * 1e-3) / 1e9}


def _empty_kernel(x_ref, o_ref):
    del x_ref, o_ref  # the step does nothing: what is left is the step itself


def empty_steps():
    """Microseconds per grid step of a kernel whose steps do nothing and fetch nothing new (one
    resident block for every step, as a skipped step's index map should point)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    x = jnp.ones((8, 128), jnp.float32)
    out = {}
    for steps in (STEPS // 8, STEPS):
        call = pl.pallas_call(
            _empty_kernel,
            grid=(steps,),
            in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        )
        out[steps] = bench.median_ms(jax.jit(call), (x,), 10)
    small, large = STEPS // 8, STEPS
    per_step_us = 1e3 * (out[large] - out[small]) / (large - small)
    return {"ms": out, "us_per_step": per_step_us, "fixed_us": 1e3 * out[small] - per_step_us * small}


def _sum_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[:8, :]


def one_dma_per_step():
    """Per block size: microseconds per step of a kernel that brings in one new block each step (and
    writes one (8, 128) tile), and the bandwidth that makes."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    rows_total = 2**27 // (2 * 1024)  # 128 MiB of bf16 rows of 1024
    x = jnp.ones((rows_total, 1024), jnp.bfloat16)
    out = []
    for block_bytes in DMA_BLOCKS:
        rows = block_bytes // (2 * 1024)
        steps = rows_total // rows
        call = pl.pallas_call(
            _sum_kernel,
            grid=(steps,),
            in_specs=[pl.BlockSpec((rows, 1024), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((None, 8, 1024), lambda i: (i, 0, 0)),
            out_shape=jax.ShapeDtypeStruct((steps, 8, 1024), x.dtype),
        )
        ms = bench.median_ms(jax.jit(call), (x,), 10)
        out.append(
            {"block_bytes": block_bytes, "steps": steps, "us_per_step": 1e3 * ms / steps,
             "gb_per_s": block_bytes * steps / (ms * 1e-3) / 1e9}  # fmt: skip
        )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if bench.backend_quietly() != "tpu":
        print("chip_constants: no TPU here; it measures on a TPU only")
        return 2
    found = {
        **bench.environment(),
        "hbm_copy": hbm_copy(),
        "empty_steps": empty_steps(),
        "one_dma": one_dma_per_step(),
    }
    print(json.dumps(found, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
