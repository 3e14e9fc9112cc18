"""Nothing outside an expert format's own modules branches on its name: the product code (services,
shared, kernels, plan) asks the format object (plan/expert_formats/registry.py) what it needs, so a
new format is its own modules and a line in the registry, not a hunt for string comparisons.

The source is read with `ast`: every string constant equal to a registered format's name, or to the
word --expert-bank-format gives its banks, must sit in that format's modules (plan/expert_formats/<m>.py,
services/worker/expert_formats/<m>.py) or the registry. A flag's `choices=` / `default=` lists words
the user types, and NOT_FORMATS names the few constants that spell a format's name but mean another
thing."""

from __future__ import annotations

import ast
from pathlib import Path

from ferry.plan import expert_formats as F

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("services", "shared", "kernels", "plan")
REGISTRY = (
    "plan/expert_formats/registry.py",
    "plan/expert_formats/__init__.py",
    "services/worker/expert_formats/__init__.py",
)
FLAG_KEYWORDS = ("choices", "default")
# (file, constant): why that constant is not a format's name
NOT_FORMATS = {
    ("plan/dtypes.py", "bf16"): "--dtype's short spelling of bfloat16 (DTYPE_ALIASES)",
}


def owners() -> dict[str, set[str]]:
    """Each registered word (a format's name, its banks' --expert-bank-format word) -> the files that may spell it."""
    words: dict[str, set[str]] = {}
    for fmt in F.registered():
        stem = fmt.module_stem
        files = {f"plan/expert_formats/{stem}.py", f"services/worker/expert_formats/{stem}.py", *REGISTRY}
        for word in (fmt.name, fmt.bank_word):
            words.setdefault(word, set()).update(files)
    return words


def flag_constants(tree: ast.AST) -> set[int]:
    """ids of the constants inside a call's choices= / default= (a flag's words)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in FLAG_KEYWORDS:
                    inside.update(id(n) for n in ast.walk(kw.value))
    return inside


def stray_names(root: Path = REPO) -> list[str]:
    words = owners()
    found = []
    for folder in PRODUCT:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(), rel)
            flags = flag_constants(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or node.value not in words:
                    continue
                if rel in words[node.value] or id(node) in flags or (rel, node.value) in NOT_FORMATS:
                    continue
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def test_no_format_name_outside_its_modules():
    found = stray_names()
    assert not found, (
        "an expert format's name outside its own modules (ask the format object instead, "
        "plan/expert_formats/registry.py):\n" + "\n".join(found)
    )


def test_the_scan_finds_a_stray_name(tmp_path):
    """The scan is not blind: a comparison with a registered name in a product file is reported."""
    name = F.registered()[-1].name
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "stray.py").write_text(f"def pick(fmt):\n    return fmt == {name!r}\n")
    assert stray_names(tmp_path) == [f"plan/stray.py:2: {name!r}"]


def test_every_format_is_registered_once():
    names = [fmt.name for fmt in F.registered()]
    assert len(names) == len(set(names)) and set(names) == set(F.FORMATS)
