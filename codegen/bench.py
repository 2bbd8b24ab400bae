"""``codegen bench``: the spec's production variants timed on a TPU, beside their peers, in one process.

Every case's program is compiled first, on the host's cores at once; then each case is run once to
warm up and timed in ``calls`` samples of back-to-back calls (``median_ms``); the median is reported in milliseconds, with its ratio to the stacked-heads every-block
forward of the same shape (``codegen.peers``, always timed first) and the TFLOP/s of its nominal
work: 2 * H * D per visible (query, block) pair for a forward, five times that for a forward and
gradient (the forward, the logits again, dq, dk and dweights), per selected block for the sparse
kernels. A case that does not fit in the chip's memory says so and the run goes on. ``--json`` keeps
the figures with the chip, JAX version, date and command; ``--report`` prints a saved run as the
README's markdown table, on any machine.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np

# The default shapes (B, H, S, D, W, top_k): DeepSeek-V4 prefill, and a four times longer context.
SHAPES = ((1, 64, 8192, 128, 2048, 512), (1, 64, 32768, 128, 8192, 1024))
# And for the sparse stage, where top_k is a sixteenth of W, only these cases: the sparse kernels and
# the dense score they would replace, timed side by side.
SPARSE_SHAPES = ((1, 64, 8192, 128, 2048, 128), (1, 64, 16384, 128, 8192, 512))
# A variant's sparse_score cases: the random and the shared selection through the sparse kernels, and
# the random one through the dense route.
SPARSE_CASES = (
    "sparse",
    "sparse.grad",
    "sparse.shared",
    "sparse.shared.grad",
    "sparse.dense",
    "sparse.dense.grad",
)
SPARSE_SHAPE_CASES = frozenset(
    ("stacked", "score.causal", "grad.causal", *SPARSE_CASES, "xla_sparse", "xla_sparse.grad")
)
# A shared selection (``shared_selection``): each query's last top_k - SHARED_OTHERS visible blocks
# and SHARED_OTHERS more drawn from the rest of its visible range, as neighbouring queries' picks
# overlap in a trained indexer.
SHARED_OTHERS = 16
# Per production variant: ``score`` (forward) on three masks and three bands, forward + gradient on two, the selection
# three ways, the sparse score and the indexer loss.
VARIANT_CASES = (
    "score.unmasked", "score.causal", "score.masked", "score.band8", "score.band4", "score.band2",
    "grad.unmasked", "grad.causal",
    "topk", "topk.sharded", "topk.lax", "topk.approx", *SPARSE_CASES, "loss.dense", "loss.sparse",
)  # fmt: skip
# Once per shape (``stacked`` always: the ratios are read against it), and the calibration once a run.
PEER_CASES = ("stacked", "xla", "xla.grad", "xla_sparse", "xla_sparse.grad", "matmul")
CASES = VARIANT_CASES + PEER_CASES
# Only when asked for: on a v5e (JAX 0.10.2), in a run beside every other case, XLA's compile of
# topk.sharded was still running after 80 s at S 8192; in a run of its own it compiled (three programs
# in 47 s) and ran within 0.3% of topk (docs/performance.md).
OPT_IN_CASES = ("topk.sharded",)
DEFAULT_CASES = tuple(c for c in CASES if c not in OPT_IN_CASES)
# ``--rank``: each candidate tiling's causal forward and forward + gradient; ranked by the second.
RANK_CASES = ("stacked", "score.causal", "grad.causal")
RANK_BY = "grad.causal"
MATMUL_N = 8192
BAND_FRACTIONS = (8, 4, 2)  # score.bandF: every row sees 1/F of the blocks (band_bounds)
APPROX_RECALL = 0.95  # lax.approx_max_k's recall target
SAMPLE_SECONDS = 0.02  # the least time one timing sample spans (see median_ms)


@dataclasses.dataclass
class Result:
    shape: tuple[int, ...]  # (B, H, S, D, W, top_k); all zeros for the calibration
    case: str
    subject: str  # the variant, or what the peer is
    ms: float | None = None
    seconds: float = 0.0  # the case's wall time, its compile (where its program is new) included
    tflops: float | None = None
    ratio: float | None = None  # to the stacked-heads forward of the same shape
    note: str = ""  # why there is no time: "does not fit", "failed: ...", "not run: ..."

    def line(self) -> str:
        _, _, seq_len, _, num_blocks, top_k = self.shape
        where = f"S {seq_len} W {num_blocks} top_k {top_k}" if seq_len else f"{MATMUL_N}^3"
        if self.ms is None:
            return f"{where} {self.case} {self.subject}: {self.note}"
        ratio = f", {self.ratio:.2f}x stacked" if self.ratio else ""
        rate = f", {self.tflops:.0f} TF/s" if self.tflops else ""
        return f"{where} {self.case} {self.subject}: {self.ms:.3f} ms{ratio}{rate} ({self.seconds:.0f} s)"


def backend_quietly() -> str:
    """JAX's default backend. Where it is not a TPU, what libtpu printed while looking for one (it is
    installed with the tpu extra, for the compiler) is dropped: "no TPU" is the whole story."""
    import os
    import tempfile

    import jax

    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            backend = jax.default_backend()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if backend == "tpu":
            captured.seek(0)
            sys.stderr.buffer.write(captured.read())
    return backend


def median_ms(fn: Callable, args: tuple, samples: int) -> float:
    """The median over ``samples`` of the time one call of ``fn(*args)`` takes, after a warm-up call.

    Each sample times back-to-back calls, waited for at the end, filling at least ``SAMPLE_SECONDS``: the
    host dispatches the next call while the chip runs this one, as in a training loop, so a sample is
    the chip's time and not the host's latency of one call (which, on the v5e tried, added 0.7 to 1.9
    ms to a 1.3 ms kernel)."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start  # the compile's too: an upper bound on one call
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = min(first, time.perf_counter() - start)
    repeats = max(1, int(SAMPLE_SECONDS / max(once, 1e-6)))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(repeats)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / repeats)
        del outs
    return 1e3 * statistics.median(times)


