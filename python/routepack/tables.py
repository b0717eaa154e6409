"""Text the command line prints and the results pages hold: fixed-width tables that fit
`WIDTH` columns (wrapped into several tables, the label columns repeated, where one would
not), Markdown tables, and paragraphs filled to `WIDTH`."""

from __future__ import annotations

import textwrap
from typing import Any, List, Sequence, Tuple

#: The widest line `routepack` prints on stdout (a terminal's and a log viewer's width).
WIDTH = 100

#: A column: its title, its cells (already formatted), and its group; a table never mixes groups.
Column = Tuple[str, Sequence[str], int]
#: A label column: its title and its cells, left-aligned and repeated in every table.
Label = Tuple[str, Sequence[str]]


def fill(text: str, width: int = WIDTH, indent: str = "") -> str:
    """``text`` as lines of at most ``width`` characters, continuation lines indented by ``indent``."""
    return textwrap.fill(text, width, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)


def _width(title: str, cells: Sequence[str]) -> int:
    return max([len(title)] + [len(c) for c in cells])


def text_tables(labels: Sequence[Label], columns: Sequence[Column], width: int = WIDTH) -> str:
    """Fixed-width tables of ``labels`` (left-aligned) and ``columns`` (right-aligned): the
    columns of one group go into one table while it fits ``width``, then into the next; every
    table repeats the labels. Tables are separated by an empty line."""
    label_w = [_width(t, c) for t, c in labels]
    rows = len(labels[0][1]) if labels else len(columns[0][1])
    base = sum(label_w) + max(len(label_w) - 1, 0)
    tables: List[List[Any]] = []  # [group, column indices, width so far]
    for i, (title, cells, group) in enumerate(columns):
        w = _width(title, cells) + 1
        if tables and tables[-1][0] == group and tables[-1][2] + w <= width:
            tables[-1][1].append(i)
            tables[-1][2] += w
        else:
            tables.append([group, [i], base + w])
    out: List[str] = []
    for k, (_, table, _) in enumerate(tables):
        widths = [_width(columns[j][0], columns[j][1]) for j in table]

        def line(texts: Sequence[str], cells: Sequence[str]) -> str:
            left = " ".join(f"{t:<{w}}" for t, w in zip(texts, label_w))
            right = " ".join(f"{c:>{w}}" for c, w in zip(cells, widths))
            return (left + " " + right if left else right).rstrip()

        head = line([t for t, _ in labels], [columns[j][0] for j in table])
        if k:
            out.append("")
        out += [head, "-" * len(head)]
        for r in range(rows):
            out.append(line([c[r] for _, c in labels], [columns[j][1][r] for j in table]))
    return "\n".join(out)


def markdown_table(titles: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A Markdown table; ``align`` holds ``l`` or ``r`` per column (default: the first left,
    the rest right)."""
    align = align or "l" + "r" * (len(titles) - 1)
    rule = ["---" if a == "l" else "--:" for a in align]
    lines = ["| " + " | ".join(titles) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


__all__ = ["WIDTH", "fill", "markdown_table", "text_tables"]
