"""The house's imports and the main job's data flow: export/ uses nothing of the conversion, no module imports in a
circle (module level or inside functions, rooms and modules within them), and the walk of `--kv-budget` from the CLI
to the written config enters each room once, along the hops docs/architecture.md states."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tiny import tiny_source

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mla_convert"
# export/ reads finished native checkpoints: it may import no part of the conversion, not even the library's
# conversion API (mla_convert.convert re-exports conversion/). What both need lives below both (rope_fit.py, writes.py).
CONVERSION = ("mla_convert.conversion", "mla_convert.convert")


def modules() -> dict[str, Path]:
    """{dotted module name: file} for every module of mla_convert (a package by its __init__.py)."""
    out = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        parts = list(file.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return out


def imported(name: str, file: Path, known: dict[str, Path]) -> set[str]:
    """The mla_convert modules `name` (at `file`) imports, at module level or inside functions: `from a import b`
    names module a.b where b is a module, else a; relative imports resolved."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for target in names:
            while target and target not in known:  # an attribute of a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, file, known) for name, file in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in stack), None)
            if nxt is not None and nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
                continue
            if nxt is not None:
                low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_export_imports_nothing_of_the_conversion():
    graph = import_graph()
    bad = sorted(f"{name} imports {target}" for name, targets in graph.items() if name.startswith("mla_convert.export")
                 for target in targets if target.startswith(CONVERSION))
    assert not bad, f"export/ must not import the conversion (put what both need below both): {bad}"


def test_no_module_imports_in_a_circle():
    found = cycles(import_graph())
    assert not found, f"modules that import one another in a circle: {found}"


def test_the_cycle_check_finds_a_circle_within_a_room():
    """The check itself: the circle export/driver <-> export/gguf this step broke is found, and a longer one."""
    assert cycles({"a.driver": {"a.gguf"}, "a.gguf": {"a.driver"}, "a.plan": set()}) == [["a.driver", "a.gguf"]]
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]
    assert cycles({"x": {"y"}, "y": set()}) == []


# ------------------------------------------------------------------------------------------- the walk of --kv-budget

HOP = re.compile(r"^\d+\. `([^`]+)` -> (.+?):")