def does_not_fit(err: Exception) -> bool:
    """Whether a compile or a call failed for want of the chip's memory (HBM or VMEM)."""
    return any(s in str(err) for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "Ran out of"))


# The inputs the peers take: bfloat16, sequence-major (the stacked forward's layout).
PEER_INPUTS = {"q_layout": "seq_major", "q_dtype": "bfloat16", "k_dtype": "bfloat16",
               "weights_dtype": "bfloat16", "out_dtype": "bfloat16", "k_scale": False}  # fmt: skip
INPUT_KEYS = tuple(PEER_INPUTS)


class Problem:
    """One shape's inputs in one q layout and dtype set (``inputs``: a variant's, or ``PEER_INPUTS``),
    made on the chip, and the pair counts of nominal work."""

    def __init__(self, package, shape: tuple[int, ...], inputs: dict):
        import jax
        import jax.numpy as jnp

        batch, heads, seq_len, head_dim, num_blocks, top_k = shape
        self.shape, self.top_k = shape, top_k
        kq, kk, kw, kg, ks = jax.random.split(jax.random.key(0), 5)
        dims = (
            (batch, seq_len, heads, head_dim)
            if inputs["q_layout"] == "seq_major"
            else (batch, heads, seq_len, head_dim)
        )
        self.q = jax.random.normal(kq, dims, jnp.float32).astype(inputs["q_dtype"])
        self.k = jax.random.normal(kk, (batch, num_blocks, head_dim), jnp.float32).astype(inputs["k_dtype"])
        self.weights = jax.random.normal(kw, (batch, seq_len, heads), jnp.float32).astype(
            inputs["weights_dtype"]
        )
        self.k_scale = (
            jax.random.uniform(ks, (batch, num_blocks), jnp.float32, 0.5, 2.0) if inputs["k_scale"] else None
        )
        self.cotangent = jax.random.normal(kg, (batch, seq_len, num_blocks), jnp.float32).astype(
            inputs["out_dtype"]
        )
        start, end = (
            np.broadcast_to(np.asarray(x), (batch, seq_len))
            for x in package.causal_kv_range(np.arange(seq_len))
        )
        nothing = jnp.zeros((batch, seq_len), jnp.int32)
        # Every mask as explicit bounds, so that one compiled program serves the three: what differs
        # between them is the data the kernels skip by, not the program (and one compile, not three).
        self.bounds = {
            "unmasked": (nothing, jnp.full((batch, seq_len), num_blocks, jnp.int32)),
            "causal": (jnp.asarray(start, jnp.int32), jnp.asarray(end, jnp.int32)),
            "masked": (nothing, nothing),
        }
        self.pairs = {
            "unmasked": batch * seq_len * num_blocks,
            "causal": int(np.clip(end - start, 0, num_blocks).sum()),
            "masked": 0,
        }
        for fraction in BAND_FRACTIONS:  # bands: every row sees 1/fraction of the blocks
            lo, hi = band_bounds(seq_len, num_blocks, fraction)
            self.bounds[f"band{fraction}"] = tuple(
                jnp.asarray(np.broadcast_to(x, (batch, seq_len)), jnp.int32) for x in (lo, hi)
            )
            self.pairs[f"band{fraction}"] = batch * int((hi - lo).sum())
        self.selection: Callable | None = None  # makes the causal scores the selection is taken from
        self.selection_shape = (batch, seq_len, top_k)
        self.abstract_indices = jax.ShapeDtypeStruct(self.selection_shape, jnp.int32)
        self._indices = self._shared = None
        self.package = package

    @property
    def indices(self):
        """The causal selection, int32 ``[B, S, top_k]`` (-1: no block), made on first use."""
        import jax

        if self._indices is None:
            self._indices = jax.block_until_ready(self.package.topk_indices(self.selection(), self.top_k))
            self._selected = int((self._indices >= 0).sum())
        return self._indices

    @property
    def shared_indices(self):
        """``shared_selection`` of the causal bounds, in ``lax.top_k`` order of the causal scores: int32
        ``[B, S, top_k]``, made on first use."""
        import jax
        import jax.numpy as jnp

        if self._shared is None:
            chosen = shared_selection(*(np.asarray(b) for b in self.bounds["causal"]), self.top_k)
            scores = jnp.take_along_axis(self.selection(), jnp.maximum(jnp.asarray(chosen), 0), axis=2)
            scores = jnp.where(jnp.asarray(chosen) >= 0, scores.astype(jnp.float32), -jnp.inf)
            order = jax.lax.top_k(scores, self.top_k)[1]
            self._shared = jax.block_until_ready(jnp.take_along_axis(jnp.asarray(chosen), order, axis=2))
            self._shared_selected = int((chosen >= 0).sum())
        return self._shared

    @property
    def shared_selected(self) -> int:
        self.shared_indices  # noqa: B018 - made with its count
        return self._shared_selected

    @property
    def selected(self) -> int:
        """The selection's slots that hold a block (counted once, with the selection)."""
        self.indices  # noqa: B018 - makes the selection, and its count, on first use
        return self._selected

    def flops(self, pairs: int, passes: int = 1) -> float:
        _, heads, _, head_dim, _, _ = self.shape
        return 2.0 * heads * head_dim * pairs * passes


