"""The README and the pages under docs/ as a newcomer reads them: their tables are the output of the
commands named above them, every ```python block runs as written, on its own (a block whose first
line is ``# continued`` runs after the block before it in the same file), and every link between
them leads to a file and heading that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.spec_cases import ROOT

_PYTHON = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _documents() -> list:
    """The files readers are sent to, as benchmarks/readme_tables.py keeps their tables."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.version_free
def test_readme_tables_are_current():
    result = subprocess.run(
        [sys.executable, "benchmarks/readme_tables.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def _programs() -> list[tuple[str, str]]:
    """(id, program) of each block as it runs: a ``# continued`` one after the program of the block
    before it in its file; the id names the file and the block's number there."""
    programs: list[tuple[str, str]] = []
    for path in _documents():
        name = str(path.relative_to(ROOT))
        previous = None
        for n, block in enumerate(_PYTHON.findall(path.read_text())):
            if block.startswith("# continued"):
                assert previous is not None, f"{name}: block {n} continues no block"
                block = previous + "\n" + block
            programs.append((f"{name}-{n}", block))
            previous = block
    return programs


def test_the_readme_has_python_blocks():
    """The README's own examples (quick start, masks, mesh, load balance, sparse selection) are there."""
    assert sum(name.startswith("README.md-") for name, _ in _programs()) >= 5


@pytest.mark.parametrize("program", [p for _, p in _programs()], ids=[n for n, _ in _programs()])
def test_readme_python_block_runs_as_written(program):
    """In a fresh interpreter from the repository root, with the environment a newcomer has (none of
    the suite's settings), as ``python -c``."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but hyphens dropped, spaces to
    hyphens (code fences hold no headings)."""
    headings = re.findall(r"^#+ (.+)$", _FENCE.sub("", text), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_between_the_pages_lead_somewhere():
    """A section moved between the README and docs/ leaves no link to where it was."""
    broken = []
    for path in _documents():
        for target in _LINK.findall(_FENCE.sub("", path.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # another site
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.name}: {target} (no file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
                broken.append(f"{path.name}: {target} (no heading)")
    assert not broken, broken
