"""Render the performance CSVs of docs/perf/ as markdown tables (standard library only).

    python docs/perf/make_tables.py               # refill every table block of README.md and docs/*.md
    python docs/perf/make_tables.py --check       # exit 1 where a block differs from its CSV
    python docs/perf/make_tables.py NAME.csv      # print one table
    python docs/perf/make_tables.py --plot        # redraw reference_h200.svg from reference_h200.csv

A CSV starts with its stamp, one ``# key: value`` line per key of STAMP_KEYS in that order
(the GPU, its driver, the jax version, the commit of the code measured, the date and the
command that made the numbers), then a header row and the data rows.

A markdown page embeds a table as a block ``<!-- table: NAME.csv -->`` ... ``<!-- end -->``;
``<!-- table: NAME.csv COLUMN=VALUE -->`` keeps the rows whose COLUMN is VALUE and leaves
that column out.  The block holds the table and, under it, the stamp.
"""

from __future__ import annotations

import csv
import html
import io
import math
import os
import pathlib
import re
import sys

PERF = pathlib.Path(__file__).resolve().parent
ROOT = PERF.parent.parent
STAMP_KEYS = ("gpu", "driver", "jax", "commit", "date", "command")
BLOCK = re.compile(r"<!-- table: ([\w.-]+\.csv)((?: [^=\s]+=\S+)*) -->\n.*?<!-- end -->", re.DOTALL)


def read_csv(path) -> tuple[dict, list[str], list[list[str]]]:
    """(stamp, header, rows) of a stamped CSV."""
    stamp, body = {}, []
    for line in pathlib.Path(path).read_text(encoding="utf-8").splitlines():
        if not body and line.startswith("#"):
            key, _, value = line[1:].partition(":")
            stamp[key.strip()] = value.strip()
        elif line.strip():
            body.append(line)
    rows = list(csv.reader(io.StringIO("\n".join(body))))
    return stamp, rows[0], rows[1:]


def render(name: str, filters: dict | None = None, page_dir: pathlib.Path | None = None) -> str:
    """The markdown table of docs/perf/NAME, then its stamp line (its link to the CSV relative
    to ``page_dir``, docs/ by default)."""
    stamp, header, rows = read_csv(PERF / name)
    filters = filters or {}
    for col in filters:
        if col not in header:
            raise ValueError(f"{name}: no column {col!r} (columns: {header})")
    keep = [i for i, h in enumerate(header) if h not in filters]
    rows = [r for r in rows if all(r[header.index(c)] == v for c, v in filters.items())]
    if not rows:
        raise ValueError(f"{name}: no row with {filters}")
    link = os.path.relpath(PERF / name, page_dir or ROOT / "docs").replace(os.sep, "/")
    lines = ["| " + " | ".join(header[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(r[i] for i in keep) + " |" for r in rows]
    lines += ["", f"<sub>{stamp['gpu']}, driver {stamp['driver']}, jax {stamp['jax']}, commit "
                  f"{stamp['commit']}, {stamp['date']}: `{stamp['command']}` ([{name}]({link}))</sub>"]
    return "\n".join(lines)


def _filters(spec: str) -> dict:
    return dict(kv.split("=", 1) for kv in spec.split())


def fill(text: str, page_dir: pathlib.Path | None = None) -> str:
    """``text`` with every table block rendered from its CSV, for a page in ``page_dir``."""
    def one(m):
        body = render(m.group(1), _filters(m.group(2)), page_dir)
        return f"<!-- table: {m.group(1)}{m.group(2)} -->\n{body}\n<!-- end -->"
    return BLOCK.sub(one, text)


def pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def plot(out=PERF / "reference_h200.svg", name="reference_h200.csv") -> str:
    """A grouped bar chart (log scale) of reference_h200.csv: the producer and the merge
    against torch.topk and jax.lax.top_k of the same rows, at L = 32K."""
    stamp, header, rows = read_csv(PERF / name)
    col = {h: i for i, h in enumerate(header)}
    rows = [r for r in rows if r[col["L"]] == "32K"]
    series = [("select+push (µs)", "#1f6feb", "producer: select + push"),
              ("torch.topk [R, L], k = N (µs)", "#d29922", "torch.topk of its rows, k = N"),
              ("lax.top_k [R, L], k = N (µs)", "#cf222e", "jax.lax.top_k of its rows, k = N"),
              ("merge (µs)", "#2da44e", "merge"),
              ("torch.topk int64 [R, W·N], k = K (µs)", "#bf8700", "torch.topk of the W·N keys, k = K"),
              ("lax.top_k int64 [R, W·N], k = K (µs)", "#a40e26", "jax.lax.top_k of the W·N keys, k = K")]
    w, h, left, top, bottom = 760, 360, 60, 40, 300
    lo, hi = 1.0, 10 ** math.ceil(math.log10(max(float(r[col[s]]) for r in rows for s, _, _ in series)))
    y = lambda v: bottom - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * (bottom - top)
    group = (w - left - 200) / len(rows)
    bar = group / (len(series) + 1)
    out_svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
               f'font-size="11"><rect width="{w}" height="{h}" fill="white"/>',
               f'<text x="{left}" y="20" font-size="13">W = 8, K = 2048, N = 512, L = 32K per rank: '
               f'µs per call (CUDA events, median), log scale</text>']
    for e in range(0, int(math.log10(hi)) + 1):
        v = 10 ** e
        out_svg.append(f'<line x1="{left}" x2="{w - 200}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
                       f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
    for g, r in enumerate(rows):
        x0 = left + g * group + bar / 2
        for k, (s, color, _) in enumerate(series):
            v = float(r[col[s]])
            out_svg.append(f'<rect x="{x0 + k * bar:.1f}" y="{y(v):.1f}" width="{bar * 0.9:.1f}" '
                           f'height="{bottom - y(v):.1f}" fill="{color}"><title>{html.escape(s)}: {v:g}'
                           f'</title></rect>')
        out_svg.append(f'<text x="{x0 + len(series) * bar / 2:.1f}" y="{bottom + 16}" '
                       f'text-anchor="middle">R = {r[col["R"]]}</text>')
    for k, (_, color, label) in enumerate(series):
        yy = top + 10 + k * 18
        out_svg.append(f'<rect x="{w - 190}" y="{yy - 9}" width="10" height="10" fill="{color}"/>'
                       f'<text x="{w - 175}" y="{yy}">{html.escape(label)}</text>')
    out_svg.append(f'<text x="{left}" y="{h - 12}" fill="#555">{html.escape(stamp["gpu"])}, driver '
                   f'{html.escape(stamp["driver"])}, jax {html.escape(stamp["jax"])}, commit '
                   f'{html.escape(stamp["commit"])}, {html.escape(stamp["date"])}</text></svg>')
    text = "\n".join(out_svg) + "\n"
    pathlib.Path(out).write_text(text, encoding="utf-8")
    return text


def main(argv: list[str]) -> int:
    if argv and argv[0].endswith(".csv"):
        print(render(argv[0], _filters(" ".join(argv[1:]))))
        return 0
    if argv == ["--plot"]:
        plot()
        return 0
    check = argv == ["--check"]
    if argv and not check:
        print(__doc__)
        return 2
    stale = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new = fill(text, page.parent)
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not check:
                page.write_text(new, encoding="utf-8")
    if stale:
        print(("stale: " if check else "rewrote: ") + ", ".join(stale))
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