def shared_selection(kv_start, kv_end, top_k: int, seed: int = 0) -> np.ndarray:
    """Each query's last ``top_k - SHARED_OTHERS`` visible blocks and ``SHARED_OTHERS`` others drawn
    uniformly (numpy, ``seed``) from the rest of its visible range [kv_start, kv_end), every visible
    block where there are at most top_k, -1 in the slots left: int32 ``[B, S, top_k]``, unordered."""
    rng = np.random.default_rng(seed)
    start, end = np.asarray(kv_start, np.int64), np.asarray(kv_end, np.int64)
    out = np.full(start.shape + (top_k,), -1, np.int32)
    last = max(top_k - SHARED_OTHERS, 0)
    for row in np.ndindex(*start.shape):
        lo, hi = start[row], end[row]
        if hi - lo <= top_k:
            out[row][: max(hi - lo, 0)] = np.arange(lo, hi)
            continue
        out[row][:last] = np.arange(hi - last, hi)
        out[row][last:] = lo + np.sort(rng.choice(hi - last - lo, top_k - last, replace=False))
    return out


def band_bounds(seq_len: int, num_blocks: int, fraction: int) -> tuple[np.ndarray, np.ndarray]:
    """A band mask: query s sees ``num_blocks // fraction`` blocks from ``s * (W - width) // S``, a window
    sliding from the first blocks to the last down the sequence (int64 ``[S]`` start, end)."""
    width = num_blocks // fraction
    start = np.arange(seq_len) * (num_blocks - width) // seq_len
    return start, start + width


