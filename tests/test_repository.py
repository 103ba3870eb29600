"""The repository speaks of itself: checks over the tracked files (CI, no GPU).

* No text refers to work periods, tracker numbers or the machines the project was developed
  on ("the ninth session", "sessions 1-30", "issue #13", "the device machine"), and no file
  name carries "session".
* Nothing but Python ships in the package: no ``*.md`` inside ``jax_dsa_exchange/``.
* Every relative link of README.md and docs/*.md points at a file of the repository.
* docs/perf/ holds stamped CSVs only (and their plots and generator), and the tables that
  docs/performance.md and README.md embed are the ones ``docs/perf/make_tables.py`` renders.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Paths exempt from the text checks, each with the reason.
ALLOWED = {
    "tests/test_repository.py": "spells out the patterns it forbids",
}

_ORDINAL = (r"(?:(?:twenty|thirty|forty)[\s-])?(?:first|second|third|fourth|fifth|sixth|seventh|eighth|"
            r"ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|"
            r"eighteenth|nineteenth|twentieth|thirtieth|fortieth|\d+(?:st|nd|rd|th))")
FORBIDDEN = {
    "a numbered work period": re.compile(
        rf"\b{_ORDINAL}(?:[\s-]|\#|//|\*)+(?:work[\s-]+|gpu[\s-]+)?sessions?\b"  # the ninth session, 3rd session
        r"|sessions?[\s_-]*\d"  # session 12, sessions 1-30, _session29
        r"|\b(?:this|next|last|previous|earlier|later|prior)[\s-]+(?:gpu[\s-]+|work[\s-]+)?sessions?\b",
        re.IGNORECASE),
    "a tracker reference": re.compile(
        r"(?:(?<=\s)|(?<=\()|(?<=^))#\d+\b(?<!#\d{6})"  # #12 (not '#include', not a colour)
        r"|\bissues?[\s#]*\d+"  # issue 46, issue #13, issues 11
        r"|\bpull request \d+|\bPR\s*#?\d+",
        re.IGNORECASE | re.MULTILINE),
    "the development machines": re.compile(
        r"\bdevice machine|\bGPU machine (?:was|is) lent|\bno (?:GPU|device)(?: machine)? (?:was )?lent"
        r"|\bMiB carry\b|\bcarry (?:is )?\d+ ?MiB|\bcarry limit\b|\bcarry \.cubins|\bwas lent\b"
        r"|\bthe GPU machine\b",
        re.IGNORECASE),
}
BINARY_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".gz", ".cubin", ".so", ".pdf", ".whl", ".xz"}
SKIP_DIRS = {".git", ".venv", "build", "dist", "_skbuild", ".cubins", "__pycache__", ".pytest_cache",
             ".whl", "bench_out"}


def tracked_files() -> list[str]:
    """The repository's files: ``git ls-files`` in a checkout, else a walk of the tree
    without the build outputs and environments ``.gitignore`` names."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
        if out.returncode == 0:
            return [p for p in out.stdout.decode().split("\0") if p and (ROOT / p).is_file()]
    files = []
    for base, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for n in names:
            if n not in SKIP_DIRS and not n.endswith(".pyc"):
                files.append(os.path.relpath(os.path.join(base, n), ROOT).replace(os.sep, "/"))
    return files


def _text(rel: str) -> str | None:
    if pathlib.PurePosixPath(rel).suffix.lower() in BINARY_SUFFIXES:
        return None
    try:
        return (ROOT / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def violations(files) -> list[str]:
    """'path:line: what: "text"' for every forbidden mention in ``files``."""
    found = []
    for rel in files:
        if "session" in pathlib.PurePosixPath(rel).name.lower():
            found.append(f"{rel}: a file name with 'session'")
        if rel in ALLOWED:
            continue
        text = _text(rel)
        if text is None:
            continue
        for what, pattern in FORBIDDEN.items():
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{rel}:{line}: {what}: {m.group(0)!r}")
    return found


@pytest.mark.parametrize("text", [
    "the twenty-ninth session's rule", "Ninth session", "sessions 1-30", "session 12", "(session29)",
    "kernels_h200_session29.log", "in the next GPU session", "issue #13 check:", "issue 46", "see #12",
    "(#11, #12)", "the device machine", "a 64 MiB carry", "no GPU machine was lent", "PR #5315",
    "(twenty-ninth\n#   session)", "the carry is 64 MiB", "copy it to the GPU machine",
])
def test_the_patterns_catch_what_they_forbid(text):
    assert any(p.search(text) for p in FORBIDDEN.values()), text


@pytest.mark.parametrize("text", [
    "#include <cuda.h>", "#if defined(X)", "color: #000000", "c = '#1f77b4'", "x = a  # 12 bits",
    'scope="session"', "a new random seed per session", "#!/usr/bin/env bash", "# 1. the merge",
    "layer 2", "the first CTA", "issued warps", "carry the token",
])
def test_the_patterns_leave_ordinary_text_alone(text):
    assert not any(p.search(text) for p in FORBIDDEN.values()), text


def test_no_work_periods_trackers_or_machines_in_the_repository():
    """Code, tests, docs and file names speak of the project only (a measured number may
    stay, with its configuration)."""
    found = violations(tracked_files())
    assert not found, f"{len(found)} mention(s):\n" + "\n".join(found[:200])


def test_no_markdown_ships_in_the_package():
    """Documentation lives in docs/, outside the wheel (pyproject: wheel.packages)."""
    inside = [p for p in tracked_files() if p.startswith("jax_dsa_exchange/") and p.lower().endswith(".md")]
    assert not inside, inside
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'wheel\.packages\s*=\s*\["jax_dsa_exchange"\]', pyproject)


_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _doc_pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _anchors(page: pathlib.Path) -> set[str]:
    """The heading anchors GitHub gives a markdown page."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def test_relative_links_of_the_docs_resolve():
    """Every relative link of README.md and docs/ names an existing file, and a heading of it
    where the link has an anchor."""
    broken = []
    for page in _doc_pages():
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
        for m in _LINK.finditer(text):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # an URL
            path, _, anchor = target.partition("#")
            dest = page.parent / path if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def _make_tables():
    spec = importlib.util.spec_from_file_location("make_tables", ROOT / "docs" / "perf" / "make_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_perf_data_is_stamped_csv():
    """docs/perf/ keeps one stamped CSV per table (plus plots and the generator), no raw logs."""
    mt = _make_tables()
    files = [ROOT / p for p in tracked_files() if p.startswith("docs/perf/")]
    assert files
    for f in sorted(files):
        assert f.suffix in {".csv", ".png", ".svg", ".py"}, f"not current data: {f.name}"
        if f.suffix == ".csv":
            stamp, header, rows = mt.read_csv(f)
            assert list(stamp) == list(mt.STAMP_KEYS), (f.name, list(stamp))
            assert re.fullmatch(r"[0-9a-f]{7,40}", stamp["commit"]), (f.name, stamp["commit"])
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", stamp["date"]), (f.name, stamp["date"])
            assert header and rows and all(len(r) == len(header) for r in rows), f.name


def test_embedded_tables_match_their_csv():
    """Every ``<!-- table: NAME.csv -->`` block of the docs is make_tables.py's rendering of
    the CSV (regenerate: ``python docs/perf/make_tables.py``)."""
    mt = _make_tables()
    blocks = 0
    for page in _doc_pages():
        text = page.read_text(encoding="utf-8")
        blocks += len(mt.BLOCK.findall(text))
        assert mt.fill(text, page.parent) == text, f"{page.relative_to(ROOT)}: run python docs/perf/make_tables.py"
    assert blocks > 0
