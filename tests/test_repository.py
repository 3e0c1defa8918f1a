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


DECISIONS = ROOT / "docs" / "decisions.md"
DECISIONS_LOG = ROOT / "docs" / "history" / "decisions-log.md"  # the run history: nothing points into it
DECISIONS_WORDS = 6000
RECORD_FIELDS = ("Default", "Why", "Measured", "Command", "Date")


def _decision_anchors() -> set[str]:
    return {_slug(line.lstrip("#")) for line in DECISIONS.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")}


def _pointing_files() -> list[Path]:
    """The code and docs that may point into docs/decisions.md (the log and the benchmarks' run records aside)."""
    return [*(ROOT / "mla_convert").rglob("*.py"), *(ROOT / "scripts").glob("*.py"), *(ROOT / "scripts").glob("*.sh"),
            *(ROOT / "tests").rglob("*.py"), *(ROOT / "recipes").glob("*.yaml"), *(ROOT / "docs").glob("*.md"),
            ROOT / "README.md"]


def test_decision_pointers_resolve():
    anchors = _decision_anchors()
    pointers = {}
    for path in [*_pointing_files(), *(ROOT / "benchmarks").rglob("*.md"), *(ROOT / "benchmarks").rglob("*.jsonl")]:
        for anchor in re.findall(r"decisions\.md#([\w-]+)", path.read_text(encoding="utf-8")):
            pointers.setdefault(anchor, str(path.relative_to(ROOT)))
    missing = {a: where for a, where in pointers.items() if a not in anchors}
    assert pointers and not missing, f"pointers into docs/decisions.md without a section: {missing}"


def test_decisions_one_short_record_per_default():
    """docs/decisions.md: under DECISIONS_WORDS words, a contents list that names its `##` records in order, and each
    record in the same five fields (what the default is, why, the measurement, the command, the date)."""
    text = DECISIONS.read_text(encoding="utf-8")
    words = len(text.split())
    assert words < DECISIONS_WORDS, (f"docs/decisions.md has {words} words: one short record per default; the run "
                                     "history belongs in the log beside it")
    assert "\n## Contents\n" in text, "docs/decisions.md has no `## Contents` list"
    records = re.split(r"^## ", text, flags=re.M)[1:]
    titles = [record.split("\n", 1)[0].strip() for record in records if not record.startswith("Contents\n")]
    contents = text.split("\n## Contents\n", 1)[1].split("\n## ", 1)[0]
    entries = re.findall(r"^- \[(.+?)\]\(#([\w-]+)\)$", contents, flags=re.M)
    assert [title for title, _ in entries] == titles, "the contents list does not name the records, in their order"
    assert [anchor for _, anchor in entries] == [_slug(title) for title in titles], "a contents link misses its record"
    for record in records:
        if record.startswith("Contents\n"):
            continue
        missing = [field for field in RECORD_FIELDS if f"\n- **{field}**" not in record]
        assert not missing, f"record {record.splitlines()[0]!r} lacks {missing}"


def test_every_option_default_links_to_its_record():
    """Every default of docs/options.md links to its record: a row whose Default cell names a value (or `see
    description`) has a default; `none` (nothing unless given) and `off` (a flag not given) choose nothing."""
    anchors = _decision_anchors()
    lines = (ROOT / "docs" / "options.md").read_text(encoding="utf-8").splitlines()
    header = next(line for line in lines if line.startswith("| Option |"))
    column = [cell.strip() for cell in header.strip("|").split("|")].index("Default")
    checked, unlinked = 0, []
    for line in lines:
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        default = cells[column]
        if default in ("none", "off"):
            continue
        checked += 1
        link = re.search(r"\(decisions\.md#([\w-]+)\)", default)
        if link is None or link.group(1) not in anchors:
            unlinked.append(cells[0])
    assert checked >= 30 and not unlinked, (f"defaults in docs/options.md without a record in docs/decisions.md "
                                            f"(Option(why=...) in mla_convert/schema.py): {unlinked}")


def test_nothing_points_into_the_decisions_log():
    assert DECISIONS_LOG.is_file(), "the run history moved: keep docs/history/decisions-log.md"
    name = DECISIONS_LOG.name
    this = Path(__file__).resolve()
    found = []
    for path in _pointing_files():
        if path.resolve() == this:
            continue
        text = path.read_text(encoding="utf-8")
        # decisions.md links the log as a whole, once; nothing else names it, and nothing links into it
        if f"{name}#" in text or (name in text and path != DECISIONS):
            found.append(str(path.relative_to(ROOT)))
    assert not found, f"pointers into the decisions log (point to a record in docs/decisions.md instead): {found}"


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
    assert words < 2500, f"README.md has {words} words: move details to docs/ and run history to benchmarks/"
    for command in ("bash scripts/install.sh && bash scripts/main.sh",
                    "bash scripts/install.sh && bash scripts/install-vllm.sh && bash scripts/test.sh"):
        assert f"\n{command}\n" in readme, f"README.md lost its command {command!r} (CI and the main job run it)"


# The house's limits (docs/architecture.md): a module reads in one sitting, a function on one screen.
MODULE_LINES = 700
FUNCTION_LINES = 80
HOUSE_CODE = ("mla_convert", "scripts", "benchmarks", "tests")  # the library, the set-up scripts, the benchmarks' code, the tests


def test_house_limits():
    import ast

    long_modules, long_functions = [], []
    for path in sorted(p for folder in HOUSE_CODE for p in (ROOT / folder).rglob("*.py")):
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


def tool_code_loads(source: str) -> list[str]:
    """What a test file does to run code from scripts/ or benchmarks/ in its own process: an import of either as a
    package, or a call that loads a file or puts a folder on sys.path with either named in its arguments."""
    import ast

    tree, found = ast.parse(source), []
    loaders = {"spec_from_file_location", "SourceFileLoader", "run_path", "run_module", "import_module", "insert",
               "append", "extend", "exec_module"}  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in loaders:
            text = " ".join(ast.get_source_segment(source, a) or "" for a in node.args)
            names = ["scripts" if "scripts" in text else "benchmarks"] if re.search(r"scripts|benchmarks", text) else []
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] in ("scripts", "benchmarks")]
    return found


def test_no_test_imports_benchmark_or_script_code():
    """Tests run a benchmark or a script as its command (a subprocess); what a test needs of their code as a library
    belongs in mla_convert/."""
    planted = ("import sys\nsys.path.insert(0, str(ROOT / 'scripts'))\nfrom benchmarks.common import harness\n"
               "spec = importlib.util.spec_from_file_location('b', ROOT / 'benchmarks' / 'decode' / 'run.py')\n")
    assert len(tool_code_loads(planted)) == 3  # the check sees each way in
    found = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if loads := tool_code_loads(path.read_text(encoding="utf-8")):
            found[str(path.relative_to(ROOT))] = loads
    assert not found, f"tests load code from scripts/ or benchmarks/ (run it as a command instead): {found}"


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
