"""The README's tables are the output of the commands named above them, on this checkout."""

from __future__ import annotations

import subprocess
import sys

from tests.spec_cases import ROOT


def test_readme_tables_are_current():
    result = subprocess.run(
        [sys.executable, "benchmarks/readme_tables.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
