"""The ``codegen`` command: render, check, list, diff, explain, compile and bench the kernels a spec describes.

Exit codes: 0 done (or up to date, or no difference), 1 out of date / differences found,
2 a bad spec, a bad argument or a variant that does not exist.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import pathlib
import sys

# The generator computes on the host; the TPU compiler, where used, runs in processes of its own.
# `codegen bench` alone runs on the accelerator: JAX then picks its platform as it would for a user.
if sys.argv[1:2] != ["bench"]:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from codegen import (
    chips,
    compiled,
    explain,
    output,
    pipeline,
    plan,
    render,
    tpu_compile,
    tuning,
)  # noqa: E402
from codegen.errors import SpecError

EXIT_OK, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2


class UsageError(Exception):
    """A command-line mistake the user can fix; printed without a traceback."""


def default_out(spec_path: str) -> pathlib.Path:
    """``generated/`` beside the spec's folder: ``specs/x.yaml`` renders into ``generated/``."""
    return pathlib.Path(spec_path).resolve().parent.parent / "generated"


def load_family(spec_path: str, out_root: pathlib.Path) -> pipeline.Family:
    """The spec's family, its warnings printed once."""
    family = pipeline.load_family(spec_path, out_root)
    for warning in family.warnings:
        print(f"warning: {spec_path}: {warning}", file=sys.stderr)
    return family


def _render(args: argparse.Namespace) -> int:
    out_root = pathlib.Path(args.out) if args.out else default_out(args.spec)
    family = load_family(args.spec, out_root)
    files = render.render_family(family)
    plan = output.plan(out_root, family.spec.family, files)
    if args.check:
        if plan.clean:
            print(f"{out_root}/{family.spec.family}: up to date ({len(family.variants)} variants)")
            return EXIT_OK
        sys.stdout.write(plan.diff())
        print(
            f"{out_root}/{family.spec.family} is out of date ({len(plan.changed)} to write, {len(plan.stale)} stale); "
            f"fix with: codegen render {args.spec}" + (f" --out {args.out}" if args.out else ""),
            file=sys.stderr,
        )
        return EXIT_DIFFERENT
    output.apply(plan)
    print(
        f"{out_root}/{family.spec.family}: {len(family.variants)} variants, "
        f"{len(plan.changed)} files written, {len(plan.stale)} stale removed"
    )
    return EXIT_OK


