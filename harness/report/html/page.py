"""The page itself: sections of figures and tables as one self-contained HTML file, every piece of text
escaped, written whole or not at all into the report's folder."""

from __future__ import annotations

import datetime as dt
import html
from dataclasses import dataclass, field
from pathlib import Path

from harness.report.html.svg import Figure
from harness.spec.files import inside, write_atomic

INDEX = "index.html"


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: list[tuple[str, ...]]
    title: str = ""
    key: str = ""  # the table's id, where it has one
    collapsed: bool = False  # long tables open on a click (<details>: no script)
    classes: list[str] = field(default_factory=list)  # a CSS class for each row (the verdict table's statuses)


@dataclass(frozen=True)
class Fold:
    """Items shown on a click (<details>: no script): figures that differ little from the one above them."""

    title: str
    items: list


@dataclass
class Section:
    key: str  # the anchor
    title: str
    intro: str
    items: list[Figure | Table | Fold] = field(default_factory=list)  # in the order shown
    empty: str = ""  # said where the inputs hold nothing for this section
    lead: bool = False  # drawn first, above the page's sources and contents (the verdict table)


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1200px;padding:1em 2em;
color:#222;line-height:1.4}
p,figcaption,summary{overflow-wrap:anywhere}
h1{font-size:1.6em}h2{margin-top:2em;border-bottom:1px solid #ccc}
figure{margin:1.2em 0;border:1px solid #e4e4e4;padding:.5em;background:#fff}
figcaption{font-size:.85em;color:#444;margin-top:.3em}
svg.plot{width:100%;height:auto;display:block}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f4}nav li{margin:.1em 0}.note{color:#555;font-size:.9em}
nav ol{display:flex;flex-wrap:wrap;gap:.1em 1.4em;margin:.3em 0;padding-left:1.2em}
.scroll{overflow-x:auto;max-width:100%}
tr.fail td{background:#fde2e1}tr.fail td:first-child{color:#a50f15;font-weight:bold}
tr.not-checked td{background:#fff3cd}tr.finding td{background:#eef}
#verdicts table{font-size:.8em}
#verdict-table td:nth-child(1),#verdict-table td:nth-child(n+3):nth-child(-n+6){white-space:nowrap}
#verdict-table td:nth-child(2){min-width:12em}#verdict-table td:nth-child(7){min-width:9em}
#verdict-table td:last-child{min-width:16em}
@media (max-width:700px){body{padding:.5em;font-size:15px}h1{font-size:1.15em;margin:.3em 0}
h2{margin-top:1em}#verdicts>p{font-size:.85em}
.figure-scroll{overflow-x:auto}.figure-scroll svg.plot{min-width:640px}figcaption{font-size:.9em}}
"""


def _table(t: Table) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in t.header)
    classes = t.classes or [""] * len(t.rows)
    body = "\n".join((f'<tr class="{e(c)}">' if c else "<tr>") + "".join(f"<td>{e(str(v))}</td>" for v in row)
                     + "</tr>" for row, c in zip(t.rows, classes, strict=True))
    # a wide table scrolls inside its own box, never the whole page (a phone's 390 px)
    table = f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table></div>'
    if t.key:
        table = table.replace("<table>", f'<table id="{e(t.key)}">', 1)
    if t.collapsed:
        return f"<details><summary>{e(t.title or 'table')} ({len(t.rows)} rows)</summary>{table}</details>"
    return (f"<h3>{e(t.title)}</h3>" if t.title else "") + table


def _figure(f: Figure) -> str:
    # the SVG is matplotlib's own markup, its text escaped by matplotlib; everything else is escaped here
    return (f'<figure id="fig-{html.escape(f.key)}" class="report-figure"><div class="figure-scroll">{f.svg}</div>'
            f"<figcaption>{html.escape(f.caption)}</figcaption></figure>")


def _item(item) -> str:
    if isinstance(item, Fold):
        inner = "\n".join(_item(i) for i in item.items)
        return f'<details class="fold"><summary>{html.escape(item.title)}</summary>\n{inner}\n</details>'
    return _figure(item) if isinstance(item, Figure) else _table(item)


def _section(s: Section) -> list[str]:
    e = html.escape
    parts = [f'<section id="{e(s.key)}"><h2>{e(s.title)}</h2><p>{e(s.intro)}</p>']
    if not s.items:
        parts.append(f'<p class="note">{e(s.empty or "nothing to show")}</p>')
    parts += [_item(i) for i in s.items]
    parts.append("</section>")
    return parts


def render(sections: list[Section], sources: list[str], generated: str | None = None) -> str:
    """The page: a section marked `lead` (the verdict table) first, on the first screen, then what the
    page was built from and the contents, then the other sections."""
    e = html.escape
    generated = generated or dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nav = "".join(f'<li><a href="#{e(s.key)}">{e(s.title)}</a></li>' for s in sections)
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             "<title>oom-harness report</title>", f"<style>{CSS}</style></head><body>",
             "<h1>oom-harness report: memory and speed of the fine-tuning cases</h1>"]
    for s in sections:
        if s.lead:
            parts += _section(s)
    parts += [f'<p class="note">Generated {e(generated)} from: {e("; ".join(sources))}. Sizes in GiB (2<sup>30</sup> '
              "bytes). Every figure says where it was measured; predicted and extrapolated figures are labelled. "
              "A name's suffix is how the case was measured: <code>@2r4L2ga</code> on 2 ranks (<code>r</code>) "
              "with 4 layers (<code>L</code>) and gradient accumulation capped at 2 (<code>ga</code>); "
              "<code>@u</code> on the whole card instead of the emulated one; no suffix: as written.</p>",
              f"<nav><ol>{nav}</ol></nav>"]
    for s in sections:
        if not s.lead:
            parts += _section(s)
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_page(folder: Path, text: str) -> Path:
    """`folder`/index.html, written atomically; nothing else is written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return write_atomic(inside(folder, INDEX), text, root=folder)
