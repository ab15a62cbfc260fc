"""LLaMA-Factory's "Hardware Requirement" table for a case: its README's GPU memory per method, bits
and model size, kept here as data and read at the case's parameter count.

The table (README.md of hiyouga/LLaMA-Factory at commit 00409ff, section "Hardware Requirement",
marked "estimated") gives one figure per job on one GPU, in GB, for models of 7, 14, 30 and 70 billion
parameters, and an `xB` column with the rule for a model of x billion. The rule does not reproduce
the cells (full AMP: 18 x 7 = 126 GB against the 7B cell's 120 GB), so at the table's sizes the cell
is the estimate, between two sizes the cells are interpolated linearly, below 7B the estimate goes
linearly to zero at zero parameters, and above 70B the 70B cell grows in proportion to x (the
rule's form). The rule's own figure is kept in the estimate's `basis`.

Rows for a case: full fine-tuning with DeepSpeed (fp32 master weights under bf16/fp16) or in fp32 is
the 32-bit row "Full (`bf16` or `fp16`)"; full fine-tuning without DeepSpeed trains the weights and
AdamW's state in the 16-bit dtype: the "Full (`pure_bf16`)" row. LoRA is the 16-bit
"Freeze/LoRA/..." row; QLoRA the row of its quantization bits. GB is read as 10^9 bytes, as written.
The figure is per job and ignores ZeRO: it is not divided over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from harness.predict.reference.counts import ModelCounts
from harness.predict.reference.estimate import Estimate
from harness.spec.schema import Case, Precision

SOURCE_URL = ("https://github.com/hiyouga/LLaMA-Factory/blob/00409ff28a30f48d13b808029d37861423673a4a/README.md"
              "#hardware-requirement")
READ_ON = "2026-11-26"
GB = 10**9
SIZES_B = (7, 14, 30, 70)  # the table's columns, billions of parameters


@dataclass(frozen=True)
class Row:
    """One row of the table, as the README writes it."""

    method: str
    bits: int
    cells_gb: tuple[int, ...]  # at SIZES_B
    rule_gb_per_b: float  # the `xB` column: GB per billion parameters

    def gb_at(self, billions: float) -> float:
        """The row's figure for a model of `billions` parameters (see the module's docstring)."""
        if billions >= SIZES_B[-1]:
            return self.cells_gb[-1] * billions / SIZES_B[-1]
        points = [(0, 0), *zip(SIZES_B, self.cells_gb, strict=True)]
        (x0, y0), (x1, y1) = next((a, b) for a, b in pairwise(points) if billions <= b[0])
        return y0 + (y1 - y0) * (billions - x0) / (x1 - x0)


TABLE = (
    Row("Full (`bf16` or `fp16`)", 32, (120, 240, 600, 1200), 18),
    Row("Full (`pure_bf16`)", 16, (60, 120, 300, 600), 8),
    Row("Freeze/LoRA/GaLore/APOLLO/BAdam", 16, (16, 32, 64, 160), 2),
    Row("QLoRA", 8, (10, 20, 40, 80), 1),
    Row("QLoRA", 4, (6, 12, 24, 48), 0.5),
    Row("QLoRA", 2, (4, 8, 16, 24), 0.25),
)


def row_for(case: Case) -> Row:
    """The table's row for the case's method and precision."""
    kind = case.method.kind
    if kind == "qlora":
        method, bits = "QLoRA", case.method.quantization.bits
    elif kind == "lora":
        method, bits = "Freeze/LoRA/GaLore/APOLLO/BAdam", 16
    elif case.deepspeed is not None or case.precision == Precision.fp32:
        method, bits = "Full (`bf16` or `fp16`)", 32
    else:
        method, bits = "Full (`pure_bf16`)", 16
    for row in TABLE:
        if row.method == method and row.bits == bits:
            return row
    raise ValueError(f"LLaMA-Factory's table has no row for method {method} at {bits} bits")


def llamafactory_estimate(case: Case, counts: ModelCounts) -> Estimate:
    row = row_for(case)
    x = counts.billions
    gb = row.gb_at(x)
    procs = case.launch.procs_per_card
    jobs = f"; x {procs} jobs per card" if procs > 1 else ""
    return Estimate(
        estimator="llamafactory", per_card=round(gb * GB) * procs,
        counts=f"LLaMA-Factory's table, row {row.method} {row.bits}-bit, at {x:.2f}B parameters: {gb:.1f} GB per "
               f"job on one GPU{jobs}",
        leaves_out="ZeRO partitioning and offload (not divided over ranks), sequence length, batch, checkpointing",
        basis=(f"cells {dict(zip(SIZES_B, row.cells_gb, strict=True))} GB interpolated at {x:.3f}B "
               f"(the xB rule {row.rule_gb_per_b:g}x gives {row.rule_gb_per_b * x:.1f} GB); {SOURCE_URL}, "
               f"read {READ_ON}"))
