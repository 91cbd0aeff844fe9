"""Peak dense tensor FLOP/s per GPU model, the denominator of MFU (model FLOPs utilisation).

The figures live in ``data/gpu-peak-flops.csv`` with the vendor document and year each came from
(``data/SOURCES.md`` explains the choices). They are dense (no 2:4 sparsity) FLOP/s: where a datasheet
gave only figures "with sparsity", the table says so (``sparsity_halved``) and holds half of them. An
empty cell means the GPU has no such tensor precision, or no figure we trust; no series is emitted for
it, because a wrong denominator is worse than a missing MFU.

Rows are matched against the product name as NVML reports it (``NVIDIA H100 80GB HBM3``,
``Tesla V100-SXM2-16GB``, ``NVIDIA A100-SXM-80GB``, ``NVIDIA GeForce RTX 4090``): the first row whose
regular expression is found in the name (case-insensitive, white space runs collapsed) wins;
tests/test_gpu_specs.py holds the names each row must and must not match. This module never talks to a GPU.
"""

from __future__ import annotations

import csv
import functools
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gpu_energy_exporter.reference import DATA_DIR

#: Tensor precisions in the table, the values of the ``precision`` label.
PRECISIONS: tuple[str, ...] = ("bf16", "fp16", "fp8", "tf32")

PEAK_FLOPS_FILE = "gpu-peak-flops.csv"


@dataclass(frozen=True)
class PeakFlops:
    """One table row."""

    model: str  # human name of the product
    pattern: re.Pattern[str]  # searched in the NVML product name
    flops: dict[str, float]  # precision -> dense peak FLOP/s; precisions without a figure are absent
    sparsity_halved: bool  # the datasheet gave figures with sparsity; the table holds half of them
    source: str  # the vendor document
    year: str  # year of that document
    note: str = ""


def parse_peak_table(text: str) -> tuple[PeakFlops, ...]:
    """Parse the CSV text of the peak table. Raises ValueError naming the row of any bad cell."""
    rows: list[PeakFlops] = []
    reader = csv.DictReader(io.StringIO(text))
    missing = {"model", "pattern", "sparsity_halved", "source", "year", *PRECISIONS} - set(
        reader.fieldnames or ()
    )
    if missing:
        raise ValueError(f"peak FLOP/s table lacks columns: {', '.join(sorted(missing))}")
    for line, row in enumerate(reader, start=2):
        where = f"{PEAK_FLOPS_FILE} line {line} ({row['model']})"
        try:
            pattern = re.compile(row["pattern"], re.IGNORECASE)
        except re.error as exc:
            raise ValueError(f"{where}: bad pattern: {exc}") from None
        flops: dict[str, float] = {}
        for precision in PRECISIONS:
            cell = (row[precision] or "").strip()
            if not cell:
                continue
            try:
                value = float(cell)
            except ValueError:
                raise ValueError(f"{where}: {precision} {cell!r} is not a number") from None
            # Anything below 1 TFLOP/s is a unit slip (TFLOPS typed instead of FLOP/s).
            if not math.isfinite(value) or value < 1e12:
                raise ValueError(f"{where}: {precision} {cell!r} is not a FLOP/s figure")
            flops[precision] = value
        halved = (row["sparsity_halved"] or "").strip().lower()
        if halved not in ("yes", "no"):
            raise ValueError(f"{where}: sparsity_halved must be yes or no")
        rows.append(
            PeakFlops(
                model=row["model"].strip(),
                pattern=pattern,
                flops=flops,
                sparsity_halved=halved == "yes",
                source=row["source"].strip(),
                year=row["year"].strip(),
                note=(row.get("note") or "").strip(),
            )
        )
    return tuple(rows)


@functools.cache
def peak_table() -> tuple[PeakFlops, ...]:
    """The bundled table, parsed once."""
    text = (DATA_DIR / PEAK_FLOPS_FILE).read_text(encoding="utf-8")
    return parse_peak_table(text)


def lookup_peak_flops(product_name: str, table: Sequence[PeakFlops] | None = None) -> PeakFlops | None:
    """The row for an NVML product name, or None when no row matches. Runs of white space count as one
    space (some boards pad the name)."""
    name = " ".join(product_name.split())
    for row in peak_table() if table is None else table:
        if row.pattern.search(name):
            return row
    return None
