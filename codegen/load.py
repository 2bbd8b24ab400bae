"""YAML file -> validated ``FamilySpec``, with pydantic's errors turned into ``Problem``s."""

from __future__ import annotations

import hashlib
import pathlib

import pydantic
import yaml

from codegen.errors import Problem, SpecError
from codegen.spec import FamilySpec

_MISSING = "<missing>"


def _dotted(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "<spec>"


def _rule(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown key (not part of the spec schema)"
    if error["type"] == "missing":
        return "required field is missing"
    return error["msg"].removeprefix("Value error, ")


def parse(text: str, source: str) -> FamilySpec:
    """Parses and validates spec text; ``source`` names it in error messages."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpecError(source, [Problem("<yaml>", None, f"not valid YAML: {err}")]) from None
    if not isinstance(data, dict):
        raise SpecError(source, [Problem("<spec>", data, "must be a mapping of spec fields")])
    try:
        return FamilySpec.model_validate(data)
    except pydantic.ValidationError as err:
        problems = [
            Problem(_dotted(e["loc"]), _MISSING if e["type"] == "missing" else e["input"], _rule(e))
            for e in err.errors()
        ]
        raise SpecError(source, problems) from None


def load(path: str | pathlib.Path) -> tuple[FamilySpec, str]:
    """Returns the spec at ``path`` and the sha256 of its bytes (stamped into generated files)."""
    path = pathlib.Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise SpecError(
            str(path), [Problem("<file>", str(path), f"cannot be read: {err.strerror}")]
        ) from None
    return parse(raw.decode("utf-8"), str(path)), hashlib.sha256(raw).hexdigest()
