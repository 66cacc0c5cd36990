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


def format_mib(n: float, *, signed: bool = False) -> str:
    """``12.5`` (MiB, no unit: for columns headed "MiB"); ``+1.0`` with ``signed``."""
    return f"{n / (1 << 20):+.1f}" if signed else f"{n / (1 << 20):.1f}"


def format_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right: Container[int] = (),
    indent: str = "",
    rule: bool = True,
    markdown: bool = False,
) -> str:
    """Columns padded to their widest cell; the columns whose index is in ``right`` are
    right-aligned (header cells stay left-aligned in ``markdown``).

    Plain: two spaces between columns, a dashed rule under the header (``rule``), each
    line prefixed by ``indent``. ``markdown``: a ``| a | b |`` table with its ``|---|``
    rule, as the benchmarks print.
    """
    table = [list(header), *map(list, rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]

    def cells(r: list[str], is_header: bool) -> list[str]:
        return [
            c.rjust(w) if i in right and not (markdown and is_header) else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths))
        ]

    if markdown:
        lines = [f"| {' | '.join(cells(r, i == 0))} |" for i, r in enumerate(table)]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
        return "\n".join(lines)
    lines = [indent + "  ".join(cells(r, i == 0)).rstrip() for i, r in enumerate(table)]
    if rule:
        lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)