def with_gradient(fn: Callable) -> Callable:
    """``(q, k, w, cotangent, *rest) -> (out, (dq, dk, dw))``: ``fn(q, k, w, *rest)`` and its VJP in one
    program, as a training step runs them."""
    import jax

    def program(q, k, w, cotangent, *rest):
        out, vjp = jax.vjp(lambda q, k, w: fn(q, k, w, *rest), q, k, w)
        return out, vjp(cotangent.astype(out.dtype))

    return program


@dataclasses.dataclass
class Case:
    """One timed case as planned: its program, compiled ahead with the others, and its arguments, which
    a sparse case can only have once the forward has made the selection (hence ``args`` a callable)."""

    shape: tuple[int, ...]
    case: str
    subject: str
    program: Callable  # a jitted function
    abstract: tuple  # what it is compiled for: arrays or ShapeDtypeStructs
    args: Callable[[], tuple]
    flops: Callable[[], float]
    compiled: Callable | None = None
    error: Exception | None = None
    compile_seconds: float = 0.0


class Bench:
    """One run: the calibration, then each shape's peers and production variants. Every program is
    planned first and compiled on the host's cores at once (``workers``); then each case is timed in
    order, a line printed as it ends."""

    def __init__(self, package, production: list, cases: set[str], calls: int, out=sys.stdout,
                 workers: int | None = None):  # fmt: skip
        self.package, self.production = package, production  # the generated package; [(name, module)]
        self.cases, self.calls, self.out = cases, calls, out
        self.workers = workers or min(8, os.cpu_count() or 1)
        self.planned: list[Case | Result] = []  # a Result: a case that is reported without running
        self.results: list[Result] = []
        self.stacked_ms: dict[tuple, float] = {}
        self.on_result: Callable | None = None  # called with the results so far as each case ends

    def record(self, result: Result) -> Result:
        if result.ms and result.shape in self.stacked_ms:
            result.ratio = result.ms / self.stacked_ms[result.shape]
        self.results.append(result)
        print(f"[{len(self.results)}/{len(self.planned)}] {result.line()}", file=self.out, flush=True)
        if self.on_result:
            self.on_result(self.results)
        return result

    def add(self, shape, case: str, subject: str, fn: Callable, args, flops=0.0, abstract=None) -> None:
        """Plans a case: ``args`` a tuple, or a callable giving it at run time (then ``abstract`` says
        what to compile for); ``flops`` a number or a callable."""
        import jax

        program = fn if hasattr(fn, "lower") else jax.jit(fn)
        get_args = args if callable(args) else (lambda: args)
        get_flops = flops if callable(flops) else (lambda: flops)
        self.planned.append(Case(shape, case, subject, program, abstract or args, get_args, get_flops))

    def compile(self) -> None:
        """Compiles every planned program, ``workers`` at a time (XLA compiles outside the GIL)."""
        from concurrent.futures import ThreadPoolExecutor

        def one(case: Case) -> None:
            start = time.perf_counter()
            try:
                case.compiled = case.program.lower(*case.abstract).compile()
            except Exception as err:  # noqa: BLE001 - reported with the case
                case.error = err
            case.compile_seconds = time.perf_counter() - start

        cases = [c for c in self.planned if isinstance(c, Case)]
        print(f"compiling {len(cases)} programs on {self.workers} threads", file=self.out, flush=True)
        start = time.perf_counter()
        with ThreadPoolExecutor(self.workers) as pool:
            list(pool.map(one, cases))
        print(f"compiled {len(cases)} programs in {time.perf_counter() - start:.0f} s on {self.workers} threads",
              file=self.out, flush=True)  # fmt: skip

    def time(self, case: Case) -> Result:
        result = Result(case.shape, case.case, case.subject)
        start = time.perf_counter()
        try:
            if case.error is not None:
                raise case.error
            result.ms = median_ms(case.compiled, case.args(), self.calls)
            flops = case.flops()
            result.tflops = flops / (result.ms * 1e-3) / 1e12 if flops else None
        except Exception as err:  # noqa: BLE001 - a case that fails is reported and the run goes on
            result.note = (
                "does not fit" if does_not_fit(err) else f"failed: {type(err).__name__}: {str(err)[:300]}"
            )
        result.seconds = case.compile_seconds + time.perf_counter() - start
        if case.case == "stacked" and result.ms:
            self.stacked_ms[case.shape] = result.ms
        return self.record(result)

    def run(self, shapes) -> list[Result]:
        if "matmul" in self.cases:
            self.calibrate()
        asked = self.cases
        for shape in shapes:
            self.cases = asked & SPARSE_SHAPE_CASES if shape in SPARSE_SHAPES else asked
            problems: dict[tuple, Problem] = {}

            def problem(inputs: dict) -> Problem:  # one set of inputs per layout and dtypes
                key = tuple(inputs[k] for k in INPUT_KEYS)
                if key not in problems:
                    problems[key] = Problem(self.package, shape, inputs)
                return problems[key]

            peer = problem(PEER_INPUTS)
            self.peers(shape, peer)
            for name, module in self.production:
                self.variant(shape, name, module, problem(module.VARIANT))
            self.sparse_peers(shape, peer)
        self.cases = asked
        self.compile()
        for case in self.planned:
            self.time(case) if isinstance(case, Case) else self.record(case)
        return self.results

    def calibrate(self) -> None:
        import jax
        import jax.numpy as jnp

        from codegen import peers

        a, b = (
            jax.random.normal(key, (MATMUL_N,) * 2, jnp.bfloat16)
            for key in jax.random.split(jax.random.key(1))
        )
        self.add((0,) * 6, "matmul", "bf16 matmul (calibration)", peers.matmul, (a, b), 2.0 * MATMUL_N**3)

    def peers(self, shape, p: Problem) -> None:
        from codegen import peers

        args, every = (p.q, p.k, p.weights), p.pairs["unmasked"]
        self.add(
            shape,
            "stacked",
            "stacked-heads forward, every block",
            peers.stacked_forward,
            args,
            p.flops(every),
        )
        if "xla" in self.cases:
            self.add(shape, "xla", "XLA score (logits in HBM)", peers.xla_score, args, p.flops(every))
        if "xla.grad" in self.cases:
            self.add(shape, "xla.grad", "XLA score, forward + gradient", with_gradient(peers.xla_score),
                     (*args, p.cotangent), p.flops(every, 5))  # fmt: skip

    def sparse_peers(self, shape, p: Problem) -> None:
        from codegen import peers

        if p.selection is None:  # no production variant of this layout made one
            return
        cotangent = np.ones(p.selection_shape, np.float32)
        if "xla_sparse" in self.cases:
            self.add(shape, "xla_sparse", "XLA gather + einsums", peers.xla_sparse_score,
                     lambda: (p.q, p.k, p.weights, p.indices), lambda: p.flops(p.selected),
                     (p.q, p.k, p.weights, p.abstract_indices))  # fmt: skip
        if "xla_sparse.grad" in self.cases:
            self.add(shape, "xla_sparse.grad", "XLA gather + einsums, forward + gradient",
                     with_gradient(peers.xla_sparse_score), lambda: (p.q, p.k, p.weights, cotangent, p.indices),
                     lambda: p.flops(p.selected, 5), (p.q, p.k, p.weights, cotangent, p.abstract_indices))  # fmt: skip

    def variant(self, shape, name: str, module, p: Problem) -> None:
        import jax
        import jax.numpy as jnp

        top_k, cases, args, k_scale = p.top_k, self.cases, (p.q, p.k, p.weights), p.k_scale
        score = lambda q, k, w, s, e: module.score(q, k, w, kv_start=s, kv_end=e, k_scale=k_scale)
        causal = p.bounds["causal"]
        forward, gradient = jax.jit(score), jax.jit(with_gradient(score))  # one program for every mask
        for mask in ("unmasked", "causal", "masked", *(f"band{f}" for f in BAND_FRACTIONS)):
            if f"score.{mask}" in cases:
                self.add(
                    shape, f"score.{mask}", name, forward, (*args, *p.bounds[mask]), p.flops(p.pairs[mask])
                )
        for mask in ("unmasked", "causal"):
            if f"grad.{mask}" in cases:
                self.add(shape, f"grad.{mask}", name, gradient, (*args, p.cotangent, *p.bounds[mask]),
                         p.flops(p.pairs[mask], 5))  # fmt: skip
        selection = p.flops(p.pairs["causal"])
        if "topk" in cases:
            self.add(shape, "topk", f"{name} score_topk",
                     lambda q, k, w, s, e: module.score_topk(q, k, w, top_k, kv_start=s, kv_end=e, k_scale=k_scale),
                     (*args, *causal), selection)  # fmt: skip
        if "topk.sharded" in cases:  # the same on a one-device mesh: what the shard_map around it costs
            mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
            self.add(shape, "topk.sharded", f"{name} sharded_score_topk, one device",
                     lambda q, k, w, s, e: module.sharded_score_topk(
                         q, k, w, top_k, mesh=mesh, kv_start=s, kv_end=e, k_scale=k_scale),
                     (*args, *causal), selection)  # fmt: skip
        if "topk.lax" in cases:
            self.add(shape, "topk.lax", f"{name} score + lax.top_k",
                     lambda *a: jax.lax.top_k(score(*a), top_k), (*args, *causal), selection)  # fmt: skip
        if "topk.approx" in cases:
            approx = lambda *a: jax.lax.approx_max_k(score(*a), top_k, recall_target=APPROX_RECALL)
            self.add(
                shape, "topk.approx", f"{name} score + lax.approx_max_k", approx, (*args, *causal), selection
            )
        if "loss.dense" in cases:
            dense_target = jnp.full(p.cotangent.shape, 1.0 / shape[4], jnp.float32)
            loss = lambda q, k, w, s, e: jax.value_and_grad(
                lambda q, k, w: module.indexer_loss(
                    q, k, w, dense_target, kv_start=s, kv_end=e, k_scale=k_scale
                ),
                argnums=(0, 1, 2),
            )(q, k, w)
            self.add(
                shape,
                "loss.dense",
                f"{name} indexer_loss",
                loss,
                (*args, *causal),
                p.flops(p.pairs["causal"], 5),
            )
        if not {*SPARSE_CASES, "loss.sparse", "xla_sparse", "xla_sparse.grad"} & cases:
            return
        # Each query's top_k of its causal scores, as the indexer selects them: made by this variant's
        # forward when the first sparse case runs (the layouts' scores are the same function).
        p.selection = p.selection or (lambda: forward(*args, *causal))
        routed = lambda route: lambda q, k, w, i: module.sparse_score(
            q, k, w, i, k_scale=k_scale, route=route
        )
        abstract = p.abstract_indices
        cotangent = np.ones(p.selection_shape, np.float32)
        # the random selection (the causal top_k), and one neighbouring queries share (``shared_selection``),
        # through the sparse kernels; and the random one through the dense route (the score, then a take)
        for case, label, indices, selected, sparse in (
            ("sparse", "", lambda: p.indices, lambda: p.selected, routed("sparse")),
            (
                "sparse.shared",
                ", shared selection",
                lambda: p.shared_indices,
                lambda: p.shared_selected,
                routed("sparse"),
            ),
            ("sparse.dense", ", route='dense'", lambda: p.indices, lambda: p.selected, routed("dense")),
        ):
            with_indices = lambda *lead, indices=indices: (lambda: (*lead, indices()))
            if case in cases:
                self.add(shape, case, f"{name} sparse_score{label}", sparse, with_indices(*args),
                         lambda selected=selected: p.flops(selected()), (*args, abstract))  # fmt: skip
            if f"{case}.grad" in cases:
                self.add(shape, f"{case}.grad", f"{name} sparse_score{label}", with_gradient(sparse),
                         with_indices(*args, cotangent), lambda selected=selected: p.flops(selected(), 5),
                         (*args, cotangent, abstract))  # fmt: skip
        if "loss.sparse" in cases:
            sparse_target = jnp.full(p.selection_shape, 1.0 / top_k, jnp.float32)
            loss = lambda q, k, w, i: jax.value_and_grad(
                lambda q, k, w: module.indexer_loss(
                    q, k, w, sparse_target, indices=i, k_scale=k_scale, route="sparse"
                ),
                argnums=(0, 1, 2),
            )(q, k, w)
            self.add(shape, "loss.sparse", f"{name} indexer_loss", loss, lambda: (*args, p.indices),
                     lambda: p.flops(p.selected, 5), (*args, abstract))  # fmt: skip


