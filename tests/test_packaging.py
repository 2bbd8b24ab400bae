"""The templates ship inside the package, so an installed (not editable) codegen renders anywhere."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

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
    assert "codegen/templates/__init__.py" in shipped and "generated/csa_v4/_runtime.py" in shipped


def test_templates_load_from_the_package_not_the_working_directory(tmp_path, monkeypatch):
    from codegen import render

    monkeypatch.chdir(tmp_path)
    env = render.environment()
    assert pathlib.Path(env.get_template("module.py.j2").filename).parent.name == "templates"
