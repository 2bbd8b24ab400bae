"""Pydantic models of a kernel family spec: what the YAML may say, and nothing more.

Shape rules that hold for every backend live here (positive sizes, names that resolve); rules that
depend on the backend (block legality) live in ``validate.py``. Unknown keys are errors everywhere.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

Backend = Literal["tpu", "gpu"]
QLayout = Literal["head_major", "seq_major"]
Backward = Literal["fused", "reference"]
Activation = Literal["relu"]
StorageDtype = Literal["float32", "bfloat16"]
QKDtype = Literal["float32", "bfloat16", "float8_e4m3fn"]
AccumDtype = Literal["float32", "bfloat16"]
MatmulPrecision = Literal["default", "highest"]
GradMatmul = Literal["split", "bf16"]
FP8 = "float8_e4m3fn"

_NAME = re.compile(r"^[a-z][a-z0-9]*$")
Name = Annotated[str, Field(pattern=_NAME.pattern)]


class StrictModel(BaseModel):
    """Frozen, and every key not declared is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Computation(StrictModel):
    """The math: ``scale * sum_h weights * activation(q . k)``, masked outside the visible range."""

    activation: Activation = "relu"
    softmax_scale: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="None means head_dim ** -0.5, taken from q at call time."
    )
    compress_rate: Annotated[int, Field(ge=1)] = 4
    masked_value: float = -math.inf

    @field_validator("masked_value")
    @classmethod
    def _not_nan(cls, value: float) -> float:
        if math.isnan(value):
            raise ValueError("must not be NaN: a NaN would poison the top-k selection")
        return value


class Model(StrictModel):
    """The production shape the family is validated and costed for."""

    num_heads: Annotated[int, Field(ge=1)] = 64
    head_dim: Annotated[int, Field(ge=1)] = 128


class Tiling(StrictModel):
    """Rows of queries and compressed blocks per kernel tile (a DMA's worth), and the compute width.

    A DMA brings in a ``block_q x block_w`` tile; the kernels then step through it ``compute_w``
    compressed blocks at a time (as ``flash_attention.py`` separates ``block_k_major`` from
    ``block_k``), and a compute block that no query of the tile may see does no work at all. Big
    transfers, fine-grained skipping. None: one compute block per tile. ``fused_compute_w`` is the
    fused backward kernel's own width (None: ``compute_w``): it holds a head group's logits and dlogits
    for dq and for dk per compute block, where the forward holds one sum, so a width that suits one
    need not suit the other.

    A variant's name shows the tiling as ``q{block_q}_w{block_w}`` followed by each further field that
    declares a ``name_tag``, as tag and value, unless the value is its ``name_omits`` (a value, or the
    name of the field whose value it then equals). Every field reaches the generated
    modules in ``VARIANT`` (``resolved``): a new one is declared here and read where it is used.
    """

    block_q: Annotated[int, Field(ge=1)]
    block_w: Annotated[int, Field(ge=1)]
    # one compute block per tile is what names leave out
    compute_w: Annotated[int, Field(ge=1)] | None = Field(
        default=None, json_schema_extra={"name_tag": "c", "name_omits": "block_w"}
    )

    # the fused backward's (dq_dk's) compute width, where it is not compute_w's
    fused_compute_w: Annotated[int, Field(ge=1)] | None = Field(
        default=None, json_schema_extra={"name_tag": "f", "name_omits": "compute_w"}
    )

    @field_validator("compute_w", "fused_compute_w")
    @classmethod
    def _divides_block_w(cls, value: int | None, info: ValidationInfo) -> int | None:
        block_w = info.data.get("block_w")  # validated first; absent if it was invalid
        if value is not None and block_w is not None and block_w % value:
            raise ValueError(
                f"must divide block_w = {block_w}: the kernels step through a tile in whole compute blocks"
            )
        return value

    @property
    def compute_width(self) -> int:
        return self.compute_w or self.block_w

    @property
    def fused_compute_width(self) -> int:
        return self.fused_compute_w or self.compute_width

    def resolved(self) -> dict:
        """Every field with its default filled in, as ``VARIANT`` holds them."""
        return {
            **self.model_dump(),
            "compute_w": self.compute_width,
            "fused_compute_w": self.fused_compute_width,
        }

    def shape_text(self) -> str:
        """The tiling in rankings: ``block_q x block_w / compute_w``, and the fused backward's width where
        it differs."""
        text = f"{self.block_q} x {self.block_w} / {self.compute_width}"
        return text + (
            f", dq_dk {self.fused_compute_width}" if self.fused_compute_width != self.compute_width else ""
        )

    def name_part(self) -> str:
        """How a variant name shows this tiling (see the class docstring)."""
        resolved = self.resolved()
        part = f"q{self.block_q}_w{self.block_w}"
        for field, info in type(self).model_fields.items():
            extra = info.json_schema_extra or {}
            omits = extra.get("name_omits")
            if "name_tag" in extra and resolved[field] != resolved.get(omits, omits):
                part += f"{extra['name_tag']}{resolved[field]}"
        return part


