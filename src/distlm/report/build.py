"""Write the report: figure files, table files and the self-contained HTML summary."""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import math
import os
from pathlib import Path

import pandas as pd

from distlm.core.io import atomic_path, write_text
from distlm.core.log import get_logger
from distlm.report.figures import BUILDERS, not_collected
from distlm.report.inputs import Inputs, collect
from distlm.report.items import FIGURES, ITEMS, SECTIONS, SUMMARY, category

log = get_logger(__name__)

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;
  max-width:1200px;padding:1.5rem 2rem;color:#222;line-height:1.45}
h1{margin-bottom:.2rem} h2{border-bottom:2px solid #ddd;padding-bottom:.2rem;margin-top:2.2rem}
h3{margin:1.4rem 0 .4rem;font-size:1.05rem}
.meta{color:#666;font-size:.9rem} nav ol{columns:2;font-size:.95rem}
figure{margin:.6rem 0 1.2rem} figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{color:#555;font-size:.9rem}
table.data{border-collapse:collapse;font-size:.88rem;margin:.4rem 0 1rem}
table.data th,table.data td{border:1px solid #ccc;padding:.25rem .55rem;text-align:right;
  vertical-align:top}
table.data th{background:#f3f3f3}
table.data td:first-child,table.data th:first-child{text-align:left}
table.data td.text{text-align:left;white-space:pre-wrap;max-width:38rem}
table.data caption{caption-side:bottom;text-align:left;color:#666;font-size:.85rem}
.not-collected{background:#fff4f4;border-left:4px solid #c33;padding:.5rem .8rem;margin:.6rem 0;
  color:#822}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:.15rem 1rem;font-size:.92rem}
dl.facts dt{font-weight:600} dl.facts dd{margin:0}
"""


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _save(fig, path: Path, fmt: str, png: bytes | None = None) -> None:
    with atomic_path(path) as tmp:
        if fmt == "png" and png is not None:
            tmp.write_bytes(png)
        else:
            # No timestamp in the metadata: the same inputs give the same bytes.
            fig.savefig(tmp, format=fmt, dpi=100, metadata={"Date": None} if fmt == "svg" else None)


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def table_html(df: pd.DataFrame) -> str:
    """An HTML table; text columns keep their line breaks, numbers are right-aligned."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    text_cols = {c for c in df.columns if not pd.api.types.is_numeric_dtype(df[c])}
    rows = []
    for rec in df.itertuples(index=False):
        cells = []
        for c, v in zip(df.columns, rec):
            cls = ' class="text"' if c in text_cols else ""
            cells.append(
                f"<td{cls}>{html.escape(_fmt(v.item() if hasattr(v, 'item') else v))}</td>"
            )
        rows.append("<tr>" + "".join(cells) + "</tr>")
    caption = df.attrs.get("caption")
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    body = "".join(rows)
    return f'<table class="data">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )


def _note(text: str) -> str:
    return f'<div class="not-collected">{html.escape(text)}</div>'


def _facts(d: dict) -> str:
    if not d:
        return ""
    rows = "".join(
        f"<dt>{html.escape(str(k))}</dt><dd>{html.escape(_fact(v))}</dd>" for k, v in d.items()
    )
    return f'<dl class="facts">{rows}</dl>'


def _fact(v) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}: {x}" for k, x in v.items())
    return _fmt(v)


def _section_facts(inp: Inputs, section: str) -> dict:
    if section == "data":
        return inp.stats or {}
    if section == "broadcast":
        return inp.broadcast or {}
    if section == "inference":
        return inp.timing.facts() if inp.timing is not None else {}
    return {}


def build_report(
    results: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    formats=("png",),
    exclude_rules=("report",),
    layout: dict[str, str] | None = None,
    benchmark_files: list[Path] | None = None,
    title: str = "distlm run report",
    preface: str = "",
) -> list[Path]:
    """Collect every metrics file under `results` and write the report into `out_dir`.

    Returns the paths written: summary.html, figures/<name>.<fmt>, tables/<name>.html.
    `layout`, `benchmark_files`, `title` and `preface` (HTML after the title) make the page of one
    run of a sweep (distlm.report.compare).
    """
    results, out_dir = Path(results), Path(out_dir)
    inp = collect(
        results, exclude_rules=exclude_rules, layout=layout, benchmark_files=benchmark_files
    )
    for key, why in inp.missing.items():
        log.info("%s: %s", key, why)
    written: list[Path] = []
    blocks: dict[str, list[str]] = {s: [] for s in SECTIONS}
    notes: dict[str, dict[str, list[str]]] = {s: {} for s in SECTIONS}
    for item in ITEMS:
        obj = BUILDERS[item.name](inp)
        reasons = [inp.missing[k] for k in item.needs if k in inp.missing]
        for why in reasons:  # also when only part of the item's inputs are absent
            notes[item.section].setdefault(why, []).append(item.title)
        reason = reasons[0] if reasons else f"not collected: no data for {item.title.lower()}"
        if item.kind == "figure":
            fig = obj if obj is not None else not_collected(item.title, reason)
            png = _png(fig)
            for fmt in formats:
                path = out_dir / item.path(fmt)
                _save(fig, path, fmt, png)
                written.append(path)
            if obj is not None:
                b64 = base64.b64encode(png).decode("ascii")
                blocks[item.section].append(
                    f'<figure id="{item.name}"><img alt="{html.escape(item.title)}" '
                    f'src="data:image/png;base64,{b64}"><figcaption>{html.escape(item.title)} '
                    f"({'/'.join(item.path(f) for f in formats)})</figcaption></figure>"
                )
        else:
            if obj is not None and not isinstance(obj, pd.DataFrame):
                raise TypeError(f"table {item.name}: its builder returned a {type(obj).__name__}")
            body = table_html(obj) if obj is not None else _note(reason)
            path = out_dir / item.path()
            write_text(path, _page(item.title, f"<h3>{html.escape(item.title)}</h3>\n{body}"))
            written.append(path)
            if obj is not None:
                blocks[item.section].append(
                    f'<h3 id="{item.name}">{html.escape(item.title)}</h3>\n{body}'
                )

    parts = [
        f"<h1>{html.escape(title)}</h1>",
        preface,
        (
            f'<p class="meta">Results folder: {html.escape(str(results.resolve()))} &middot; '
            f"generated {_dt.datetime.now(_dt.UTC):%Y-%m-%d %H:%M UTC} &middot; "
            f"{len(FIGURES)} figures, {len(ITEMS) - len(FIGURES)} tables</p>"
        ),
        "<nav><ol>"
        + "".join(
            f'<li><a href="#sec-{s}">{html.escape(t)}</a>'
            f"{' (not collected)' if not blocks[s] else ''}</li>"
            for s, t in SECTIONS.items()
        )
        + "</ol></nav>",
    ]
    for s in SECTIONS:
        parts.append(f'<section id="sec-{s}"><h2>{html.escape(category(s))}</h2>')
        parts.append(_facts(_section_facts(inp, s)))
        for reason, titles in notes[s].items():
            parts.append(_note(f"{reason}; affects: {', '.join(titles)}"))
        parts.extend(blocks[s])
        parts.append("</section>")
    summary = out_dir / SUMMARY
    write_text(summary, _page(title, "\n".join(parts)))
    written.insert(0, summary)
    log.info(
        "wrote %s (%d figures, %d tables, %d inputs not collected)",
        summary,
        len(FIGURES),
        len(ITEMS) - len(FIGURES),
        len(inp.missing),
    )
    return written
