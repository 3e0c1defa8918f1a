"""The repository itself: no machine paths in what it ships (code, docs, recipes, benchmark records), no experiment
history in library code, benchmarks grouped one folder each, a README a newcomer can read."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".py", ".md", ".json", ".jsonl", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg"}
# Absolute paths of one machine: a home or work folder, the temporary folder. Built from parts so that this file does
# not match itself.
MACHINE_PATH = re.compile("|".join(re.escape(p) for p in ("/" + "work/", "/" + "tmp/", "/" + "root/", "/" + "home/")))
ALLOWED = {"tests/test_hub.py": 1}  # a made-up Hub cache path under a home folder, the input of a test


def shipped_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot list the shipped files")
    return [name for name in out.splitlines() if Path(name).suffix in TEXT_SUFFIXES and (ROOT / name).is_file()]


def test_no_machine_paths():
    found = {}
    for name in shipped_files():
        hits = MACHINE_PATH.findall((ROOT / name).read_text(encoding="utf-8", errors="replace"))
        if len(hits) > ALLOWED.get(name, 0):
            found[name] = len(hits)
    assert not found, f"machine paths in {found}: use paths relative to the repository or the data folder"


# The lab notebook stays out of the library: probe names, the machines runs were timed on and dated runs live in
# docs/decisions.md and the benchmark folders; library code (comments, docstrings, CLI help) points there.
HISTORY = {
    "a probe name": re.compile(r"\b(?:[A-D]|FT)_[a-z][a-z0-9]+(?:_[a-z0-9]+)*\b"),
    "the word probe": re.compile(r"\bprobes?\b", re.IGNORECASE),
    "a machine": re.compile(r"\b(?:EPYC|Xeon|H100|H200|A100)\b"),
    "a probe series": re.compile(r"\bseries [A-D]\b"),
    "a dated run": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
}


def test_no_experiment_history_in_library_code():
    found = []
    for path in sorted((ROOT / "mla_convert").rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{number}: {what}" for what, pattern in HISTORY.items()
                      if pattern.search(line)]
    assert not found, "experiment history in library code (move it to docs/decisions.md): " + "; ".join(found)


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_decision_pointers_resolve():
    decisions = (ROOT / "docs" / "decisions.md").read_text(encoding="utf-8")
    anchors = {_slug(line.lstrip("#")) for line in decisions.splitlines() if line.startswith("#")}
    pointers = {}
    for path in [*(ROOT / "mla_convert").rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]:
        for anchor in re.findall(r"decisions\.md#([\w-]+)", path.read_text(encoding="utf-8")):
            pointers.setdefault(anchor, str(path.relative_to(ROOT)))
    missing = {a: where for a, where in pointers.items() if a not in anchors}
    assert pointers and not missing, f"pointers into docs/decisions.md without a section: {missing}"


def test_benchmarks_one_folder_each():
    entries = sorted(p.name for p in (ROOT / "benchmarks").iterdir())
    assert len(entries) <= 15, f"benchmarks/ has {len(entries)} entries at its top: group them, one folder each"
    loose = [name for name in entries if (ROOT / "benchmarks" / name).is_file() and name != "README.md"]
    assert not loose, f"files at the top of benchmarks/ (put each in its benchmark's folder): {loose}"
    bare = [name for name in entries if (ROOT / "benchmarks" / name).is_dir()
            and not (ROOT / "benchmarks" / name / "README.md").is_file()]
    assert not bare, f"benchmark folders without a README.md (command, data, machine): {bare}"


def test_readme_for_a_newcomer():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    words = len(readme.split())
    assert words < 2500, f"README.md has {words} words: move details to docs/ and history to docs/decisions.md"
    for command in ("bash scripts/install.sh && bash scripts/main.sh",
                    "bash scripts/install.sh && bash scripts/install-vllm.sh && bash scripts/test.sh"):
        assert f"\n{command}\n" in readme, f"README.md lost its command {command!r} (CI and the main job run it)"


# The house's limits (docs/architecture.md): a module reads in one sitting, a function on one screen.
MODULE_LINES = 700
FUNCTION_LINES = 80


def test_house_limits():
    import ast

    long_modules, long_functions = [], []
    for path in sorted((ROOT / "mla_convert").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(ROOT))
        if len(text.splitlines()) > MODULE_LINES:
            long_modules.append(f"{name} ({len(text.splitlines())})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name} ({lines})")
    assert not long_modules, f"modules over {MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {FUNCTION_LINES} lines: {long_functions}"


def rooms() -> dict[str, set[str]]:
    """{room: the rooms it imports}: a room is a top-level module (`name.py`) or subpackage (`name/`) of mla_convert."""
    import ast

    package = ROOT / "mla_convert"

    def room(module: str) -> str | None:
        parts = module.split(".")
        if parts[0] != "mla_convert" or len(parts) < 2:
            return None
        if (package / parts[1]).is_dir():
            return parts[1] + "/"
        return parts[1] + ".py" if (package / (parts[1] + ".py")).is_file() else None

    out = {}
    for path in sorted(package.iterdir()):
        if path.name.startswith("_") or not (path.is_dir() or path.suffix == ".py"):
            continue
        name = path.name + ("/" if path.is_dir() else "")
        imports = set()
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                elif isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                else:
                    continue
                imports |= {r for r in map(room, modules) if r and r != name}
        out[name] = imports
    return out


def test_architecture_rooms_are_current():
    """docs/architecture.md's table of rooms lists every room with the rooms it imports, as the code has them, and
    the rooms import one another without a cycle."""
    table = {}
    for line in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3:
            imports = cells[-1]
            table[cells[0].strip("`")] = set() if imports == "-" else {i.strip().strip("`") for i in imports.split(",")}
    actual = rooms()
    assert table == actual, "docs/architecture.md's rooms differ from the code: " + "; ".join(
        f"{r}: table {sorted(table.get(r, []))}, code {sorted(actual.get(r, []))}"
        for r in sorted(set(table) | set(actual)) if table.get(r) != actual.get(r))
    done, visiting = set(), []

    def visit(r: str) -> None:
        assert r not in visiting, f"import cycle: {' -> '.join(visiting[visiting.index(r):] + [r])}"
        if r in done:
            return
        visiting.append(r)
        for other in sorted(actual[r]):
            visit(other)
        visiting.pop()
        done.add(r)

    for r in sorted(actual):
        visit(r)
