"""The templates ship inside the package, so an installed (not editable) codegen renders anywhere."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

from codegen.render import SHIPPED
from tests.spec_cases import ROOT


def test_the_wheel_ships_every_template(tmp_path):
    """Built as ``pip install .`` builds it (in an isolated environment with the build-system's
    setuptools, from the package index, as the install itself is)."""
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = tmp_path.glob("csa_codegen-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    templates = sorted(
        p.relative_to(ROOT / "templates").as_posix() for p in (ROOT / "templates").rglob("*.j2")
    )
    assert len(templates) >= 5
    missing = [t for t in templates if f"codegen/templates/{t}" not in shipped]
    assert not missing, f"templates left out of the wheel: {missing}"
    assert "codegen/templates/__init__.py" in shipped
    # codegen render copies the shipped modules into every family package
    assert {f"codegen/shipped/{module}.py" for module in SHIPPED} <= shipped
    assert {f"generated/csa_v4/{module}.py" for module in SHIPPED} <= shipped


def test_templates_load_from_the_package_not_the_working_directory(tmp_path, monkeypatch):
    from codegen import render

    monkeypatch.chdir(tmp_path)
    env = render.environment()
    assert pathlib.Path(env.get_template("module.py.j2").filename).parent.name == "templates"


# What a reviewer reads: every variant module small, what variants share written once (the shipped
# runtime, geometry and top-k selection, one module per dense and per sparse kernel shape). A kernel
# rendered per variant again would cost ~300 lines a variant and break this. (8360 lines with score_topk;
# 8883 with dq/dweights' last-step finish, whose head accessors each dense module carries; 9359 with k
# in windows past VMEM, each window's spans of slots and several dk accumulators, in each of the four
# sparse modules; 9536 with the shipped runtime split into modules by concern, a header and imports each;
# 9611 with the compute blocks as a loop and reads parked where a q block has no work; 9983 with the
# in-VMEM selection kernel, ``_select``, one shipped module; 10063 with sparse_score's route, a few
# lines a variant; 10122 with score_topk's head-major chunks reading q in place, a scalar-prefetched
# q block offset in the shared runtime and a line a variant; 10211 with the selection kernel writing
# [rows, top_k] itself, in place, and the forward's transposed score for it, in the shared runtime;
# 11016 with the fused backward, dq_dk (each logit computed once for dq and dk where one w tile covers W),
# in each of the six dense modules: its kernel, a third pallas_call, and each backward's finish shared;
# 11022 with the forward's walk of visible pieces, in the shared runtime, and a line a variant saying
# which walk its forward takes; 11081 with the fused backward's own compute width, two lines a variant:
# its VARIANT entry and FUSED_COMPUTE_W; 11246 with the dense route's take and its transpose as
# kernels, ``_take``, one shipped module, and a docstring line a variant on the route "auto" takes; 11306
# with their skipping of the w tiles a row block selects nothing from: the spans, scalar prefetch.)
GENERATED_LINES_CAP = 11306


def test_generated_code_stays_written_once():
    files = sorted((ROOT / "generated").rglob("*.py"))
    lines = {f.relative_to(ROOT).as_posix(): len(f.read_text().splitlines()) for f in files}
    assert sum(lines.values()) <= GENERATED_LINES_CAP, sorted(lines.items(), key=lambda kv: -kv[1])[:8]
    variant_lines = [n for name, n in lines.items() if pathlib.Path(name).name.startswith("tpu_")]
    assert len(variant_lines) >= 20 and max(variant_lines) <= 200, variant_lines