def ranking(saved: dict, variant: str, tilings: dict[str, str]) -> str:
    """A ``--rank`` run's candidates (``tilings``: name -> its tiling's ``shape_text``), fastest
    ``RANK_BY`` first, as markdown, a column per case the run timed (``--cases`` may add to
    ``RANK_CASES``); a candidate with no time (it failed, or did not fit) last."""
    by = {}
    for r in saved["results"]:
        if r["subject"] in tilings:
            by.setdefault(r["subject"], {})[r["case"]] = r["ms"]
    timed = {c for times in by.values() for c in times}
    columns = [c for c in VARIANT_CASES if c in timed and c != RANK_BY] + [RANK_BY]
    order = sorted(
        tilings, key=lambda n: (by.get(n, {}).get(RANK_BY) is None, by.get(n, {}).get(RANK_BY) or 0)
    )
    best = next((by[n][RANK_BY] for n in order if by.get(n, {}).get(RANK_BY)), None)
    lines = [
        f"{variant}'s tilings ranked on the chip by {RANK_BY} (ms, median; {saved.get('chip', '?')}, "
        f"JAX {saved.get('jax', '?')})",
        "",
        "| rank | variant | block_q x block_w / compute_w | " + " | ".join(columns) + " | x best |",
        "|---|---|---|" + "---:|" * (len(columns) + 1),
    ]
    for n, name in enumerate(order, 1):
        times = by.get(name, {})
        cells = [f"{times[c]:.3f}" if times.get(c) else "-" for c in columns]
        ratio = f"{times[RANK_BY] / best:.2f}" if times.get(RANK_BY) and best else "-"
        lines.append(f"| {n} | {name} | {tilings[name]} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def environment() -> dict:
    """The chip, JAX version and date a run's figures belong to."""
    import jax

    device = jax.devices()[0]
    return {"chip": device.device_kind, "jax": jax.__version__, "date": datetime.date.today().isoformat()}


def report(saved: dict) -> str:
    """A saved run (``--json``) as markdown: one table, a row per case and its subject, the shapes side by
    side (ms, ratio to the stacked-heads forward, TF/s each); the calibration under it."""
    lines = [
        f"Measured on one {saved['chip']}, JAX {saved['jax']}, {saved['date']}: `{saved['command']}` "
        f"(median of {saved['calls']} samples of back-to-back calls after a warm-up; ratio to the stacked-heads every-block forward "
        "of the same shape; TF/s of nominal work).",
        "",
    ]
    if saved.get("note"):
        lines += [saved["note"], ""]
    fields = {f.name for f in dataclasses.fields(Result)}
    rows = [
        Result(**{**{k: v for k, v in r.items() if k in fields}, "shape": tuple(r["shape"])})
        for r in saved["results"]
    ]
    shapes = list(dict.fromkeys(r.shape for r in rows if r.shape[2]))
    if shapes:
        batch, heads, _, head_dim, _, _ = shapes[0]
        named = "; ".join(f"S {s[2]}, W {s[4]}, top_k {s[5]}" for s in shapes)
        lines += [f"B {batch}, H {heads}, D {head_dim}; {named}:", ""]
        head = ["case", "what"]
        for shape in shapes:
            head += [f"ms, S {shape[2]}", "x stacked", "TF/s"]
        lines += ["| " + " | ".join(head) + " |", "|---|---|" + "---:|---:|---:|" * len(shapes)]
        table: dict[tuple[str, str], dict] = {}
        for r in rows:
            if r.shape[2]:
                table.setdefault((r.case, r.subject), {})[r.shape] = r
        for (case, subject), by_shape in table.items():
            cells = [case, subject]
            for shape in shapes:
                r = by_shape.get(shape)
                if r is None:
                    cells += ["", "", ""]
                elif r.ms is None:
                    cells += [r.note, "", ""]
                else:
                    rate = (f"{r.tflops:.0f}" if r.tflops >= 10 else f"{r.tflops:.1f}") if r.tflops else ""
                    cells += [f"{r.ms:.2f}", f"{r.ratio:.2f}" if r.ratio else "", rate]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for r in (r for r in rows if not r.shape[2] and r.ms):
        lines.append(f"Calibration: {r.subject}, {MATMUL_N}^3: {r.ms:.2f} ms, {r.tflops:.0f} TF/s.")
    return "\n".join(lines).rstrip() + "\n"
