"""Plain-text tables with aligned columns, as the terminal summaries print them."""

from __future__ import annotations


def aligned(rows: list[tuple[str, ...]]) -> str:
    """`rows` (the header first) as left-aligned columns, two spaces apart, a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
