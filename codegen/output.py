"""Brings an output tree in line with rendered files: writes what changed, removes what is stale.

Only files whose content differs are touched (so mtimes and reviews stay quiet), and only the
rendered family's own folder is swept for stale files.
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib


@dataclasses.dataclass(frozen=True)
class Plan:
    root: pathlib.Path
    files: dict[str, str]  # relative path -> wanted content
    changed: tuple[str, ...]  # new or different
    stale: tuple[str, ...]  # present in the family folder, no longer rendered

    @property
    def clean(self) -> bool:
        return not self.changed and not self.stale

    def diff(self) -> str:
        """A unified diff from the tree as it is to the tree as rendered."""
        chunks = []
        for rel in self.changed:
            path = self.root / rel
            old = path.read_text().splitlines(keepends=True) if path.exists() else []
            new = self.files[rel].splitlines(keepends=True)
            chunks += difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}")
        for rel in self.stale:
            old = (self.root / rel).read_text(errors="replace").splitlines(keepends=True)
            chunks += difflib.unified_diff(old, [], f"a/{rel}", "/dev/null")
        return "".join(chunks)


def plan(root: str | pathlib.Path, family: str, files: dict[str, str]) -> Plan:
    root = pathlib.Path(root)
    changed = tuple(
        rel for rel in sorted(files) if not (root / rel).is_file() or (root / rel).read_text() != files[rel]
    )
    family_dir = root / family
    present = (
        sorted(
            p.relative_to(root).as_posix()
            for p in family_dir.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )
        if family_dir.is_dir()
        else []
    )
    stale = tuple(rel for rel in present if rel not in files)
    return Plan(root, files, changed, stale)


def apply(p: Plan) -> None:
    for rel in p.changed:
        path = p.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(p.files[rel])
    for rel in p.stale:
        (p.root / rel).unlink()
