"""The README as a newcomer reads it: its tables are the output of the commands named above them, and
every ```python block runs as written, on its own (a block whose first line is ``# continued`` runs
after the block before it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.spec_cases import ROOT

_PYTHON = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


@pytest.mark.version_free
def test_readme_tables_are_current():
    result = subprocess.run(
        [sys.executable, "benchmarks/readme_tables.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def _programs() -> list[str]:
    """Each block as it runs: a ``# continued`` one after the program of the block before it."""
    programs: list[str] = []
    for block in _PYTHON.findall((ROOT / "README.md").read_text()):
        programs.append(programs[-1] + "\n" + block if block.startswith("# continued") else block)
    return programs


def test_the_readme_has_python_blocks():
    assert len(_programs()) >= 5


@pytest.mark.parametrize("n", range(len(_programs())))
def test_readme_python_block_runs_as_written(n):
    """In a fresh interpreter from the repository root, with the environment a newcomer has (none of
    the suite's settings), as ``python -c``."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run(
        [sys.executable, "-c", _programs()[n]], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