class DtypePolicy(StrictModel):
    """Storage dtypes of each operand, and how the contraction multiplies and accumulates.

    float8_e4m3fn keys are stored per token with a float32 scale (``k_scale: true``), applied as
    ``relu(q . k) * k_scale[w]`` (exact: the scale is positive); a query scale folds into weights.
    """

    qk: QKDtype
    k_scale: bool = Field(default=False, description="per-token float32 key scale [B, W]; float8 keys only")
    weights: StorageDtype
    accum: AccumDtype = "float32"
    matmul_precision: MatmulPrecision | None = Field(
        default=None, description="None: highest for float32 inputs, default (one MXU pass) otherwise"
    )
    out: StorageDtype
    grad_matmul: GradMatmul = Field(
        default="split",
        description="how bfloat16 and float8 q/k's gradient matmuls take the float32 dlogits: split into a "
        "bfloat16 head and tail (two MXU passes, float32-accurate) or rounded to bfloat16 (one pass)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "DtypePolicy":
        if self.accum != "float32":
            why = "float8_e4m3fn q/k need float32 accumulation" if self.qk == FP8 else "sums over heads and D"
            raise ValueError(
                f"accum = {self.accum!r} is not supported: {why}; the MXU accumulates in float32 (accum: float32)"
            )
        if self.qk == FP8 and not self.k_scale:
            raise ValueError("qk float8_e4m3fn needs a per-token key scale: set k_scale: true")
        if self.k_scale and self.qk != FP8:
            raise ValueError(f"k_scale applies to float8_e4m3fn keys only, not qk {self.qk!r}")
        if self.grad_matmul != "split" and self.qk == "float32":
            raise ValueError(
                f"grad_matmul = {self.grad_matmul!r} applies to bfloat16 and float8_e4m3fn q/k only: float32 q/k "
                "multiply the float32 dlogits as they are, at matmul_precision"
            )
        return self

    @property
    def precision(self) -> str:
        """The MXU precision the kernels ask for."""
        if self.matmul_precision is not None:
            return self.matmul_precision
        return "highest" if self.qk == "float32" else "default"

    @property
    def mxu_dtype(self) -> str:
        """The type q and k meet the MXU in: float8 is upcast to bfloat16 in VMEM (exactly), the others
        go as they are. Every kernel-shape decision that depends on q and k's dtype reads this."""
        return "bfloat16" if self.qk == FP8 else self.qk

    @property
    def qk_grad_dtype(self) -> str:
        """dtype of dq and dk: float8 gradients would be meaningless, so they come back as bfloat16."""
        return self.mxu_dtype


class VariantMatrix(StrictModel):
    """Every combination of these values is a variant (before ``exclude``)."""

    backend: list[Backend] = Field(min_length=1)
    q_layout: list[QLayout] = Field(min_length=1)
    dtype: list[Name] = Field(min_length=1)
    tiling: list[Name] = Field(min_length=1)
    head_chunk: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    backward: list[Backward] = Field(min_length=1)


class VariantChoice(StrictModel):
    """One concrete point of the matrix axes; used by ``include``."""

    backend: Backend
    q_layout: QLayout
    dtype: Name
    tiling: Name
    head_chunk: Annotated[int, Field(ge=0)]
    backward: Backward


class VariantSelector(StrictModel):
    """A partial point: matches every variant that agrees on the fields given; used by ``exclude``."""

    backend: Backend | None = None
    q_layout: QLayout | None = None
    dtype: Name | None = None
    tiling: Name | None = None
    head_chunk: Annotated[int, Field(ge=0)] | None = None
    backward: Backward | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> "VariantSelector":
        if not self.model_dump(exclude_none=True):
            raise ValueError("an exclude entry must name at least one field, or it excludes everything")
        return self


class Variants(StrictModel):
    matrix: VariantMatrix
    include: list[VariantChoice] = Field(default_factory=list)
    exclude: list[VariantSelector] = Field(default_factory=list)


class Tuning(StrictModel):
    """What ``codegen explain SPEC VARIANT --compiled --rank`` compiles and ranks: VARIANT (its layout,
    dtypes and backward) with each of these tilings and each of these head chunks, by the compiled
    cycles of a forward and gradient call per chip. Candidates are rendered to a scratch package,
    never into ``generated/``."""

    tilings: list[Name] = Field(min_length=1)
    head_chunk: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    chip: list[Name] = Field(
        default_factory=list,
        max_length=8,
        description="the tilings `codegen bench --rank VARIANT` times on a TPU, each with VARIANT's own head "
        "chunk: at most 8, so that a ranking on the chip takes minutes",
    )


Target = Literal["v5e", "v5p", "v6e", "7x", "h100", "h200"]


class FamilySpec(StrictModel):
    """A kernel family: one computation, rendered in every variant the matrix asks for."""

    family: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")]
    description: str = ""
    targets: list[Target] = Field(
        default_factory=lambda: ["v5e", "v5p", "v6e", "7x"],
        min_length=1,
        description="chips every variant must fit (VMEM) and is costed for; a backend checks its own kind",
    )
    computation: Computation = Field(default_factory=Computation)
    model: Model = Field(default_factory=Model)
    tilings: dict[Name, Tiling] = Field(min_length=1)
    dtype_policies: dict[Name, DtypePolicy] = Field(min_length=1)
    variants: Variants
    tuning: Tuning | None = None
    production: list[str] = Field(
        default_factory=list,
        description="the variants users should run, one per q layout at most: `codegen bench` times these "
        "and the generated package lists them as PRODUCTION",
    )
