"""Audits a lowered program for HBM work outside its Pallas kernels.

Walks StableHLO (through calls and loops, multiplying by scan trip counts) and reports every
operation outside the Pallas calls whose result has at least ``threshold`` elements, attributed to
the variant's ``score`` (its named scope) or to the caller, and the largest array held outside
the kernels. Used by ``benchmarks/backward_hlo.py`` and the harness's no-[S, W]-outside check.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from jax._src.lib.mlir import ir

_SHAPE_ONLY = {"stablehlo.reshape", "stablehlo.bitcast_convert"}  # no data movement of their own


@dataclasses.dataclass
class Report:
    big_ops: collections.Counter  # (owner, op name, result type) -> executions
    largest: tuple[int, str]  # (bytes, result type)
    loops: list[int]  # trip counts of every loop reached
    pallas_calls: list[str]


def _tensor(value) -> tuple[int, int, str] | None:
    """(elements, bytes, printed type) of a ranked tensor value, else None."""
    try:
        tensor = ir.RankedTensorType(value.type)
    except (ValueError, TypeError):
        return None
    elements = math.prod(tensor.shape)
    bits = int(re.search(r"(\d+)", str(tensor.element_type)).group(1))  # f32, bf16, i32, i1, f8E4M3FN
    return elements, elements * max(bits, 8) // 8, str(tensor)


def _trip_count(while_op) -> int:
    """A scan's while loop compares its counter with a constant in the cond region."""
    constants = []
    for op in while_op.regions[0].blocks[0].operations:
        if op.operation.name == "stablehlo.constant":
            try:
                constants.append(int(ir.DenseIntElementsAttr(op.attributes["value"])[0]))
            except (ValueError, TypeError):
                pass  # a float constant
    if not constants:
        raise ValueError("while loop without a constant bound: not a scan, cannot count its trips")
    return max(constants)


def _owner(op, variant_name: str, enclosing: str) -> str:
    """'score' for an op traced inside the variant's score (its named scope) or inside a loop or
    function called from there; else 'loss'."""
    name_stack = str(op.location).split('"')[1] if '"' in str(op.location) else ""
    return "score" if enclosing == "score" or variant_name in name_stack else "loss"


def analyse(module: ir.Module, threshold: int, variant_name: str) -> Report:
    functions = {}
    for op in module.body.operations:
        if op.operation.name == "func.func":
            functions[ir.StringAttr(op.attributes["sym_name"]).value] = op
    report = Report(collections.Counter(), (0, ""), [], [])

    def visit(block, trips: int, enclosing: str) -> None:
        for op in block.operations:
            name = op.operation.name
            owner = _owner(op, variant_name, enclosing)
            if name == "stablehlo.custom_call" and "tpu_custom_call" in str(
                op.attributes["call_target_name"]
            ):
                report.pallas_calls.append(str(op.attributes["kernel_name"]))
                continue  # inside a kernel: VMEM tiles, not HBM arrays
            if name == "func.call":
                callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
                visit(functions[callee].regions[0].blocks[0], trips, owner)
                continue
            if name == "stablehlo.while":
                count = _trip_count(op)
                report.loops.append(count)
                visit(op.regions[1].blocks[0], trips * count, owner)
                continue
            for result in op.operation.results:
                info = _tensor(result)
                if info is None:
                    continue
                elements, size, printed = info
                if size > report.largest[0]:
                    report.largest = (size, printed)
                if elements >= threshold and name not in _SHAPE_ONLY:
                    report.big_ops[(owner, name, printed)] += trips
            for region in op.operation.regions:
                for inner in region.blocks:
                    visit(inner, trips, owner)

    visit(functions["main"].regions[0].blocks[0], 1, "loss")
    return report
