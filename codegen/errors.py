"""Errors a user can act on: each names the spec field, the value it holds and the rule it breaks."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Problem:
    """One broken rule: ``path`` is the dotted location in the spec (``tilings.prod.block_w``)."""

    path: str
    value: object
    rule: str

    def __str__(self) -> str:
        return f"{self.path} = {self.value!r}: {self.rule}"


class SpecError(Exception):
    """A spec that cannot be rendered. Carries every problem found, in spec order, once each."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = list({str(p): p for p in problems}.values())
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(f"{self.source}: {problem}" for problem in self.problems)