def _list(args: argparse.Namespace) -> int:
    family = load_family(args.spec, default_out(args.spec))
    columns = (
        "name",
        "backend",
        "q_layout",
        "q_dtype",
        "weights_dtype",
        "out_dtype",
        "block_q",
        "block_w",
        "head_chunk",
        "backward",
    )
    rows = [[str(v.as_dict()[c]) for c in columns] for v in family.variants]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    for row in [list(columns), ["-" * w for w in widths], *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return EXIT_OK


def _find(family: pipeline.Family, name: str) -> plan.VariantPlan:
    by_name = {p.name: p for p in family.plans}
    if name not in by_name:
        close = difflib.get_close_matches(name, by_name, n=3)
        hint = (
            f"; did you mean {', '.join(close)}?" if close else f"; `codegen list` shows all {len(by_name)}"
        )
        raise UsageError(f"no variant named {name!r} in {family.spec.family}{hint}")
    return by_name[name]


def _diff(args: argparse.Namespace) -> int:
    family = load_family(args.spec, default_out(args.spec))
    env = render.environment()
    sources = [render.render_variant(env, family, _find(family, name)) for name in (args.a, args.b)]
    text = "".join(
        difflib.unified_diff(
            sources[0].splitlines(keepends=True),
            sources[1].splitlines(keepends=True),
            f"{args.a}.py",
            f"{args.b}.py",
        )
    )
    sys.stdout.write(text)
    return EXIT_DIFFERENT if text else EXIT_OK


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 5 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected five positive integers B,H,S,D,W, got {text!r}")
    return shape


def _chosen(args: argparse.Namespace, family: pipeline.Family, chip: chips.Chip) -> list[plan.VariantPlan]:
    """The variants named (default: all) of the chip's backend and ``--tiling``, legal at ``--shape``."""
    names = args.variant if isinstance(args.variant, list) else [args.variant] if args.variant else []
    chosen = [_find(family, name) for name in names] if names else list(family.plans)
    chosen = [p for p in chosen if p.variant.backend == chip.backend]
    if args.tiling:
        chosen = [p for p in chosen if p.variant.tiling == args.tiling]
    if not chosen:
        raise UsageError(f"no {chip.backend} variant to explain on {chip.name}")
    for p in chosen:
        if p.head_chunk and args.shape[1] % p.head_chunk:
            raise UsageError(
                f"H = {args.shape[1]} is not a multiple of head_chunk {p.head_chunk} of {p.name}"
            )
    return chosen


def _chip(name: str) -> chips.Chip:
    try:
        return chips.get(name)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _require_compiler() -> None:
    if not tpu_compile.available():
        raise UsageError(f"--compiled and `codegen compile` need {tpu_compile.MISSING}")


def _tpu_chips(text: str) -> list[str]:
    """Comma-separated chips the TPU compiler targets; UsageError naming one it does not."""
    names = text.split(",")
    for name in names:
        if name not in tpu_compile.TOPOLOGIES:
            raise UsageError(f"unknown chip {name!r}: one of {', '.join(tpu_compile.TOPOLOGIES)}")
    return names


def _programs(text: str) -> list[str]:
    """Comma-separated programs to compile; UsageError naming those that are not."""
    programs = text.split(",")
    unknown = sorted(set(programs) - set(tpu_compile.PROGRAMS))
    if unknown:
        raise UsageError(f"unknown programs {unknown}: choose from {', '.join(tpu_compile.PROGRAMS)}")
    return programs


def _family_package(family: pipeline.Family) -> str:
    return f"generated.{family.spec.family}"


def _rank(args: argparse.Namespace, family: pipeline.Family, chip_names: list[str]) -> int:
    if not args.variant:
        raise UsageError("--rank ranks the tilings of one variant: name it (e.g. the production one)")
    mask = "causal" if args.causal else "unmasked"
    ranked, found = tuning.rank(family, args.variant, chip_names, args.shape, mask, jobs=args.jobs)
    if args.json:
        print(json.dumps({"ranked": [dataclasses.asdict(r) for r in ranked],
                          "not_candidates": [dataclasses.asdict(c) for c in found if c.error]}, indent=2))  # fmt: skip
    else:
        print(tuning.table(ranked, found, family, args.variant, args.shape, mask))
    return EXIT_OK


def _masks(args: argparse.Namespace) -> tuple[str, ...]:
    """The masks ``explain --compiled`` costs each call under: ``--masks``, else ``--causal``'s."""
    if not args.masks:
        return ("causal" if args.causal else "unmasked",)
    masks = tuple(args.masks.split(","))
    unknown = sorted(set(masks) - set(compiled.MASKS))
    if unknown:
        raise UsageError(f"--masks: unknown {unknown}; choose from {', '.join(compiled.MASKS)}")
    if not args.compiled:
        raise UsageError("--masks needs --compiled (the model takes --causal)")
    return masks


def _explain(args: argparse.Namespace) -> int:
    family = load_family(args.spec, default_out(args.spec))
    if args.rank and not args.compiled:
        raise UsageError("--rank needs --compiled: the compiler's schedule ranks the tilings")
    chip_names = args.chip.split(",")
    if len(chip_names) > 1 and not args.compiled:
        raise UsageError("the model explains one chip at a time; several need --compiled")
    chip = _chip(chip_names[0])
    chosen = _chosen(args, family, chip)
    rate = family.spec.computation.compress_rate
    if args.compiled:
        _require_compiler()
        chip_names = _tpu_chips(args.chip)
        if args.rank:
            return _rank(args, family, chip_names)
        rows = compiled.explain(
            _family_package(family), chosen, chip_names, args.shape, rate,
            masks=_masks(args), programs=_programs(args.programs), jobs=args.jobs,
            top_k=args.top_k,
        )  # fmt: skip
        if args.json:
            print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
        else:
            print(compiled.table(rows, args.shape))
        return EXIT_OK
    rows = [row for p in chosen for row in explain.explain(p, args.shape, chip, rate, args.causal)]
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    else:
        print(explain.table(rows, chip, args.shape, args.causal, blocks=not args.no_blocks))
    return EXIT_OK


def _compile(args: argparse.Namespace) -> int:
    """The compile gate: every program of every chosen variant through libtpu; exit 1 on any failure."""
    _require_compiler()
    family = load_family(args.spec, default_out(args.spec))
    targets = _tpu_chips(args.chip)
    chosen = _chosen(args, family, _chip(targets[0]))
    programs = _programs(args.programs)
    requests, skipped = [], []
    sparse_kernels = render.sparse_module_names(family)
    sparse_seen, route_seen = set(), set()
    for p in chosen:
        logits = (p.head_chunk or args.shape[1]) * p.block_q * p.block_w  # of one gradient grid step
        v = p.variant.as_dict()
        # sparse_score uses nothing of a variant's tiling or head chunk: its programs are the same for
        # every variant of one sparse kernel module, q layout and weights and output dtype
        sparse_key = (sparse_kernels[p.name], v["q_layout"], v["weights_dtype"], v["out_dtype"])
        for program in programs:
            if program == "grad" and args.max_grad_logits is not None and logits > args.max_grad_logits:
                skipped.append(f"{p.name} grad ({logits:,} logits a step)")
                continue
            if program in tpu_compile.SPARSE_PROGRAMS:
                if (sparse_key, program) in sparse_seen:
                    continue
                sparse_seen.add((sparse_key, program))
            if program in tpu_compile.ROUTE_PROGRAMS:  # its dense kernels are grad's: once per scores' dtype
                if v["out_dtype"] in route_seen:
                    continue
                route_seen.add(v["out_dtype"])
            for chip in targets:
                requests.append(
                    tpu_compile.Request(
                        _family_package(family), p.name, chip, program, args.shape, args.top_k
                    )
                )
    print(f"compiling {len(requests)} programs with libtpu, B,H,S,D,W = {','.join(map(str, args.shape))}, "
          f"causal bounds, sparse top_k {args.top_k}, {args.jobs or os.cpu_count()} at a time", flush=True)  # fmt: skip
    failed = 0
    for res in tpu_compile.compile_many(requests, jobs=args.jobs):
        r = res.request
        where = f"{r.chip:4s} {r.variant} {r.program}"
        if res.ok:
            print(f"ok    {where} ({res.seconds:.0f} s)", flush=True)
        else:
            failed += 1
            print(
                f"FAIL  {where} kernel {tpu_compile.failed_kernel(res, r.variant)}: {res.error}", flush=True
            )
        tpu_compile.discard(res)
    print(f"{len(requests) - failed} compiled, {failed} failed")
    if skipped:
        print(f"not compiled (--max-grad-logits {args.max_grad_logits}): " + "; ".join(skipped))
    return EXIT_DIFFERENT if failed else EXIT_OK


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="codegen", description=__doc__.split("\n\n")[0])
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser(
        "render",
        help="render a spec's kernels into generated/",
        description=(
            "Render every variant of SPEC. Deterministic: the same spec and templates give byte-identical files; "
            "files of the family that are no longer rendered are removed."
        ),
    )
    p.add_argument("spec", metavar="SPEC", help="path to the YAML spec, e.g. specs/csa_v4.yaml")
    p.add_argument("--out", metavar="DIR", help="output root (default: generated/ beside the spec's folder)")
    p.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 with a unified diff if out of date"
    )
    p.set_defaults(run=_render)

    p = commands.add_parser(
        "list",
        help="list a spec's variants and their parameters",
        description=("Print a table of every variant SPEC emits, with its resolved parameters."),
    )
    p.add_argument("spec", metavar="SPEC")
    p.set_defaults(run=_list)

    p = commands.add_parser(
        "diff",
        help="diff two variants' generated code",
        description=(
            "Print a unified diff of the generated modules of variants A and B, for review. Exit 1 if they differ."
        ),
    )
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("a", metavar="A", help="variant name (see `codegen list`)")
    p.add_argument("b", metavar="B", help="variant name")
    p.set_defaults(run=_diff)

    p = commands.add_parser(
        "explain",
        help="per-kernel grid, VMEM, HBM bytes, FLOPs and roofline (our model), or the compiled schedule",
        description=(
            "For each kernel of VARIANT (or of every variant): grid, blocks, VMEM footprint against its limit, HBM "
            "bytes moved (re-fetches counted as the Pallas pipeline does them) against the minimum, FLOPs, "
            "arithmetic intensity and roofline time on CHIP, from our model; with --compiled, what the TPU compiler made of "
            "them: bundles per grid step and path, slot occupancy, spills, loops and cycles per call."
        ),
    )
    p.add_argument("spec", metavar="SPEC")
    p.add_argument(
        "variant", metavar="VARIANT", nargs="?", help="default: every variant for the chip's backend"
    )
    p.add_argument("--shape", type=_shape, required=True, metavar="B,H,S,D,W")
    p.add_argument("--causal", action="store_true", help="discount the tiles causal CSA masking skips")
    p.add_argument(
        "--chip",
        default="v6e",
        help=f"one of {', '.join(chips.CHIPS)} (default v6e); with --compiled, several, comma-separated",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--tiling", metavar="NAME", help="only the variants of this spec tiling (e.g. prod)")
    p.add_argument("--no-blocks", action="store_true", help="leave out the per-kernel block shapes")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="compile with libtpu (the tpu extra) and report the compiled schedule instead of the model",
    )
    p.add_argument(
        "--programs", default="fwd,grad", help="with --compiled: of fwd,grad,sparse_fwd,sparse_grad,topk"
    )
    p.add_argument(
        "--masks",
        help="with --compiled: cost each call under these, of unmasked,causal,masked (every block hidden); "
        "default: --causal's",
    )
    p.add_argument(
        "--rank",
        action="store_true",
        help="with --compiled: rank VARIANT's candidate tilings and head chunks (the spec's tuning section) "
        "per chip by the compiled cycles of forward + gradient at --shape (with --causal: causal bounds)",
    )
    p.add_argument("--jobs", type=int, help="with --compiled: compiles at once (default: one per core)")
    p.add_argument(
        "--top-k", type=int, default=512, help="with --compiled: sparse_score's top_k (default 512)"
    )
    p.set_defaults(run=_explain)

    p = commands.add_parser(
        "compile",
        help="compile every variant's programs with the real TPU compiler (libtpu, no TPU needed)",
        description=(
            "Compile the programs of VARIANT (or of every TPU variant) ahead of time for each chip with libtpu "
            "(the tpu extra): by default the gradients of score (causal bounds) and of sparse_score, each of "
            "which compiles its forward kernel too; sparse_score's programs once per sparse kernel module, q "
            "layout and dtypes (the first such variant; they use nothing of its tiling). Prints one line per "
            "program; exit 1 if any does not compile, naming the variant, program, kernel, chip and Mosaic's "
            "message."
        ),
    )
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("variant", metavar="VARIANT", nargs="*", help="default: every TPU variant")
    p.add_argument(
        "--chip", default="7x", help=f"comma-separated, of {', '.join(tpu_compile.TOPOLOGIES)} (default 7x)"
    )
    p.add_argument("--shape", type=_shape, default=(1, 64, 8192, 128, 2048), metavar="B,H,S,D,W",
                   help="default: DeepSeek-V4 prefill, 1,64,8192,128,2048")  # fmt: skip
    p.add_argument(
        "--programs",
        default=",".join(tpu_compile.GATE_PROGRAMS),
        help=f"of {', '.join(tpu_compile.PROGRAMS)} (default: {','.join(tpu_compile.GATE_PROGRAMS)})",
    )
    p.add_argument(
        "--top-k", type=int, default=512, help="sparse_score's and score_topk's top_k (default 512)"
    )
    p.add_argument(
        "--max-grad-logits",
        type=int,
        metavar="N",
        help="skip the gradient of variants whose grid step computes more than N logits (heads x block_q x "
        "block_w): all 64 heads of a 128 x 1024 tile (8,388,608) take minutes to compile; they are listed",
    )
    p.add_argument("--tiling", metavar="NAME", help="only the variants of this spec tiling (e.g. prod)")
    p.add_argument("--jobs", type=int, help="compiles at once (default: one per core)")
    p.set_defaults(run=_compile)

    p = commands.add_parser(
        "bench",
        help="time the spec's production variants on a TPU beside their peers",
        description=(
            "Time the spec's production variants on this machine's TPU (score forward and forward + gradient on "
            "causal, unmasked and fully masked bounds, score_topk, sparse_score, indexer_loss) beside a stacked-heads "
            "every-block Pallas forward, pure XLA, score + lax.top_k / approx_max_k, an XLA sparse score and a bf16 "
            "matmul, at S 8192 / W 2048 / top_k 512 and S 32768 / W 8192 / top_k 1024 (B 1, H 64, D 128). Prints a "
            "line per case and a markdown table; exit 2 without a TPU."
        ),
    )
    p.add_argument(
        "spec", metavar="SPEC", nargs="?", default="specs/csa_v4.yaml", help="default specs/csa_v4.yaml"
    )
    p.add_argument(
        "--cases",
        help="comma-separated, of " + ", ".join(_bench_cases()) + " (default: all but topk.sharded)",
    )
    p.add_argument(
        "--variants", help="comma-separated variants to time instead of the spec's production ones"
    )
    p.add_argument(
        "--rank",
        metavar="VARIANT",
        help="time VARIANT with each of the spec's tuning.chip tilings (its own head chunk; cases default "
        "score.causal,grad.causal at the first default shape) and rank them by causal forward + gradient",
    )
    p.add_argument("--shape", type=_shape, metavar="B,H,S,D,W", help="one shape instead of the two defaults")
    p.add_argument("--top-k", type=int, default=512, help="with --shape: the selection's top_k (default 512)")
    p.add_argument("--calls", type=int, default=10, help="timed calls per case, after a warm-up (default 10)")
    p.add_argument(
        "--json", metavar="FILE", help="also write the figures, chip, JAX version and date to FILE"
    )
    p.add_argument("--report", metavar="FILE", help="print a saved --json run as markdown (no TPU needed)")
    p.set_defaults(run=_bench)
    return top


