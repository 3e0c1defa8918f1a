"""The shared pieces of the hostile-input tests (tests/test_hostile*.py): the CLI run, snapshots
of a user's files, variants of the tiny source, I/O faults (the workspace fixtures are in tests/conftest.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mla_convert.cli import app


def snapshot(root: Path) -> dict[str, str]:
    """Every entry below `root` (links as links, never followed): files by content hash."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "link -> " + str(path.readlink())
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


CALIB = ["--calib-samples", "2", "--calib-seq-len", "16", "--refine-steps", "0", "--refine-model-steps", "0"]


def convert_args(ws: Path, src: Path, out: Path, *extra: str) -> list[str]:
    return ["llama", str(src), "--rank", "8", "-o", str(out), "--calib-data", str(ws / "calib.txt"), *CALIB, *extra]


def variant(ws: Path, name: str, edit_config=None, edit_tensors=None) -> Path:
    """A copy of the tiny source with its config.json and/or tensors edited."""
    folder = ws / name
    if folder.exists():
        return folder
    shutil.copytree(ws / "src", folder)
    if edit_config is not None:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    if edit_tensors is not None:
        state = load_file(folder / "model.safetensors")
        edit_tensors(state)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _fail_on(monkeypatch, target: str, err: int, after: int = 0):
    """Make `target` (a dotted save function) raise OSError(err) from its call number `after` on."""
    import importlib

    module, name = target.rsplit(".", 1)
    mod = importlib.import_module(module)
    real, calls = getattr(mod, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > after:
            raise OSError(err, os_strerror(err), str(args[1]) if len(args) > 1 else None)
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, name, failing)


def os_strerror(err: int) -> str:
    import os

    return os.strerror(err)


def finetune_args(ws: Path, student: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--config", "smollm2-135m", f"model={student}", f"data={ws / 'calib.txt'}", f"output={out}",
            "teacher=none", "kd_weight=0", "max_steps=2", "seq_len=16", "batch_size=1", "grad_accum=1",
            "eval_windows=1", "eval_every=0", "save_every=0", "threads=1", "dtype=float32", "-q", *extra]


def _with_template(folder: Path, template: str) -> Path:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


