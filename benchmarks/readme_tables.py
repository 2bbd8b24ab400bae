"""Keeps the tables of README.md and docs/*.md the output of the commands that make them.

Each table follows a marker line ``<!-- output of: COMMAND -->`` and is the fenced block right after
it (or, after ``<!-- markdown output of: COMMAND -->``, the markdown up to ``<!-- end of output -->``).
``python benchmarks/readme_tables.py`` reruns every COMMAND from the repository root and rewrites its
block; ``--check`` writes nothing and exits 1 with a diff when any block has drifted (the test suite
runs it). Tables marked ``<!-- compiled output of: COMMAND -->`` (or ``<!-- compiled markdown output
of: COMMAND -->``) come from the TPU compiler and take minutes: only ``--compiled`` reruns them (with
``--check``, it checks them too). A ``codegen bench`` table (times measured on a TPU) is left as it is
until its saved results, ``benchmarks/results/v5e.json``, exist.
"""

from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
_TABLE = re.compile(
    r"(<!-- (?P<compiled>compiled )?output of: (?P<command>.+?) -->\n```text\n)(?P<body>.*?)(```)"
    # Markdown output (a table GitHub renders) runs up to an end marker instead of a fence.
    r"|(<!-- (?P<md_compiled>compiled )?markdown output of: (?P<md_command>.+?) -->\n)(?P<md_body>.*?)"
    r"(<!-- end of output -->)",
    re.DOTALL,
)


def documents() -> list[pathlib.Path]:
    """The files whose marked tables are kept: the README and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def run(command: str) -> str:
    """A marker's command, run as a user would (``codegen`` and ``python`` in this interpreter). On the
    CPU unless the caller says otherwise: with libtpu installed, JAX would otherwise probe for a TPU and
    log its failure (the TPU compiler's own child processes choose their platform themselves)."""
    argv = shlex.split(command)
    argv = {"codegen": [sys.executable, "-m", "codegen.cli"], "python": [sys.executable]}.get(
        argv[0], argv[:1]
    ) + argv[1:]
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True, env=env)
    return result.stdout


def rendered(text: str, compiled: bool = False) -> str:
    """``text`` with every marked block replaced by its command's output (the compiled ones only with
    ``compiled``)."""

    def block(m):
        if m.group("command") is not None:
            if m.group("compiled") and not compiled:
                return m.group(0)
            return m.group(1) + run(m.group("command")) + m.group(5)
        if m.group("md_compiled") and not compiled:
            return m.group(0)
        return m.group(6) + run(m.group("md_command")) + m.group(10)

    return _TABLE.sub(block, text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff on drift")
    parser.add_argument("--compiled", action="store_true", help="also the TPU compiler's tables (minutes)")
    args = parser.parse_args(argv)
    drifted = []
    for path in documents():
        name = str(path.relative_to(ROOT))
        text = path.read_text()
        if path.name == "README.md" and not _TABLE.search(text):
            print(f"{name}: no marked tables", file=sys.stderr)
            return 1
        new = rendered(text, args.compiled)
        if args.check:
            diff = "".join(
                difflib.unified_diff(text.splitlines(True), new.splitlines(True), name, "rendered")
            )
            sys.stdout.write(diff)
            if diff:
                drifted.append(name)
        elif new != text:
            path.write_text(new)
    if drifted:
        print(
            f"tables out of date in {', '.join(drifted)}; fix with: python benchmarks/readme_tables.py",
            file=sys.stderr,
        )
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main())
