"""Plain-text output shared by the reports: byte sizes and aligned tables."""

from __future__ import annotations

from collections.abc import Container, Sequence


def format_bytes(n: float) -> str:
    """``1.5 MiB``, ``512 B``: binary units, one decimal above a KiB."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{n:.0f} B"


def format_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, right: Container[int] = ()
) -> str:
    """Columns padded to their widest cell, a dashed rule under the header; the columns
    whose index is in ``right`` are right-aligned."""
    table = [list(header), *map(list, rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
