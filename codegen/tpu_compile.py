"""Compile a variant's programs with the real TPU compiler, ahead of time, on a machine without a TPU.

libtpu (the ``tpu`` extra: ``pip install -e ".[tpu]"``) compiles for a TPU topology that is not here
(``jax.experimental.topologies``): XLA's TPU pipeline and Mosaic's TPU passes (layout inference,
alignment proofs, scheduling) run as they would on the chip, which the CPU lowering
(``lowering_platforms=("tpu",)``) stops short of. Each program compiles in a child process of its own,
since libtpu reads its dump flags once per process: ``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR`` makes it
write every kernel's final schedule (``codegen.schedule`` reads it), and ``ALLOW_MULTIPLE_LIBTPU_LOAD``
lets several such processes run at once.

    python -m codegen.tpu_compile JSON   # the child: one program, one JSON line of result on stdout
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# The chips the compile targets, as topologies JAX knows without a TPU (a 2x2 slice: the smallest
# each names; one device of it is used).
TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "7x": "tpu7x:2x2x1"}
# A variant's programs: its score forward, the gradient of a loss through it, and the same for
# sparse_score. Each compiles the kernels listed.
PROGRAMS = {
    "fwd": ("forward",),
    "grad": ("forward", "dq_dweights", "dk", "dq_dk"),  # dq_dk, or the other two: ``cost.call_kernels``
    "sparse_fwd": ("sparse_forward",),
    "sparse_grad": ("sparse_forward", "sparse_backward"),
    # sparse_score's dense route: the score over the selection's span, each slot taken from it, and in
    # the gradient the slots' cotangents put back (``_take``) before the dense backward
    "route_grad": ("forward", "dq_dweights", "dk", "dq_dk", "take_slots", "put_slots"),
    # score_topk: the forward kernel on query chunks, each cut by the selection kernel (rows too wide for
    # VMEM: by the threshold kernel and XLA's compaction; ``_topk.selection_kernel`` says which)
    "topk": ("forward", "topk_select"),
}
# What `codegen compile` compiles by default: a gradient program runs its forward kernel too (the
# custom VJP's forward pass is the same pallas_call), so the forward programs alone add no kernel.
GATE_PROGRAMS = ("grad", "sparse_grad", "route_grad")
SPARSE_PROGRAMS = ("sparse_fwd", "sparse_grad")
ROUTE_PROGRAMS = ("route_grad",)
CALIBRATION = "calibration"  # the plain matmul every kernel's cycles are compared with
# Only the schedules this package reads: without the filter libtpu writes every pass of every
# kernel (hundreds of files per program).
DUMP_FILTER = "--xla_jf_dump_llo_pass_label_regex=final"


def available() -> bool:
    """Whether libtpu, and so the TPU compiler, is installed (the ``tpu`` extra)."""
    return importlib.util.find_spec("libtpu") is not None


MISSING = 'the TPU compiler (libtpu) is not installed: pip install -e ".[tpu]" (part of ".[test]")'


@dataclasses.dataclass(frozen=True)
class Request:
    """One program to compile: a variant's (``family``, the generated package) or the calibration
    matmul (``program == CALIBRATION``, with ``calibration`` = (head_dim, operand dtype, precision,
    output dtype, block_m, block_n))."""

    family: str
    variant: str
    chip: str
    program: str
    shape: tuple[int, int, int, int, int]  # B, H, S, D, W
    top_k: int = 512
    causal: bool = True  # kv_start / kv_end passed (a compile sees their shapes, not their values)
    calibration: tuple = ()
    path: str = ""  # a folder to import ``family`` from (a scratch package), else the usual sys.path


@dataclasses.dataclass(frozen=True)
class Result:
    request: Request
    ok: bool
    error: str  # Mosaic's (or XLA's) message when not ok
    seconds: float
    dump: str  # the folder the schedules were written to (deleted unless kept)

    def programs(self) -> dict[str, tuple[str, str]]:
        """{program name: (final bundles, per-bundle utilization)} of everything the compile wrote a
        schedule for: the Pallas kernels (as ``kernels`` names them, with XLA's ".N" suffix) and XLA's
        own programs (fusions, copies, sorts, named as the HLO instructions they run), not the
        top-level program that calls them."""
        out = {}
        for path in sorted(glob.glob(os.path.join(self.dump, "*-final_bundles.txt"))):
            m = re.match(r"(\d+-(.+?))-\d+-final_bundles\.txt$", os.path.basename(path))
            if not m or m.group(2) in out or m.group(2) == "TLP" or m.group(2).startswith("<"):
                continue
            util = glob.glob(
                os.path.join(self.dump, m.group(1) + "-*-final_hlo-static-per-bundle-utilization.txt")
            )
            if util:
                out[m.group(2)] = (path, util[0])
        return out

    def hlo(self) -> str:
        """The optimised HLO of the top-level program (what calls the programs), or '' if not dumped."""
        found = glob.glob(os.path.join(self.dump, "*-TLP-hlo.txt"))
        if not found:
            return ""
        with open(found[0]) as f:
            return f.read()

    def kernels(self) -> dict[str, tuple[str, str]]:
        """{kernel name: (final bundles, per-bundle utilization)} of the Pallas kernels compiled (and of
        XLA's programs), named without XLA's ".N" suffix: the first of a name's programs."""
        out = {}
        for name, files in self.programs().items():
            out.setdefault(re.sub(r"\.\d+$", "", name), files)
        return out


def mosaic_message(error: str) -> str:
    """The line of a compile error that says what Mosaic (or XLA) refused, without the stack."""
    text = " ".join(error.split())
    m = re.search(
        r"(Mosaic failed to compile TPU kernel.*?)(?: The MLIR operation involved| Please report|$)", text
    )
    found = m.group(1) if m else text
    return found[:600]


def failed_kernel(result: Result, variant: str) -> str:
    """The kernel a failed compile names (Mosaic names its MLIR module after the pallas_call)."""
    m = re.search(r"MLIR module name `([^`]+)`", result.error)
    if not m:
        return "(none named: XLA's own passes)"
    return m.group(1).removeprefix(f"{variant}_")


def _environment(dump: str) -> dict[str, str]:
    env = dict(
        os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", LIBTPU_INIT_ARGS=f"--xla_jf_dump_to={dump} {DUMP_FILTER}"
    )
    env.pop("JAX_PLATFORMS", None)  # the topology's devices are TPU devices
    return env


def compile_one(request: Request, keep: str | None = None, timeout: float = 900.0) -> Result:
    """Compiles ``request`` in a child process; its schedules go to ``keep`` (or a temporary folder
    the caller removes with ``discard``)."""
    dump = keep or tempfile.mkdtemp(prefix="codegen-tpu-")
    os.makedirs(dump, exist_ok=True)
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "codegen.tpu_compile", json.dumps(dataclasses.asdict(request))],
            env=_environment(dump),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return Result(
            request, False, f"compile did not finish in {timeout:.0f} s", time.monotonic() - started, dump
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = " ".join(proc.stderr.split())[-600:]
        return Result(request, False, f"the compiler process died: {tail}", time.monotonic() - started, dump)
    out = json.loads(lines[-1])
    return Result(request, out["ok"], out["error"], time.monotonic() - started, dump)


def compile_many(requests: list[Request], jobs: int | None = None, keep: str | None = None):
    """Compiles every request, ``jobs`` at a time (default: one per core): yields the results in request
    order, each as soon as it and those before it are done."""
    jobs = jobs or os.cpu_count() or 1

    def one(n_request):
        n, request = n_request
        return compile_one(
            request, keep=keep and os.path.join(keep, f"{n:03d}-{request.variant}-{request.program}")
        )

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        yield from pool.map(one, enumerate(requests))


def discard(result: Result) -> None:
    subprocess.run(["rm", "-rf", result.dump], check=False)


# The child process.


def _variant_program(request: Request):
    """(function, argument shapes) of a variant's program."""
    import importlib

    import jax
    import jax.numpy as jnp

    if request.path:
        sys.path.insert(0, request.path)
    module = importlib.import_module(request.family).VARIANTS[request.variant]
    v = module.VARIANT
    B, H, S, D, W = request.shape
    q_shape = (B, H, S, D) if v["q_layout"] == "head_major" else (B, S, H, D)
    args = [
        jax.ShapeDtypeStruct(q_shape, jnp.dtype(v["q_dtype"])),
        jax.ShapeDtypeStruct((B, W, D), jnp.dtype(v["k_dtype"])),
        jax.ShapeDtypeStruct((B, S, H), jnp.dtype(v["weights_dtype"])),
    ]
    sparse = request.program in SPARSE_PROGRAMS or request.program in ROUTE_PROGRAMS  # indices, no bounds
    extra = {}
    if sparse:
        extra["indices"] = jax.ShapeDtypeStruct((B, S, request.top_k), jnp.int32)
    elif request.causal:  # score's and score_topk's visibility bounds
        extra["kv_start"] = extra["kv_end"] = jax.ShapeDtypeStruct((B, S), jnp.int32)
    if v.get("k_scale"):
        extra["k_scale"] = jax.ShapeDtypeStruct((B, W), jnp.float32)
    names = list(extra)

    def call(q, k, w, *rest):
        kw = dict(zip(names, rest))
        if request.program == "topk":
            return module.score_topk(q, k, w, request.top_k, **kw)
        if sparse:
            route = "dense" if request.program in ROUTE_PROGRAMS else "sparse"
            return module.sparse_score(q, k, w, kw.pop("indices"), route=route, **kw)
        return module.score(q, k, w, **kw)

    def loss(q, k, w, *rest):
        x = call(q, k, w, *rest).astype(jnp.float32)
        return jnp.sum(jnp.where(jnp.isfinite(x), x, 0.0))

    gradient = request.program in ("grad", "sparse_grad", "route_grad")
    fn = (lambda *a: jax.grad(loss, argnums=(0, 1, 2))(*a)) if gradient else call
    return fn, args + list(extra.values())


def _calibration_program(request: Request):
    """A plain Pallas matmul [M, D] x [D, N] in ``block_m x block_n`` output tiles: nothing but the
    contraction, one output tile per grid step, no branch."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    head_dim, operand, precision, out_dtype, bm, bn = request.calibration
    precision = {"highest": jax.lax.Precision.HIGHEST, "default": jax.lax.Precision.DEFAULT}[precision]

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(
            a_ref[...], b_ref[...], precision=precision, preferred_element_type=jnp.float32
        ).astype(o_ref.dtype)

    steps_m, steps_n = 4, 2

    def fn(a, b):
        return pl.pallas_call(
            kernel,
            grid=(steps_m, steps_n),
            in_specs=[
                pl.BlockSpec((bm, head_dim), lambda i, j: (i, 0)),
                pl.BlockSpec((head_dim, bn), lambda i, j: (0, j)),
            ],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
            out_shape=jax.ShapeDtypeStruct((steps_m * bm, steps_n * bn), jnp.dtype(out_dtype)),
            name=CALIBRATION,
        )(a, b)

    args = [
        jax.ShapeDtypeStruct((steps_m * bm, head_dim), jnp.dtype(operand)),
        jax.ShapeDtypeStruct((head_dim, steps_n * bn), jnp.dtype(operand)),
    ]
    return fn, args


def _child(request: Request) -> dict:
    import numpy as np

    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    try:
        topology = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[request.chip])
        mesh = jax.sharding.Mesh(np.array(topology.devices)[:1], ("x",))
        fn, args = (
            _calibration_program(request) if request.program == CALIBRATION else _variant_program(request)
        )
        # SparseCore kernels and code that reads pltpu.get_tpu_info() need the mesh set.
        with jax.set_mesh(mesh):
            jax.jit(fn, in_shardings=NamedSharding(mesh, PartitionSpec())).lower(*args).compile()
        return {"ok": True, "error": ""}
    except Exception as err:  # what the compiler says is the result
        return {"ok": False, "error": mosaic_message(f"{type(err).__name__}: {err}")}


if __name__ == "__main__":
    fields = json.loads(sys.argv[1])
    fields["shape"] = tuple(fields["shape"])
    fields["calibration"] = tuple(fields["calibration"])
    print(json.dumps(_child(Request(**fields))), flush=True)
