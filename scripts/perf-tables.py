#!/usr/bin/env python3
"""Renders the measurement tables in README.md and docs/*.md from their data files (docs/perf/*.json).

    scripts/perf-tables.py           # rewrite every table from its data file
    scripts/perf-tables.py --check   # exit 1 (and show the difference) if a table is not what its data says

A table in a page is the region between

    <!-- perf-table: docs/perf/NAME.json -->
    ...
    <!-- /perf-table -->

and is generated; edit the data file (or, better, re-run the bench script that writes it) and run
this script. CI runs `--check` (scripts/test.sh), so a page cannot drift from its numbers.

A data file is what a bench script wrote (scripts/perf-table.py --out, scripts/bench-vs-servicer.sh
with PERF_OUT, ...): JSON

    {"title": ..., "command": how it was produced, "machine": ..., "when": ...,
     "columns": [{"name": header, "format": a Python format string for the cell's values}, ...],
     "rows": [[cell, ...], ...]}

where a cell is a number or a list of numbers (formatted with its column's format: "{:.0f} / {:.0f}"
takes two), a string (written as it is), null (empty), or {"format": ..., "values": [...]} for a
cell that needs a format of its own (a bold figure, other decimals). Only the standard library.
"""
import argparse, difflib, glob, json, os, re, sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MARK = re.compile(r"<!-- perf-table: (?P<path>[^ ]+) -->\n(?P<body>.*?)<!-- /perf-table -->", re.S)


def cell_text(cell, fmt, where):
    if cell is None:
        return ""
    if isinstance(cell, str):
        return cell
    if isinstance(cell, dict):
        fmt, cell = cell["format"], cell["values"]
    values = cell if isinstance(cell, list) else [cell]
    if fmt is None:
        raise SystemExit(f"{where}: a numeric cell in a column without a format")
    try:
        return fmt.format(*values)
    except (IndexError, ValueError) as e:
        raise SystemExit(f"{where}: format {fmt!r} with {values!r}: {e}")


def render(data, path):
    cols = data["columns"]
    out = ["| " + " | ".join(c["name"] for c in cols) + " |", "|" + "---|" * len(cols)]
    for i, row in enumerate(data["rows"]):
        if len(row) != len(cols):
            raise SystemExit(f"{path}: row {i} has {len(row)} cells for {len(cols)} columns")
        cells = [cell_text(c, col.get("format"), f"{path} row {i} column {col['name']!r}")
                 for c, col in zip(row, cols)]
        out.append("| " + " | ".join(cells) + " |")
    src = [f"data: [`{path}`]({os.path.relpath(os.path.join(ROOT, path), start=ROOT)})"]
    for key in ("command", "machine", "when"):
        if data.get(key):
            src.append(f"`{data[key]}`" if key == "command" else data[key])
    return "\n".join(out) + "\n\n<sub>" + " · ".join(src) + "</sub>\n"


def pages():
    yield os.path.join(ROOT, "README.md")
    yield from sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from its data")
    a = ap.parse_args()
    stale, tables = [], 0
    for page in pages():
        text = open(page, encoding="utf-8").read()
        rel_page = os.path.relpath(page, ROOT)

        def fill(m):
            nonlocal tables
            tables += 1
            path = m.group("path")
            try:
                data = json.load(open(os.path.join(ROOT, path), encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise SystemExit(f"{rel_page}: table data {path}: {e}")
            body = render(data, path)
            # Links in the caption are relative to the page.
            body = body.replace(f"]({path})", f"]({os.path.relpath(os.path.join(ROOT, path), os.path.dirname(page))})")
            return f"<!-- perf-table: {path} -->\n{body}<!-- /perf-table -->"

        new = MARK.sub(fill, text)
        if new != text:
            stale.append(rel_page)
            if a.check:
                sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True), rel_page, rel_page + " (generated)"))
            else:
                open(page, "w", encoding="utf-8").write(new)
    if a.check and stale:
        print(f"\n{', '.join(stale)}: tables differ from their data files; run scripts/perf-tables.py", file=sys.stderr)
        return 1
    verb = "checked" if a.check else "rendered"
    print(f"perf-tables: {tables} tables {verb}" + ("" if a.check else f", {len(stale)} pages changed"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