def stated_hops() -> list[tuple[str, list[str]]]:
    """docs/architecture.md's hops of the main job's `--kv-budget`: [(room, [its functions, as `module.qualname`
    within a package room, `qualname` within a module room])], from the numbered list under its heading."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("### The walk of `--kv-budget`", 1)[1].split("\n#", 1)[0]
    hops = []
    for line in section.splitlines():
        match = HOP.match(line)
        if match:
            hops.append((match.group(1), re.findall(r"`([^`]+)`", match.group(2))))
    assert hops, "docs/architecture.md states no hops under '### The walk of `--kv-budget`'"
    return hops


ROOMS: dict[str, tuple[str, str] | None] = {}  # code file -> room_of (the profiler asks at every call)


def room_of(filename: str) -> tuple[str, str] | None:
    """(room, the module's name within it) of a code file of mla_convert, else None."""
    if filename not in ROOMS:
        try:
            rel = Path(filename).resolve().relative_to(PACKAGE.resolve())
        except ValueError:
            ROOMS[filename] = None
        else:
            ROOMS[filename] = ((rel.parts[0] + "/", Path(*rel.parts[1:]).with_suffix("").as_posix().replace("/", "."))
                               if len(rel.parts) > 1 else (rel.name, ""))
    return ROOMS[filename]


class Walk:
    """A profiler that follows one float value (the first 0.25 an mla_convert function receives: the parsed
    --kv-budget) by identity: a call carries it when an argument is the value, or a dict, list or object (its
    `kv_budget`, or its `options`' `kv_budget`) holding it. A hop is a call that carries it from one room into another
    and returns something or makes hops itself (the value goes on from there; a check that returns None and calls no
    further room with it only reads it); the walk starts in the room of the first call that carries it, and stops once
    `last` (a `module.qualname`) is entered."""

    def __init__(self, last: str | None):
        self.last, self.value, self.done = last, None, False
        self.hops: list[list] = []  # [room, kept]: kept is False for a check (see above), None until it returns
        self.pending: dict[int, int] = {}  # frame id -> its hop's index, until it returns
        self.called: set[str] = set()  # every mla_convert function entered before the stop, as (room, name)

    def carries(self, x) -> bool:
        v = self.value
        if x is v:
            return True
        if isinstance(x, dict):
            return any(y is v for y in x.values())
        if isinstance(x, (list, tuple)):
            return any(y is v for y in x)
        fields = getattr(x, "__dict__", None)
        if not isinstance(fields, dict):
            return False
        options = getattr(fields.get("options"), "__dict__", None)
        return fields.get("kv_budget") is v or (isinstance(options, dict) and options.get("kv_budget") is v)

    def __call__(self, frame, event, arg) -> None:
        if self.done:
            return
        if event == "return" and id(frame) in self.pending:
            at = self.pending.pop(id(frame))
            passed_on = any(kept is not False for _, kept in self.hops[at + 1 :])  # hops made inside it
            self.hops[at][1] = arg is not None or at == 0 or passed_on
            return
        where = room_of(frame.f_code.co_filename) if event == "call" else None
        if where is None:
            return
        code = frame.f_code
        name = f"{where[1]}.{code.co_qualname}" if where[1] else code.co_qualname
        self.called.add((where[0], name))
        count = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
        args = [frame.f_locals.get(v) for v in code.co_varnames[:count]]
        if self.value is None:
            for a in args:
                for x in a.values() if isinstance(a, dict) else (a,):
                    if type(x) is float and x == 0.25:
                        self.value = x
        caller = room_of(frame.f_back.f_code.co_filename) if frame.f_back is not None else None
        if self.value is not None and (not self.hops or caller is None or caller[0] != where[0]) and any(
                self.carries(a) for a in args):
            self.hops.append([where[0], None])
            self.pending[id(frame)] = len(self.hops) - 1
        if name == self.last and where[0] == (self.hops[-1][0] if self.hops else None):
            self.done = True
            sys.setprofile(None)  # the rest of the run at full speed

    def rooms(self) -> list[str]:
        rooms = [r for r, kept in self.hops if kept is not False]
        return [r for i, r in enumerate(rooms) if i == 0 or rooms[i - 1] != r]


def walk(args: list[str], last: str | None) -> Walk:
    from mla_convert.cli import app

    tracer = Walk(last)
    sys.setprofile(tracer)
    try:
        app(args, prog_name="mla-convert", standalone_mode=False)
    finally:
        sys.setprofile(None)
    return tracer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_source("llama-gqa", tmp_path_factory.mktemp("walk") / "src", seed=3, num_hidden_layers=2)


def test_kv_budget_walk_to_the_plan(tiny, capsys):
    """`mla-convert llama SRC --kv-budget 0.25 --dry-run`: the rooms the budget enters, in order, are the hops
    docs/architecture.md states, each once."""
    hops = stated_hops()
    rooms = walk(["llama", str(tiny), "--kv-budget", "0.25", "--dry-run"], None).rooms()
    assert "dry run: nothing written" in capsys.readouterr().out
    assert len(set(rooms)) == len(rooms), f"the walk enters a room twice: {rooms}"
    assert rooms == [room for room, _ in hops], f"the walk {rooms} differs from docs/architecture.md's hops {hops}"


def test_kv_budget_walk_to_the_written_config(tiny, tmp_path, capsys):
    """A real (tiny) conversion, traced until its config is made (the last function of the last hop): the same rooms,
    each once, and every function the hops name entered on the way."""
    hops = stated_hops()
    last_room, last_functions = hops[-1]
    out = tmp_path / "out"
    tracer = walk(["llama", str(tiny), "--kv-budget", "0.25", "--calib-samples", "2", "--calib-seq-len", "16",
                   "--refine-steps", "2", "--refine-model-steps", "2", "-o", str(out)], last_functions[-1])
    assert (out / "config.json").is_file() and "wrote" in capsys.readouterr().out
    assert tracer.done, f"the conversion never entered {last_room} {last_functions[-1]}"
    rooms = tracer.rooms()
    assert len(set(rooms)) == len(rooms), f"the walk enters a room twice: {rooms}"
    assert rooms == [room for room, _ in hops], f"the walk {rooms} differs from docs/architecture.md's hops {hops}"
    missing = [f"{room} {name}" for room, names in hops for name in names if (room, name) not in tracer.called]
    assert not missing, f"docs/architecture.md names functions the walk never entered: {missing}"
