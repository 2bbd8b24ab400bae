"""The shipped spec as data, for tests that corrupt one field at a time."""

from __future__ import annotations

import copy
import functools
import pathlib

import yaml

from codegen import pipeline

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEC_PATH = ROOT / "specs" / "csa_v4.yaml"


def shipped() -> dict:
    return yaml.safe_load(SPEC_PATH.read_text())


def edited(edit) -> str:
    """The shipped spec with ``edit(data)`` applied, as YAML text."""
    data = copy.deepcopy(shipped())
    edit(data)
    return yaml.safe_dump(data, sort_keys=False)


@functools.cache
def family() -> pipeline.Family:
    """The shipped spec through the generator's pipeline: its variants' plans, VMEM limits set."""
    return pipeline.load_family(SPEC_PATH)
