"""Keeps the README's tables the output of the commands that make them.

Each table in README.md follows a marker line ``<!-- output of: COMMAND -->`` and is the fenced block
right after it (or, after ``<!-- markdown output of: COMMAND -->``, the markdown up to
``<!-- end of output -->``). ``python benchmarks/readme_tables.py`` reruns every COMMAND from the repository root
and rewrites its block; ``--check`` writes nothing and exits 1 with a diff when any block has drifted
(the test suite runs it). Tables marked ``<!-- compiled output of: COMMAND -->`` (or ``<!-- compiled
markdown output of: COMMAND -->``) come from the TPU compiler and take minutes: only ``--compiled``
reruns them (with ``--check``, it checks them too).
"""

from __future__ import annotations

import argparse
import difflib
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_TABLE = re.compile(
    r"(<!-- (?P<compiled>compiled )?output of: (?P<command>.+?) -->\n```text\n)(?P<body>.*?)(```)"
    # Markdown output (a table GitHub renders) runs up to an end marker instead of a fence.
    r"|(<!-- (?P<md_compiled>compiled )?markdown output of: (?P<md_command>.+?) -->\n)(?P<md_body>.*?)"
    r"(<!-- end of output -->)",
    re.DOTALL,
)


def run(command: str) -> str:
    """A marker's command, run as a user would (``codegen`` and ``python`` in this interpreter)."""
    argv = shlex.split(command)
    argv = {"codegen": [sys.executable, "-m", "codegen.cli"], "python": [sys.executable]}.get(
        argv[0], argv[:1]
    ) + argv[1:]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True)
    return result.stdout


def rendered(text: str, compiled: bool = False) -> str:
    """README text with every marked block replaced by its command's output (the compiled ones only
    with ``compiled``)."""

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
    text = README.read_text()
    if not _TABLE.search(text):
        print(f"{README}: no marked tables", file=sys.stderr)
        return 1
    new = rendered(text, args.compiled)
    if args.check:
        diff = "".join(
            difflib.unified_diff(text.splitlines(True), new.splitlines(True), "README.md", "rendered")
        )
        sys.stdout.write(diff)
        if diff:
            print(
                "README tables are out of date; fix with: python benchmarks/readme_tables.py", file=sys.stderr
            )
        return 1 if diff else 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
