"""Product code (ferry/, services/, shared/, kernels/, plan/) states its rules and, in a line, why: it cites no lab
notebook (bench/NOTES.md), no card a figure was measured on (H100, H200), no issue number, and no bench script
that is not in the tree. A measurement that justifies a default is stated as the rule's reason ("a 2k prompt's step
is 150 ms"); where and when it was measured is history, which git and bench/CURRENT.md keep."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("ferry", "services", "shared", "kernels", "plan")
SOURCES = ("*.py", "*.c", "*.h")

# NOTES as the notebook's name (upper case, or notes.md in any case): the English word "notes" stays free
CITATIONS = {
    "the lab notebook": re.compile(r"\bNOTES\b"),
    "the notebook by file name": re.compile(r"notes\.md", re.I),
    "a card": re.compile(r"\bh[12]00\b", re.I),
    "an issue number": re.compile(r"\bissues?[ -]?#?\d+", re.I),
}
BENCH_PATH = re.compile(r"\bbench/[\w./-]+\.(?:py|sh|c|json|md)")


def product_files() -> list[Path]:
    return sorted(p for top in PRODUCT for pattern in SOURCES for p in (REPO / top).rglob(pattern))


def citations(path: Path) -> list[str]:
    """`path:line: what it cites` for each citation of the notebook, a card or an issue, and each bench path that
    names no file of the tree."""
    found = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{n}"
        found += [f"{where}: {what}: {m.group(0)!r}" for what, rx in CITATIONS.items() for m in rx.finditer(line)]
        for m in BENCH_PATH.finditer(line):
            if not (REPO / m.group(0).rstrip(".")).exists():
                found.append(f"{where}: a bench file not in the tree: {m.group(0)!r}")
    return found


def test_the_scan_sees_the_product_code():
    names = {str(p.relative_to(REPO)) for p in product_files()}
    assert {
        "services/cli.py",
        "shared/wire.py",
        "kernels/dense_gemv.py",
        "plan/planner.py",
        "ferry/__init__.py",
    } <= names
    assert any(n.startswith("kernels/host_experts_c/") and n.endswith(".c") for n in names)


def test_the_scan_catches_each_kind_of_citation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""Measured on the H200 (see NOTES.md).\n'
        "# the h100's figure, issue 25 and Issue-26, issues 23\n"
        "x = 1  # bench/no_such_probe.py times it; bench/decode_suite.py exists\n"
        '"""It notes the rule; ISSUES stay words."""\n'
    )
    found = citations(bad)
    assert [f.split(": ", 1)[1] for f in found] == [
        "the lab notebook: 'NOTES'",
        "the notebook by file name: 'NOTES.md'",
        "a card: 'H200'",
        "a card: 'h100'",
        "an issue number: 'issue 25'",
        "an issue number: 'Issue-26'",
        "an issue number: 'issues 23'",
        "a bench file not in the tree: 'bench/no_such_probe.py'",
    ]


def test_product_code_cites_no_notebook_card_issue_or_missing_bench_file():
    found = [hit for path in product_files() for hit in citations(path)]
    assert not found, "state the rule and its reason instead:\n" + "\n".join(found)


def test_the_docs_name_only_files_of_the_tree():
    """README and docs point readers at bench/ and tools/ files: each one named must exist (a retired probe or the
    retired notebook is history, not a reference)."""
    paths = re.compile(r"\b(?:bench|tools)/[\w./-]+\.(?:py|sh|c|json|md)")
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("*/README.md"))]
    missing = [
        f"{doc.relative_to(REPO)}: {m.group(0)}"
        for doc in docs
        for m in paths.finditer(doc.read_text())
        if not (REPO / m.group(0).rstrip(".")).exists()
    ]
    assert not missing, "\n".join(missing)