def _bench_cases() -> tuple[str, ...]:
    from codegen import bench

    return bench.CASES


def _without_outputs(argv: list[str]) -> list[str]:
    """A bench command line less ``--json FILE``: where the figures went is not what was measured."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--json="):
            skip = False
            continue
        skip = arg == "--json"
        if not skip:
            kept.append(arg)
    return kept


def _bench(args: argparse.Namespace) -> int:
    from codegen import bench

    if args.report:
        try:
            saved = json.loads(pathlib.Path(args.report).read_text())
        except (OSError, ValueError) as err:
            raise UsageError(f"--report {args.report}: {err}") from None
        print(bench.report(saved), end="")
        return EXIT_OK
    family = load_family(args.spec, default_out(args.spec))
    asked = set(args.cases.split(",")) if args.cases else set()
    unknown = sorted(asked - set(bench.CASES))
    if unknown:
        raise UsageError(f"unknown cases {unknown}: choose from {', '.join(bench.CASES)}")
    if args.rank and args.variants:
        raise UsageError("--rank times one variant's tilings; --variants names variants: give one of them")
    emitted = {p.name for p in family.plans}
    if args.rank:
        if args.rank not in emitted:
            raise UsageError(f"--rank {args.rank}: the spec emits no such variant")
        if not (family.spec.tuning and family.spec.tuning.chip):
            raise UsageError(
                f"--rank: {args.spec} names no tilings to time on the chip (its tuning.chip list)"
            )
    names = args.variants.split(",") if args.variants else family.spec.production
    missing = sorted(set(names) - emitted)
    if missing:
        raise UsageError(f"--variants: the spec emits no {missing}")
    if not names and not args.rank:
        raise UsageError(f"{args.spec} names no production variants (its `production` list) to bench")
    backend = bench.backend_quietly()
    if backend != "tpu":
        print(f"codegen bench: no TPU here (JAX's default backend is {backend}); it measures on a TPU only")
        return EXIT_ERROR
    import importlib
    import tempfile

    with tempfile.TemporaryDirectory(prefix="codegen-bench-rank-") as root:
        if args.rank:  # the candidates rendered to a scratch package, as explain --rank renders them
            candidates, found = tuning.candidates(family, args.rank, on_chip=True)
            for c in found:
                if c.error:
                    print(f"not a candidate: {c.tiling} with head_chunk {c.head_chunk}: {c.error}")
            if candidates is None:
                raise UsageError(f"--rank {args.rank}: none of tuning.chip's tilings is legal for it")
            sys.path.insert(0, root)
            package = importlib.import_module(tuning.render_to(candidates, root))
            names = [plan.name for plan in candidates.plans]
            asked = asked or set(bench.RANK_CASES)
        else:
            package = importlib.import_module(_family_package(family))
        production = [(name, package.VARIANTS[name]) for name in names]
        shapes = (
            [(*args.shape, args.top_k)]
            if args.shape
            else list(bench.SHAPES[:1] if args.rank else bench.SHAPES + bench.SPARSE_SHAPES)
        )
        run = bench.Bench(package, production, asked or set(bench.DEFAULT_CASES), args.calls)
        saved = {
            **bench.environment(),
            "command": " ".join(["codegen", "bench", *_without_outputs(args.argv)]),
            "calls": args.calls,
            "results": [],
        }

        def keep(results):  # the file is whole after every case, so a run cut short keeps what it measured
            saved["results"] = [dataclasses.asdict(r) for r in results]
            if args.json:
                pathlib.Path(args.json).write_text(json.dumps(saved, indent=1) + "\n")

        run.on_result = keep
        run.run(shapes)
    print()
    print(bench.report(saved), end="")
    if args.rank:
        tilings = {plan.name: family.spec.tilings[plan.variant.tiling] for plan in candidates.plans}
        print()
        print(bench.ranking(saved, args.rank, {n: t.shape_text() for n, t in tilings.items()}))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[2:] if argv is None else argv[1:])
    try:
        return args.run(args)
    except SpecError as err:
        print(f"error: invalid spec; nothing was written\n{err}", file=sys.stderr)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
