"""Hostile files, planted links and faults (issue 54): every case ends in one `error:` line and exit status 2 (or
runs, where the input is valid), with no traceback, nothing a user had changed, removed or uploaded, no output that
looks complete after a failure, and nothing unpickled."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error
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


@pytest.fixture(scope="module")
def ws(tmp_path_factory, sources, calib_text) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    shutil.copytree(sources["llama-gqa"], root / "src")
    shutil.copy(calib_text, root / "calib.txt")
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("my own notes")
    (root / "secret.txt").write_text("hf_" + "a" * 34 + "\n")
    return root


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


# ----------------------------------------------------------------------------------- staging and resume paths


def test_staging_folder_planted_as_a_link_is_refused(ws, tmp_path):
    """`.OUT.incomplete` pre-created as a link to a user's folder: never followed, nothing there deleted or written."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    (tmp_path / ".out.incomplete").symlink_to(user)
    before = snapshot(tmp_path)
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "out"))
    assert_user_error(code, output, ".out.incomplete", "link")
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "out").exists()


def test_staging_name_taken_by_a_file_is_one_line(ws, tmp_path):
    (tmp_path / ".out.incomplete").write_text("a file of the user's")
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "out"))
    assert_user_error(code, output, ".out.incomplete", "file")
    assert (tmp_path / ".out.incomplete").read_text() == "a file of the user's"


def test_lock_file_planted_as_a_link_is_never_truncated(ws, tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    (tmp_path / ".out.incomplete" / ".resume").mkdir(parents=True)
    (tmp_path / ".out.incomplete" / ".resume" / "lock").symlink_to(precious)
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "out"))
    assert_user_error(code, output, "lock")
    assert precious.read_text() == "keep me" and not (tmp_path / "out").exists()


def test_links_left_in_the_staging_folder_are_removed_not_followed(ws, tmp_path):
    """A leftover in a staging folder is removed on the next run; a link there goes, its target stays."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "data.txt").write_text("mine")
    (tmp_path / ".out.incomplete").mkdir()
    (tmp_path / ".out.incomplete" / "leftover").symlink_to(user)
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "out"))
    assert code == 0, output
    assert (user / "data.txt").read_text() == "mine"
    assert not (tmp_path / "out" / "leftover").exists()


# ------------------------------------------------------------------------------------------ the source validator


def _set(name, value):
    return lambda state: state.__setitem__(name, value)


SOURCE_CASES = {
    "a NaN weight": (dict(edit_tensors=lambda s: s["model.layers.1.mlp.up_proj.weight"].__setitem__(
        (0, 0), float("nan"))), "NaN or infinite"),
    "an infinite weight": (dict(edit_tensors=lambda s: s["model.layers.0.self_attn.k_proj.weight"].__setitem__(
        (1, 1), float("inf"))), "NaN or infinite"),
    "a missing MLP tensor": (dict(edit_tensors=lambda s: s.pop("model.layers.1.mlp.down_proj.weight")),
                             "lacks tensor model.layers.1.mlp.down_proj.weight"),
    "a missing final norm": (dict(edit_tensors=lambda s: s.pop("model.norm.weight")), "lacks tensor model.norm.weight"),
    "a wrong-shaped up_proj": (dict(edit_tensors=_set("model.layers.0.mlp.up_proj.weight", torch.zeros(95, 64))),
                               "mlp.up_proj.weight has shape [95, 64]"),
    "wrong-shaped embeddings": (dict(edit_tensors=_set("model.embed_tokens.weight", torch.zeros(320, 63))),
                                "embed_tokens.weight has shape"),
    "a 1-D o_proj": (dict(edit_tensors=_set("model.layers.1.self_attn.o_proj.weight", torch.zeros(4096))),
                     "o_proj.weight has shape [4096]"),
    "a vocab size that disagrees with the weights": (dict(edit_config=lambda c: c.update(vocab_size=400)),
                                                     "config.json implies [400, 64]"),
    "an intermediate size that disagrees": (dict(edit_config=lambda c: c.update(intermediate_size=128)),
                                            "config.json implies"),
    "kv heads inconsistent with the weights": (dict(edit_config=lambda c: c.update(num_key_value_heads=4)),
                                               "k_proj.weight has shape"),
    "head_dim inconsistent with the weights": (dict(edit_config=lambda c: c.update(head_dim=8)), "has shape"),
    "0 layers": (dict(edit_config=lambda c: c.update(num_hidden_layers=0)), "num_hidden_layers"),
    "an unknown rope type": (dict(edit_config=lambda c: c.update(rope_parameters={"rope_type": "warp",
                                                                                  "rope_theta": 1e4})), "warp"),
    "custom code for an unknown model type": (dict(edit_config=lambda c: c.update(
        model_type="evil_model", auto_map={"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model"})),
        "custom code"),
    "a deeply nested config.json": (dict(edit_config=lambda c: c.update(extra=json.loads("[" * 5000 + "]" * 5000))),
                                    "config.json"),
}


@pytest.mark.parametrize("case", sorted(SOURCE_CASES))
def test_broken_source_is_refused_before_any_work(ws, tmp_path, case):
    edits, needle = SOURCE_CASES[case]
    if case == "a deeply nested config.json":  # json.dumps of the edit would itself recurse too deep: written by hand
        folder = variant(ws, "nested")
        text = (folder / "config.json").read_text()
        (folder / "config.json").write_text(text[:-1] + ', "extra": ' + "[" * 100000 + "]" * 100000 + "}")
    else:
        folder = variant(ws, "v-" + case.replace(" ", "-"), **edits)
    before = snapshot(ws)
    code, output = run(*convert_args(ws, folder, tmp_path / "out"))
    assert_user_error(code, output, needle)
    assert snapshot(ws) == before and list(tmp_path.iterdir()) == []


def test_index_naming_shards_outside_the_folder_is_refused(ws, tmp_path):
    """A sharded index may not send a read outside the model folder (`../x`, an absolute path), nor be a list."""
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(ws / "src" / "model.safetensors", outside)
    for name, weight_map in (("up", "../elsewhere.safetensors"), ("abs", str(outside)), ("list", None)):
        folder = tmp_path / name
        shutil.copytree(ws / "src", folder)
        names = list(load_file(folder / "model.safetensors"))
        index = {"weight_map": [names] if weight_map is None else {n: weight_map for n in names}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        code, output = run(*convert_args(ws, folder, tmp_path / f"out-{name}"))
        assert_user_error(code, output, "model.safetensors.index.json")
        code, output = run("eval", folder, "--data", ws / "calib.txt", "--seq-len", "16", "--windows", "1")
        assert_user_error(code, output, "model.safetensors.index.json")
        assert not (tmp_path / f"out-{name}").exists()


# ---------------------------------------------------------------------------------------------- no pickle, no code


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any torch.load or pickle load fails the test (and loads nothing)."""
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def test_eval_and_generate_refuse_a_pickle_only_folder(ws, tmp_path, no_unpickling):
    folder = tmp_path / "pickled"
    shutil.copytree(ws / "src", folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    code, output = run("eval", folder, "--data", ws / "calib.txt", "--seq-len", "16", "--windows", "1")
    assert_user_error(code, output, "pytorch_model.bin", "pickle")
    code, output = run("generate", folder, "-p", "w1 w2", "-n", "2")
    assert_user_error(code, output, "pytorch_model.bin", "pickle")


def test_custom_tokenizer_code_is_not_carried_into_the_output(ws, tmp_path):
    """A source whose tokenizer_config names custom code converts with the stock classes, and the output does not
    ask to run code it does not hold (it loads with the default trust_remote_code)."""
    folder = tmp_path / "remote"
    shutil.copytree(ws / "src", folder)
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["evil.Tokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    code, output = run(*convert_args(ws, folder, tmp_path / "out"))
    assert code == 0, output
    assert "auto_map" not in json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tmp_path / "out")  # no prompt, no custom module needed


# ---------------------------------------------------------------------------------------------------- I/O faults


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


@pytest.mark.parametrize("err,needle", [(errno.ENOSPC, "disk is full"), (errno.EROFS, "read-only"),
                                        (errno.EBUSY, "busy")])
def test_write_error_while_writing_the_shards_keeps_the_layers_and_names_the_fix(ws, tmp_path, monkeypatch, err,
                                                                                 needle):
    """A write error at the end (the shards): one line, no OUT, the converted layers kept; the same command then
    finishes from them, to the bytes of an uninterrupted run."""
    out = tmp_path / "out"
    _fail_on(monkeypatch, "mla_convert.outputs.save_tensors", err)
    code, output = run(*convert_args(ws, ws / "src", out))
    assert_user_error(code, output, needle)
    assert not out.exists()
    kept = tmp_path / ".out.incomplete" / ".resume"
    assert (kept / "layer-00000.safetensors").is_file() and (kept / "layer-00001.safetensors").is_file()
    monkeypatch.undo()
    code, output = run(*convert_args(ws, ws / "src", out))
    assert code == 0, output
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "straight"))
    assert code == 0, output
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "straight" / "model.safetensors").read_bytes()


def test_write_error_on_a_kept_layer_is_one_line(ws, tmp_path, monkeypatch):
    _fail_on(monkeypatch, "safetensors.torch.save_file", errno.ENOSPC, after=1)
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "out"))
    assert_user_error(code, output, "disk is full")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_damaged_kept_layer_is_done_again(ws, tmp_path, monkeypatch, damage):
    """A kept layer file damaged between runs is noticed by its checksum and converted again: the result equals an
    uninterrupted run's, with no traceback on this or any later run."""
    out = tmp_path / "out"
    _fail_on(monkeypatch, "mla_convert.outputs.save_tensors", errno.ENOSPC)
    assert run(*convert_args(ws, ws / "src", out))[0] == 2
    monkeypatch.undo()
    layer = tmp_path / ".out.incomplete" / ".resume" / "layer-00001.safetensors"
    data = bytearray(layer.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[-5] ^= 0xFF  # a tensor's bytes: the file still parses
    layer.write_bytes(bytes(data))
    code, output = run(*convert_args(ws, ws / "src", out))
    assert code == 0, output
    assert "damaged" in output
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "straight"))
    assert code == 0, output
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "straight" / "model.safetensors").read_bytes()


# ------------------------------------------------------------------------------------------------- finetune output


@pytest.fixture(scope="module")
def student(ws, convert_tiny) -> Path:
    return convert_tiny(ws / "src", rank=8, rope_dims=8)


def finetune_args(ws: Path, student: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--config", "smollm2-135m", f"model={student}", f"data={ws / 'calib.txt'}", f"output={out}",
            "teacher=none", "kd_weight=0", "max_steps=2", "seq_len=16", "batch_size=1", "grad_accum=1",
            "eval_windows=1", "eval_every=0", "save_every=0", "threads=1", "dtype=float32", "-q", *extra]


@pytest.mark.parametrize("planted", ["a user's metrics.jsonl", "metrics.jsonl linked to a user's file",
                                     "loss.png linked to a user's file", "final linked to a user's folder"])
def test_finetune_never_touches_a_users_files_in_its_output(ws, student, tmp_path, planted):
    out, user = tmp_path / "run", tmp_path / "user"
    out.mkdir()
    user.mkdir()
    (user / "log.jsonl").write_text('{"my": "experiment"}\n')
    if planted == "a user's metrics.jsonl":
        (out / "metrics.jsonl").write_text('{"my": "experiment"}\n')
    elif planted == "final linked to a user's folder":
        (out / "metrics.jsonl").write_text("")
        (out / "final").symlink_to(user)
    else:
        (out / planted.split()[0]).symlink_to(user / "log.jsonl")
        if planted.startswith("loss.png"):
            (out / "metrics.jsonl").write_text("")  # otherwise a started run of ours
    before = snapshot(tmp_path)
    for extra in ([], ["overwrite=true"]):
        code, output = run(*finetune_args(ws, student, out, *extra))
        assert_user_error(code, output, str(out))
        assert snapshot(tmp_path) == before


def test_finetune_into_a_locked_output_is_refused(ws, student, tmp_path):
    """Two runs into one output: the second is refused while the first holds the folder's lock."""
    import os

    from mla_convert.training.checkpoints import lock_run_folder

    out = tmp_path / "run"
    fd = lock_run_folder(out)
    try:
        code, output = run(*finetune_args(ws, student, out))
        assert_user_error(code, output, "another fine-tuning run is writing")
        assert list(out.iterdir()) == []
    finally:
        os.close(fd)
    code, output = run(*finetune_args(ws, student, out))
    assert code == 0, output
    fd = lock_run_folder(out)  # released when the run ended
    os.close(fd)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_finetune_failing_while_writing_final_leaves_no_complete_looking_final(ws, student, tmp_path, monkeypatch,
                                                                             err):
    """A write error (or a kill) while final/ is written: no final/ at all (provenance.json goes in last, under a
    hidden name renamed into place); the next run finishes it."""
    from mla_convert.training.loop import Trainer

    out = tmp_path / "run"

    def failing(self, final, *args):
        (final / "provenance.json").write_text("{}")  # half-way: even a provenance on its way must not count
        raise OSError(err, os_strerror(err), str(final / "README.md"))

    monkeypatch.setattr(Trainer, "_write_provenance", failing)
    code, output = run(*finetune_args(ws, student, out))
    assert_user_error(code, output, os_strerror(err))
    assert not (out / "final").exists()
    monkeypatch.undo()
    code, output = run(*finetune_args(ws, student, out))
    assert code == 0, output
    assert (out / "final" / "provenance.json").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["final", "loss.png", "metrics.jsonl"]


RECIPE_CASES = {
    "eval_seq_len 0": (["eval_seq_len=0"], "eval_seq_len"),
    "a negative seed": (["seed=-1"], "seed"),
    "100000 threads": (["threads=100000"], "threads"),
}


@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
def test_finetune_setting_out_of_range_is_one_line(ws, student, tmp_path, case):
    extra, needle = RECIPE_CASES[case]
    code, output = run(*finetune_args(ws, student, tmp_path / "run", *extra))
    assert_user_error(code, output, needle)
    assert not (tmp_path / "run").exists()


def test_yaml_alias_bomb_is_refused_small(ws, tmp_path):
    """A 10-level alias bomb expands to 10^10 entries: refused in one short line, without expanding it."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    lines += ["finetune:", "  model: *a9", "  data: x", "  output: y"]
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text("\n".join(lines) + "\n")
    code, output = run("finetune", "--config", recipe)
    assert_user_error(code, output, "alias")
    assert len(output) < 1000


# --------------------------------------------------------------------------------------- texts, tokenizers, templates


def test_whitespace_only_calibration_text_is_refused(ws, tmp_path):
    (tmp_path / "blank.txt").write_text(" \n\t\n   \n" * 100)
    code, output = run("llama", ws / "src", "--rank", "8", "-o", tmp_path / "out", "--calib-data",
                       tmp_path / "blank.txt", *CALIB)
    assert_user_error(code, output, "only whitespace")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.txt"]


def test_garbage_tokenizer_is_refused_without_calibration_text(ws, tmp_path):
    """With --calib-data none the tokenizer is still read before any work: a broken one is refused, not copied into a
    finished-looking output."""
    for garbage in ('{"version": "1.0", "model": {"type": "BPE", "vocab": 5}}', "{not json"):
        folder = tmp_path / "badtok"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(ws / "src", folder)
        (folder / "tokenizer.json").write_text(garbage)
        code, output = run("llama", folder, "--rank", "8", "-o", tmp_path / "out", "--calib-data", "none")
        assert_user_error(code, output, "tokenizer")
        assert not (tmp_path / "out").exists()


def _fifo_with(tmp_path: Path, name: str, text: str) -> Path:
    """A named pipe that yields `text` once, as `<(cat file)` does."""
    import os
    import threading

    path = tmp_path / name
    os.mkfifo(path)

    def feed():
        with open(path, "w") as f:
            f.write(text)

    threading.Thread(target=feed, daemon=True).start()
    return path


def test_process_substitution_is_valid_input(ws, tmp_path):
    text = (ws / "calib.txt").read_text()
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "out")[:-len(CALIB) - 2], "--calib-data",
                       _fifo_with(tmp_path, "calib-pipe", text), *CALIB)
    assert code == 0, output
    code, output = run("eval", tmp_path / "out", "--data", _fifo_with(tmp_path, "eval-pipe", text), "--seq-len", "16",
                       "--windows", "1")
    assert code == 0, output
    assert "perplexity" in output


@pytest.fixture(scope="module")
def chat_model(student, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(student, folder)
    return folder


def _with_template(folder: Path, template: str) -> Path:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


@pytest.mark.parametrize("template,needle", [
    ("{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}", "did not finish"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox"),
    ("{{ messages[0].__init__.__globals__ }}", "sandbox"),
    ("{% for m in messages %}{{ m.content", "cannot be rendered"),
])
def test_hostile_chat_template_is_one_line(chat_model, monkeypatch, template, needle):
    monkeypatch.setattr("mla_convert.templates.SECONDS", 2.0)
    _with_template(chat_model, template)
    code, output = run("generate", chat_model, "-p", "w1 w2", "-n", "2", "--chat")
    assert_user_error(code, output, needle)


def test_plain_chat_template_still_renders(chat_model):
    _with_template(chat_model, "{% for m in messages %}{{ m.content }}{% endfor %}")
    code, output = run("generate", chat_model, "-p", "w1 w2", "-n", "2", "--chat")
    assert code == 0, output


# ------------------------------------------------------------------------------------------------ export, eval


@pytest.fixture(scope="module")
def exportable(ws, convert_tiny) -> Path:
    return convert_tiny(ws / "src", rank=8, rope_strategy="uniform")


def test_export_write_error_leaves_nothing_and_stale_stages_are_cleaned(ws, exportable, tmp_path, monkeypatch):
    """A full disk during export: one line, no OUT, no hidden copy; a hidden copy a killed export left is removed by
    the next export, one still locked by a running export is not."""
    import os

    from mla_convert.outputs import _lock_dir

    out = tmp_path / "exp"
    _fail_on(monkeypatch, "mla_convert.outputs.save_tensors", errno.ENOSPC)
    code, output = run("export", exportable, "-o", out, "--no-verify")
    assert_user_error(code, output, "disk is full")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    stale, busy = tmp_path / ".exp.incomplete-dead01", tmp_path / ".exp.incomplete-busy01"
    for folder in (stale, busy):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / ".exp.incomplete-link").symlink_to(ws / "mine")
    held = _lock_dir(busy)
    try:
        code, output = run("export", exportable, "-o", out, "--no-verify")
        assert code == 0, output
    finally:
        held.close()
    assert not stale.exists() and busy.is_dir() and (ws / "mine" / "notes.txt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".exp.incomplete-busy01", ".exp.incomplete-link", "exp"]
    os.unlink(tmp_path / ".exp.incomplete-link")


def test_output_that_cannot_be_renamed_is_written_in_place(ws, tmp_path, monkeypatch):
    """An empty folder taken for a mount point (where this machine cannot mount one; the real mount is tested
    below): the conversion is written into it, the same bytes as anywhere else, nothing hidden left there."""
    import os

    mount = tmp_path / "mnt"
    mount.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mount or real(p))
    code, output = run(*convert_args(ws, ws / "src", mount))
    assert code == 0, output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt"]
    assert not [p.name for p in mount.iterdir() if p.name.startswith(".")]
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "plain"))
    assert code == 0, output
    for name in ("model.safetensors", "config.json", "provenance.json"):
        assert (mount / name).is_file()
    assert (mount / "model.safetensors").read_bytes() == (tmp_path / "plain" / "model.safetensors").read_bytes()
    assert str(mount) in (mount / "README.md").read_text()  # the card names where the model is, not its staging


def test_eval_record_on_a_read_only_folder_is_one_line(student, ws, tmp_path, monkeypatch):
    folder = tmp_path / "model"
    shutil.copytree(student, folder)
    before = snapshot(folder)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os_strerror(errno.EROFS), str(folder / "provenance.json"))

    monkeypatch.setattr("mla_convert.provenance.save", read_only)
    code, output = run("eval", folder, "--data", ws / "calib.txt", "--seq-len", "16", "--windows", "1", "--record")
    assert_user_error(code, output, "read-only", "provenance.json")
    assert snapshot(folder) == before


def test_out_of_memory_is_one_line(ws, student, monkeypatch):
    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr("mla_convert.evaluate.perplexity", no_memory)
    code, output = run("eval", student, "--data", ws / "calib.txt", "--seq-len", "16", "--windows", "1")
    assert_user_error(code, output, "out of memory")


# ------------------------------------------------------------------------------- damaged files in eval and generate


def _truncated_gguf(path: Path) -> Path:
    """A GGUF header that promises metadata and stops in the middle of its first key."""
    import struct

    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 5) + struct.pack("<Q", 40) + b"general.arch")
    return path


def _edited(student: Path, tmp_path: Path, name: str, edit) -> Path:
    folder = tmp_path / name
    shutil.copytree(student, folder)
    edit(folder)
    return folder


def _json_edit(file: str, **fields):
    def edit(folder: Path):
        record = json.loads((folder / file).read_text())
        record.update(fields)
        (folder / file).write_text(json.dumps(record))
    return edit


DAMAGED = {
    "eval an invalid tokenizer.json": (lambda f: (f / "tokenizer.json").write_text("{not json"), "eval", "cannot load"),
    "generate with temperature of the wrong type": (_json_edit("generation_config.json", temperature=[1]), "generate",
                                                    "temperature"),
    "generate with a negative top_k": (_json_edit("generation_config.json", top_k=-5), "generate", "top_k"),
    "generate with a top_p above 1": (_json_edit("generation_config.json", top_p=7), "generate", "top_p"),
    "generate with a text eos id": (_json_edit("generation_config.json", eos_token_id="x"), "generate", "eos_token_id"),
    "eval --record with measurements a list": (_json_edit("provenance.json", measurements=[1, 2]), "record",
                                               "measurements"),
    "eval --record with kind a number": (_json_edit("provenance.json", kind=5), "record", "kind"),
    "eval --record with a perplexity of text": (_json_edit("provenance.json", measurements={"perplexity": "low"}),
                                                "record", "perplexity"),
    "push with measurements text": (_json_edit("provenance.json", measurements="y"), "push", "measurements"),
    "push with kind a list": (_json_edit("provenance.json", kind=[1]), "push", "kind"),
    "push with a parent of the wrong shape": (_json_edit("provenance.json", parent={"kind": "convert",
                                                                                    "options": [1]}), "push",
                                              "parent's options"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_model_folder_is_one_line(ws, student, tmp_path, case):
    edit, command, needle = DAMAGED[case]
    folder = _edited(student, tmp_path, "model", edit)
    before = snapshot(folder)
    data = ["--data", ws / "calib.txt", "--seq-len", "16", "--windows", "1"]
    args = {"eval": ["eval", folder, *data], "record": ["eval", folder, *data, "--record"],
            "generate": ["generate", folder, "-p", "w1 w2", "-n", "2", "--sample"],
            "push": ["push", folder, "me/model", "--dry-run"]}[command]
    code, output = run(*args)
    assert_user_error(code, output, needle)
    assert snapshot(folder) == before


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_truncated_gguf_is_one_line(ws, tmp_path, command):
    path = _truncated_gguf(tmp_path / "model.gguf")
    args = (["eval", path, "--data", ws / "calib.txt", "--seq-len", "16"] if command == "eval"
            else ["generate", path, "-p", "hi", "-n", "2"])
    code, output = run(*args)
    assert_user_error(code, output, "cannot load", "model.gguf")


def test_finetune_full_disk_while_saving_a_checkpoint(ws, student, tmp_path, monkeypatch):
    """A full disk while step_1/ is saved: one line, no step_1/ that looks complete (nor a loadable half), and the
    next run (same command) starts cleanly and finishes."""
    out = tmp_path / "run"
    _fail_on(monkeypatch, "safetensors.torch.save_file", errno.ENOSPC)
    code, output = run(*finetune_args(ws, student, out, "save_every=1", "max_steps=2"))
    assert_user_error(code, output, "disk is full")
    assert not (out / "step_1").exists() and not (out / "final").exists()
    monkeypatch.undo()
    code, output = run(*finetune_args(ws, student, out, "save_every=1", "max_steps=2"))
    assert code == 0, output
    assert sorted(p.name for p in out.iterdir()) == ["final", "loss.png", "metrics.jsonl", "step_1"]


def test_torch_allocation_failure_is_one_line(ws, student, monkeypatch):
    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1099511627776 bytes.")

    monkeypatch.setattr("mla_convert.evaluate.perplexity", no_memory)
    code, output = run("eval", student, "--data", ws / "calib.txt", "--seq-len", "16", "--windows", "1")
    assert_user_error(code, output, "out of memory", "smaller batch")


@pytest.mark.parametrize("name", ["fingerprint.json.tmp", "layer-00001.safetensors.sha256.tmp",
                                  "provenance.json.tmp", "README.md.tmp", "model.safetensors.index.json.tmp"])
def test_write_error_at_any_file_of_a_conversion(ws, tmp_path, monkeypatch, name):
    """A full disk at any of the files a conversion writes (text files here, the tensors above): one line, no OUT,
    and the same command afterwards gives the bytes of an uninterrupted run."""
    real = Path.write_text

    def failing(self, *args, **kwargs):
        if self.name == name and ".out.incomplete" in str(self):
            raise OSError(errno.ENOSPC, os_strerror(errno.ENOSPC), str(self))
        return real(self, *args, **kwargs)

    out = tmp_path / "out"
    monkeypatch.setattr(Path, "write_text", failing)
    code, output = run(*convert_args(ws, ws / "src", out))
    assert_user_error(code, output, "disk is full", name)
    assert not out.exists()
    monkeypatch.undo()
    code, output = run(*convert_args(ws, ws / "src", out))
    assert code == 0, output
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "straight"))
    assert code == 0, output
    for f in ("model.safetensors", "config.json"):
        assert (out / f).read_bytes() == (tmp_path / "straight" / f).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "straight"]


def test_finetune_batch_that_does_not_fit_is_one_line(ws, student, tmp_path, monkeypatch):
    from mla_convert.training.loop import Trainer

    def too_big(self, step):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8796093022208 bytes.")

    monkeypatch.setattr(Trainer, "train_step", too_big)
    code, output = run(*finetune_args(ws, student, tmp_path / "run", "batch_size=100000"))
    assert_user_error(code, output, "out of memory", "smaller batch")
    assert not (tmp_path / "run" / "final").exists()


def test_looping_chat_template_in_a_source_does_not_hang_self_calibration(ws, tmp_path, monkeypatch):
    """`--calib-data self` renders the source's chat template: a template that never ends is stopped, one line."""
    monkeypatch.setattr("mla_convert.templates.SECONDS", 1.0)
    folder = tmp_path / "looping"
    shutil.copytree(ws / "src", folder)
    _with_template(folder, "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}")
    code, output = run("llama", folder, "--rank", "8", "-o", tmp_path / "out", "--calib-data", "self",
                       "--calib-samples", "2", "--calib-seq-len", "16", "--calib-sample-tokens", "8",
                       "--refine-steps", "0", "--refine-model-steps", "0")
    assert_user_error(code, output, "did not finish")
    assert not (tmp_path / "out").exists()


FINETUNE_KILLER = """
import os, signal, sys
from mla_convert.training import loop
real = loop.Trainer._write_provenance
def killing(self, final, *args):
    real(self, final, *args)  # the whole model folder, provenance and card written: then SIGKILL, before the rename
    os.kill(os.getpid(), signal.SIGKILL)
loop.Trainer._write_provenance = killing
from mla_convert.cli import app
sys.argv[0] = "mla-convert"
app()
"""


def test_finetune_killed_while_finishing_leaves_no_final(ws, student, tmp_path):
    """kill -9 with final/ fully written but not yet in place: no final/ at all; the next run finishes it."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", FINETUNE_KILLER, *finetune_args(ws, student, out)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (out / "final").exists() and (out / ".final.incomplete" / "provenance.json").is_file()
    code, output = run(*finetune_args(ws, student, out))
    assert code == 0, output
    assert sorted(p.name for p in out.iterdir()) == ["final", "loss.png", "metrics.jsonl"]


def test_export_without_room_is_refused_before_any_work(exportable, tmp_path, monkeypatch):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    code, output = run("export", exportable, "-o", tmp_path / "exp", "--no-verify")
    assert_user_error(code, output, "free", "the checkpoint")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------- long lines, pipes and devices


class _Spy:
    """A tokenizer that records the length of every text it is called on."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def __call__(self, text, **kwargs):
        self.calls.append(len(text))
        return self.tokenizer(text, **kwargs)


@pytest.mark.parametrize("shape", ["one long line", "no whitespace at all", "many short lines"])
def test_a_text_is_tokenized_in_bounded_pieces(ws, monkeypatch, shape):
    """No tokenizer call gets more than TOKENIZE_CHUNK_CHARS characters, whatever the text's lines (a 30 MB line in
    one call took 8.9 GB), and the ids are those of one call where the cuts fall before spaces or after newlines."""
    from mla_convert import data
    from mla_convert.checkpoint import open_source

    tokenizer = open_source(str(ws / "src")).tokenizer()
    words = (ws / "calib.txt").read_text().split()
    text = {"one long line": " ".join(words * 4), "no whitespace at all": "".join(words),
            "many short lines": "\n".join(words * 4)}[shape]
    monkeypatch.setattr(data, "TOKENIZE_CHUNK_CHARS", 1000)
    for chunk_lines in (None, data.TRAIN_CHUNK_LINES):
        spy = _Spy(tokenizer)
        ids = data.tokenize(spy, text, chunk_lines)
        assert len(spy.calls) > 1 and max(spy.calls) <= 1000 and sum(spy.calls) == len(text)
        if shape != "no whitespace at all":
            assert torch.equal(ids, torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]))


def test_one_line_calibration_and_training_text_runs(ws, student, tmp_path, monkeypatch):
    """A text on one line (no newline at all) calibrates a conversion and trains a fine-tune, tokenized in pieces."""
    from mla_convert import data

    monkeypatch.setattr(data, "TOKENIZE_CHUNK_CHARS", 2000)
    line = tmp_path / "line.txt"
    line.write_text(" ".join((ws / "calib.txt").read_text().split() * 5))
    code, output = run("llama", ws / "src", "--rank", "8", "-o", tmp_path / "out", "--calib-data", line, *CALIB)
    assert code == 0, output
    args = [a if not a.startswith("data=") else f"data={line}" for a in finetune_args(ws, student, tmp_path / "run")]
    code, output = run(*args)
    assert code == 0, output
    assert (tmp_path / "run" / "final" / "provenance.json").is_file()


def test_a_pipe_nobody_writes_to_is_refused_not_waited_on(ws, tmp_path, monkeypatch):
    import os

    monkeypatch.setattr("mla_convert.data.PIPE_IDLE_SECONDS", 1.0)
    os.mkfifo(tmp_path / "silent")
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "out")[:-len(CALIB) - 2], "--calib-data",
                       tmp_path / "silent", *CALIB)
    assert_user_error(code, output, "silent is a pipe that gave nothing for 1 s", "write the text to a file")
    code, output = run("eval", ws / "src", "--data", tmp_path / "silent", "--seq-len", "16", "--windows", "1")
    assert_user_error(code, output, "gave nothing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["silent"]


def test_a_pipe_that_never_ends_is_read_to_a_bound(ws, tmp_path, monkeypatch):
    """`--calib-data <(yes)`: read up to PIPE_MAX_BYTES, then refused in one line (memory stays bounded)."""
    import os
    import threading

    monkeypatch.setattr("mla_convert.data.PIPE_MAX_BYTES", 1 << 16)
    path = tmp_path / "endless"
    os.mkfifo(path)

    def feed():
        try:
            with open(path, "w") as f:
                while True:
                    f.write("y\n" * 4096)
        except BrokenPipeError:  # the reader gave up: the bound held
            pass

    threading.Thread(target=feed, daemon=True).start()
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "out")[:-len(CALIB) - 2], "--calib-data", path,
                       *CALIB)
    assert_user_error(code, output, "endless is a pipe that gives more than 0.0625 MiB")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["convert", "eval", "finetune"])
def test_a_device_given_as_text_is_refused(ws, student, tmp_path, command):
    """/dev/zero (endless) as a text: refused before it is read, in one line."""
    args = {"convert": ["llama", ws / "src", "--rank", "8", "-o", tmp_path / "out", "--calib-data", "/dev/zero",
                        *CALIB],
            "eval": ["eval", student, "--data", "/dev/zero", "--seq-len", "16", "--windows", "1"],
            "finetune": [a if not a.startswith("data=") else "data=/dev/zero"
                         for a in finetune_args(ws, student, tmp_path / "out")]}[command]
    code, output = run(*args)
    assert_user_error(code, output, "/dev/zero is not a regular file")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------- NaN weights in a native checkpoint


@pytest.fixture(scope="module")
def damaged_native(exportable, tmp_path_factory) -> Path:
    """A native checkpoint with one NaN and one infinite weight in its latent projections."""
    folder = tmp_path_factory.mktemp("damaged") / "model"
    shutil.copytree(exportable, folder)
    state = load_file(folder / "model.safetensors")
    state["model.layers.1.self_attn.kv_b_proj.weight"][0, 0] = float("nan")
    state["model.layers.1.self_attn.o_proj.weight"][1, 1] = float("inf")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("command", ["export", "export gguf", "eval", "generate", "finetune"])
def test_nan_weights_in_a_native_checkpoint_are_refused_before_writing(ws, damaged_native, tmp_path, command):
    before = snapshot(damaged_native)
    args = {"export": ["export", damaged_native, "-o", tmp_path / "out", "--no-verify"],
            "export gguf": ["export", damaged_native, "--format", "gguf", "-o", tmp_path / "out.gguf"],
            "eval": ["eval", damaged_native, "--data", ws / "calib.txt", "--seq-len", "16", "--windows", "1"],
            "generate": ["generate", damaged_native, "-p", "w1 w2", "-n", "2"],
            "finetune": finetune_args(ws, damaged_native, tmp_path / "out")}[command]
    code, output = run(*args)
    assert_user_error(code, output, "model.layers.1.self_attn.kv_b_proj.weight", "1 NaN or infinite values",
                      "damaged")
    assert "nan" not in output.replace("NaN", "")
    assert list(tmp_path.iterdir()) == [] and snapshot(damaged_native) == before


def test_a_diverging_finetune_stops_without_a_final(ws, student, tmp_path, monkeypatch):
    """A loss that turns NaN: one line naming the step, no final/ that looks like a result."""
    import mla_convert.training.loop as loop

    real = loop.lm_loss
    monkeypatch.setattr(loop, "lm_loss", lambda logits, ids: real(logits, ids) * float("nan"))
    out = tmp_path / "run"
    code, output = run(*finetune_args(ws, student, out))
    assert_user_error(code, output, "NaN or infinite at step 1", "lower lr")
    assert not (out / "final").exists() and not any(p.name.startswith(".final") for p in out.iterdir())


def test_logits_that_overflow_are_one_line(ws, student, monkeypatch):
    """Finite weights, NaN logits (an activation overflow): eval says so instead of printing nan."""
    import torch.nn.functional as F

    real = F.cross_entropy
    monkeypatch.setattr(F, "cross_entropy", lambda *a, **k: real(*a, **k) * float("nan"))
    code, output = run("eval", student, "--data", ws / "calib.txt", "--seq-len", "16", "--windows", "1")
    assert_user_error(code, output, "NaN or infinite", "--dtype float32")


# ------------------------------------------------------------------------------------- two fine-tunes at once

FINETUNE_HOLDER = """
import os, sys, time
from pathlib import Path
from mla_convert.training import loop
marks = Path(os.environ["MARKS"])
real = loop.lock_run_folder
def holding(out):
    fd = real(out)  # the lock is ours: say so, then hold it until the test lets this run go on
    (marks / f"locked-{os.getpid()}").write_text("")
    for _ in range(1200):
        if (marks / "go").exists():
            break
        time.sleep(0.1)
    return fd
loop.lock_run_folder = holding
from mla_convert.cli import app
sys.argv[0] = "mla-convert"
app()
"""


def test_two_finetunes_into_one_output_at_once(ws, student, tmp_path):
    """Two real processes started together into one output: exactly one runs (exit 0, its metrics alone), the other
    exits 2 with one line and touches nothing."""
    import os
    import subprocess
    import sys
    import time

    out, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MARKS": str(marks)}
    args = [sys.executable, "-c", FINETUNE_HOLDER, *map(str, finetune_args(ws, student, out))]
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        deadline = time.monotonic() + 300
        while not any(p.poll() is not None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)  # the loser ends while the winner holds the lock
        losers = [p for p in procs if p.poll() is not None]
        assert len(losers) == 1, "neither run ended while the other held the output"
        loser_output = losers[0].communicate()[0]
        assert_user_error(losers[0].returncode, loser_output, "another fine-tuning run is writing", str(out))
        assert len(list(marks.iterdir())) == 1  # the winner holds the lock; the loser never got it
    finally:
        (marks / "go").write_text("")
        winner = [p for p in procs if p.poll() is None or p.returncode != 2]
        outputs = [p.communicate(timeout=600)[0] for p in procs if p.returncode is None]
    assert len(winner) == 1 and winner[0].returncode == 0, outputs
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2]
    assert sorted(p.name for p in out.iterdir()) == ["final", "loss.png", "metrics.jsonl"]


# ------------------------------------------------------------------------- FIFOs and devices inside the folders read


@pytest.mark.parametrize("planted", ["a FIFO", "a link to /dev/zero"])
def test_overwrite_never_reads_a_planted_provenance_that_does_not_end(ws, tmp_path, planted):
    """`--overwrite` reads OUT/provenance.json to tell whether OUT is ours: a FIFO there (which would block the read)
    or a link to /dev/zero (which never ends) is not ours, refused in one line, and left as it was."""
    import os

    out = tmp_path / "out"
    out.mkdir()
    if planted == "a FIFO":
        os.mkfifo(out / "provenance.json")
    else:
        (out / "provenance.json").symlink_to("/dev/zero")
    before = snapshot(tmp_path) if planted != "a FIFO" else sorted(os.listdir(out))
    code, output = run(*convert_args(ws, ws / "src", out, "--overwrite"))
    assert_user_error(code, output, "not a folder mla-convert wrote")
    assert (snapshot(tmp_path) if planted != "a FIFO" else sorted(os.listdir(out))) == before


def test_a_fifo_planted_as_the_resume_fingerprint_is_not_read(ws, tmp_path):
    """A FIFO in place of the staging folder's fingerprint: nothing kept is trusted, the run starts over and
    finishes (a blocking read would hang it)."""
    import os

    keep = tmp_path / ".out.incomplete" / ".resume"
    keep.mkdir(parents=True)
    os.mkfifo(keep / "fingerprint.json")
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "out"))
    assert code == 0, output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_gguf_export_write_error_leaves_nothing(exportable, tmp_path, monkeypatch):
    """A full disk while the GGUF's tensors are written: one line naming the fix, no NAME.gguf and no partial file."""
    import gguf

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os_strerror(errno.ENOSPC), str(tmp_path / "out.gguf"))

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full)
    code, output = run("export", exportable, "--format", "gguf", "-o", tmp_path / "out.gguf")
    assert_user_error(code, output, "disk is full")
    assert list(tmp_path.iterdir()) == []


def test_finetune_write_error_on_the_metrics_is_one_line(ws, student, tmp_path, monkeypatch):
    """The disk fills while a metrics line is appended mid-run: one line, and no final/."""
    from mla_convert.training.metrics import Metrics

    def full(self, **fields):
        raise OSError(errno.ENOSPC, os_strerror(errno.ENOSPC), str(self.path))

    monkeypatch.setattr(Metrics, "write", full)
    out = tmp_path / "run"
    code, output = run(*finetune_args(ws, student, out))
    assert_user_error(code, output, "disk is full", "metrics.jsonl")
    assert not (out / "final").exists()


def test_a_large_binary_file_given_as_text_is_refused_before_it_is_read(tmp_path):
    """A weights file passed as text (here 256 MiB of zeros, sparse): refused from its head, never read whole."""
    import tracemalloc

    from mla_convert.data import load_text
    from mla_convert.errors import UserError

    big = tmp_path / "weights.txt"
    with open(big, "wb") as f:
        f.truncate(256 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match="not UTF-8 text"):
            load_text(str(big))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


@pytest.mark.parametrize("planted", ["a FIFO", "a link to /dev/zero"])
@pytest.mark.parametrize("command", ["convert", "eval of the source", "eval of a converted model", "export"])
def test_weights_that_are_not_a_file_are_refused_not_read(ws, student, tmp_path, planted, command):
    """model.safetensors planted as a FIFO (a read blocks) or a link to a device (a read never ends): one line."""
    import os

    folder = tmp_path / "model"
    shutil.copytree(student if command in ("eval of a converted model", "export") else ws / "src", folder)
    (folder / "model.safetensors").unlink()
    if planted == "a FIFO":
        os.mkfifo(folder / "model.safetensors")
    else:
        (folder / "model.safetensors").symlink_to("/dev/zero")
    data = ["--data", ws / "calib.txt", "--seq-len", "16", "--windows", "1"]
    args = {"convert": convert_args(ws, folder, tmp_path / "out"), "eval of the source": ["eval", folder, *data],
            "eval of a converted model": ["eval", folder, *data],
            "export": ["export", folder, "-o", tmp_path / "out", "--no-verify"]}[command]
    code, output = run(*args)
    assert_user_error(code, output, "model.safetensors")
    assert not (tmp_path / "out").exists()


def test_a_jsonl_line_nested_too_deep_is_one_line(ws, tmp_path):
    (tmp_path / "deep.jsonl").write_text('{"text": ' + "[" * 100000 + "]" * 100000 + "}\n")
    code, output = run(*convert_args(ws, ws / "src", tmp_path / "out")[:-len(CALIB) - 2], "--calib-data",
                       tmp_path / "deep.jsonl", *CALIB)
    assert_user_error(code, output, "deep.jsonl:1")


# ------------------------------------------------------------------- a disk that fills, a mount point as the output


class Disk:
    """A real size-limited file system (tmpfs) mounted at `path`; `fill(leave)` takes all but about `leave` bytes of
    it, as another program writing there would, `unfill()` gives them back."""

    def __init__(self, path: Path):
        self.path = path
        self.filler = path / "another-programs-file"

    def free(self) -> int:
        import os

        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int = 0) -> None:
        import os

        size = max(self.free() - leave, 0) + (self.filler.stat().st_size if self.filler.exists() else 0)
        with open(self.filler, "ab") as f:
            os.posix_fallocate(f.fileno(), 0, size)

    def unfill(self) -> None:
        self.filler.unlink(missing_ok=True)


def _mount_tmpfs(path: Path, size: str = "16m") -> Path:
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        done = None
        why = str(e)
    else:
        why = done.stderr.strip() or f"exit status {done.returncode}"
    if done is None or done.returncode != 0:
        pytest.skip(f"this machine cannot mount a size-limited file system (tmpfs: {why}); it needs root with "
                    "CAP_SYS_ADMIN")
    return path


@pytest.fixture
def disk(tmp_path):
    path = _mount_tmpfs(tmp_path / "disk")
    yield Disk(path)
    import subprocess

    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def _fill_after(monkeypatch, target: str, disk: Disk, leave: int) -> None:
    """Let the command's up-front room check (`target`) pass, then fill the disk: it fills while the command writes."""
    import importlib

    module, name = target.rsplit(".", 1)
    mod = importlib.import_module(module)
    real = getattr(mod, name)

    def check_then_fill(*args, **kwargs):
        real(*args, **kwargs)
        disk.fill(leave)

    monkeypatch.setattr(mod, name, check_then_fill)


def assert_disk_full(code: int, output: str, place: Path) -> None:
    """One line: the disk is full, the place, the room needed."""
    assert_user_error(code, output, "disk is full", "No space left on device", str(place), "needs about")


@pytest.mark.parametrize("leave", [0, 96 << 10, 256 << 10])
def test_convert_on_a_disk_that_fills_while_it_writes(ws, disk, monkeypatch, leave):
    """The up-front check passes, then the disk fills (at the first file, among the kept layers, at the shards): one
    line naming OUT and the room, no OUT, the source untouched; once there is room the same command finishes, to the
    bytes of an uninterrupted run."""
    out, before = disk.path / "out", snapshot(ws / "src")
    _fill_after(monkeypatch, "mla_convert.conversion.pipeline.check_room", disk, leave)
    code, output = run(*convert_args(ws, ws / "src", out))
    assert_disk_full(code, output, out)
    assert not out.exists() and snapshot(ws / "src") == before
    assert sorted(p.name for p in disk.path.iterdir()) in ([".out.incomplete", disk.filler.name], [disk.filler.name])
    monkeypatch.undo()
    disk.unfill()
    code, output = run(*convert_args(ws, ws / "src", out))
    assert code == 0, output
    code, output = run(*convert_args(ws, ws / "src", disk.path / "straight"))
    assert code == 0, output
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (disk.path / "straight" / name).read_bytes()


def test_export_on_a_disk_that_fills_while_it_writes(exportable, disk, monkeypatch):
    out = disk.path / "exp"
    _fill_after(monkeypatch, "mla_convert.writes.check_room", disk, 64 << 10)
    code, output = run("export", exportable, "-o", out, "--no-verify")
    assert_disk_full(code, output, out)
    assert sorted(p.name for p in disk.path.iterdir()) == [disk.filler.name]  # no OUT, no hidden part


def test_gguf_export_on_a_full_disk(exportable, disk):
    out = disk.path / "model.gguf"
    disk.fill(64 << 10)
    code, output = run("export", exportable, "-o", out, "--format", "gguf")
    assert_disk_full(code, output, out)
    assert sorted(p.name for p in disk.path.iterdir()) == [disk.filler.name]


@pytest.mark.parametrize("leave,save_every,where", [(0, 1, "metrics.jsonl"), (200 << 10, 1, ".step_1.incomplete"),
                                                    (300 << 10, 0, ".final.incomplete")])
def test_finetune_on_a_disk_that_fills(ws, student, disk, leave, save_every, where):
    """A full disk at the metrics, at step_1/, at final/: one line naming the run folder and the room, no step_N or
    final/ that looks complete, no part line in metrics.jsonl; with room again, the same command finishes."""
    out = disk.path / "run"
    out.mkdir()
    disk.fill(leave)
    code, output = run(*finetune_args(ws, student, out, f"save_every={save_every}"))
    assert_disk_full(code, output, out)
    assert where in output, output
    assert not (out / "final").exists()
    assert all((p / "trainer_state.json").is_file() for p in out.glob("step_*"))
    assert not [p.name for p in out.iterdir() if p.name.endswith(".incomplete")]
    if (out / "metrics.jsonl").exists():
        assert all(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    disk.unfill()
    code, output = run(*finetune_args(ws, student, out, f"save_every={save_every}", "resume=true"))
    assert code == 0, output
    assert (out / "final" / "provenance.json").is_file()


def test_eval_record_on_a_full_disk_changes_nothing(ws, student, disk):
    folder = disk.path / "model"
    shutil.copytree(student, folder)
    before = snapshot(folder)
    disk.fill(0)
    code, output = run("eval", folder, "--data", ws / "calib.txt", "--seq-len", "16", "--windows", "1", "--record")
    assert_disk_full(code, output, folder)
    assert snapshot(folder) == before
    disk.unfill()
    code, output = run("eval", folder, "--data", ws / "calib.txt", "--seq-len", "16", "--windows", "1", "--record")
    assert code == 0, output
    assert "perplexity" in json.loads((folder / "provenance.json").read_text())["measurements"]


def test_push_from_a_full_disk_changes_nothing(student, disk, monkeypatch):
    """push writes the refreshed card (and huggingface_hub's upload records) in the folder: on a full disk, one
    line, the folder as it was, nothing uploaded."""
    from hub_standin import HubStandIn
    from huggingface_hub import constants

    folder = disk.path / "model"
    shutil.copytree(student, folder)
    before = snapshot(folder)
    disk.fill(0)
    with HubStandIn(token="hf_StandInSecretToken0123456789abcdef") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_StandInSecretToken0123456789abcdef")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        code, output = run("push", folder, "tester/full-disk")
        assert_disk_full(code, output, folder)
        repo = hub.repos.get("tester/full-disk")
        assert repo is None or set(repo.files()) <= {".gitattributes"}
    assert snapshot(folder) == before


def test_self_text_cache_on_a_full_disk_is_a_warning_and_leaves_no_part(ws, disk, monkeypatch):
    """The self-text cache is a convenience: a full disk where it lives is one warning, the text is still used, and
    no part of a cache file is left behind."""
    from mla_convert.conversion import selftext

    monkeypatch.setenv("MLA_CONVERT_CACHE", str(disk.path / "cache"))
    disk.fill(0)
    selftext.write_cache(disk.path / "cache" / "texts.json", {"a": 1}, [{"tokens": [[1, 2, 3] * 5000]}])
    assert [p.name for p in disk.path.rglob("*") if p.is_file()] == [disk.filler.name]


def test_a_file_size_limit_is_one_line(exportable, tmp_path):
    """RLIMIT_FSIZE (ulimit -f): the write fails with EFBIG inside safetensors; one line, nothing left."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        code, output = run("export", exportable, "-o", tmp_path / "exp", "--no-verify")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert_user_error(code, output, "file-size limit", str(tmp_path / "exp"), "needs about")
    assert list(tmp_path.iterdir()) == []


def test_a_mount_point_is_a_valid_output(ws, exportable, disk):
    """An empty mount point (a real one): convert and export write into it in place; it is replaced only with
    --overwrite; a mount point holding a user's files is refused in one line."""
    from mla_convert.checkpoint import verify_checkpoint

    vol = disk.path
    code, output = run(*convert_args(ws, ws / "src", vol))
    assert code == 0, output
    verify_checkpoint(vol)
    assert not [p.name for p in vol.iterdir() if p.name.startswith(".")]
    code, output = run(*convert_args(ws, ws / "src", vol))
    assert_user_error(code, output, "--overwrite")
    code, output = run("export", exportable, "-o", vol, "--no-verify", "--overwrite")
    assert code == 0, output
    assert json.loads((vol / "provenance.json").read_text())["kind"] == "export"
    assert not [p.name for p in vol.iterdir() if p.name.startswith(".")]
    (vol / "notes.txt").write_text("mine")
    code, output = run("export", exportable, "-o", vol, "--no-verify", "--overwrite")
    assert_user_error(code, output, "notes.txt")
    assert (vol / "notes.txt").read_text() == "mine"


def test_a_mount_point_output_killed_while_moving_in_is_replaced(ws, tmp_path, monkeypatch):
    """A run that dies while the finished files move into a mount point leaves no complete-looking output; the next
    run (without --overwrite) replaces the part."""
    import os

    from mla_convert.checkpoint import verify_checkpoint

    vol = _mount_tmpfs(tmp_path / "vol")
    try:
        real, moved = os.replace, []

        def dies_on_the_third(src, dst, *args, **kwargs):
            if Path(dst).parent == vol:
                moved.append(dst)
                if len(moved) == 3:
                    raise OSError(errno.EIO, os_strerror(errno.EIO), str(dst))
            return real(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", dies_on_the_third)
        code, output = run(*convert_args(ws, ws / "src", vol))
        assert_user_error(code, output, "input/output error")
        monkeypatch.undo()
        with pytest.raises(Exception, match="not a complete checkpoint"):
            verify_checkpoint(vol)
        code, output = run(*convert_args(ws, ws / "src", vol))
        assert code == 0, output
        verify_checkpoint(vol)
        assert not [p.name for p in vol.iterdir() if p.name.startswith(".")]
    finally:
        import subprocess

        subprocess.run(["umount", "-l", str(vol)], capture_output=True, timeout=30)


def test_a_mount_point_on_a_disk_that_fills_keeps_its_guarantees(ws, disk, tmp_path, monkeypatch):
    """Written in place and out of room: one line, nothing in the mount point that looks like an output (only the
    hidden kept work), and the same command finishes once there is room. The mount point is a folder of the disk
    mounted again (a bind mount), so that the other program's file lies outside it."""
    import subprocess

    from mla_convert.checkpoint import verify_checkpoint

    (disk.path / "volume").mkdir()
    vol = tmp_path / "vol"
    vol.mkdir()
    done = subprocess.run(["mount", "--bind", str(disk.path / "volume"), str(vol)], capture_output=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.decode().strip()}")
    try:
        _full_mount_point_run(ws, disk, vol, monkeypatch)
        verify_checkpoint(vol)
    finally:
        subprocess.run(["umount", "-l", str(vol)], capture_output=True, timeout=30)


def _full_mount_point_run(ws: Path, disk: Disk, vol: Path, monkeypatch) -> None:
    _fill_after(monkeypatch, "mla_convert.conversion.pipeline.check_room", disk, 256 << 10)
    code, output = run(*convert_args(ws, ws / "src", vol))
    assert_disk_full(code, output, vol)
    assert sorted(p.name for p in vol.iterdir()) in ([], [".mla-convert-staging"])
    monkeypatch.undo()
    disk.unfill()
    code, output = run(*convert_args(ws, ws / "src", vol))
    assert code == 0, output
    assert not [p.name for p in vol.iterdir() if p.name.startswith(".")]


def test_eval_of_a_checkpoint_with_a_wrong_shaped_tensor_is_one_line(ws, tmp_path):
    def wider_key(state):
        name = "model.layers.0.self_attn.k_proj.weight"
        state[name] = torch.zeros(state[name].shape[0] + 4, state[name].shape[1])

    folder = variant(ws, "wrong-k-shape", edit_tensors=wider_key)
    code, output = run("eval", folder, "--data", ws / "calib.txt", "--seq-len", "16", "--windows", "1")
    assert_user_error(code, output, "model.layers.0.self_attn.k_proj.weight", "config.json")


def test_a_folder_whose_parent_is_not_writable_is_written_in_place(exportable):
    """A user's own empty folder in a folder they cannot write (root's): it cannot be renamed (EACCES), nor can a
    staging folder be made beside it, but it can be written into. Run as another user (nobody), since root may
    rename anything."""
    import os
    import shutil as sh
    import subprocess
    import sys
    import tempfile

    from mla_convert.checkpoint import verify_checkpoint

    if os.geteuid() != 0 or sh.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the command as another user")
    base = Path(tempfile.mkdtemp(prefix="mla-convert-parent-"))
    try:
        os.chmod(base, 0o755)
        shutil.copytree(exportable, base / "model")
        for sub in ("model", "home", "vol"):
            (base / sub).mkdir(exist_ok=True)
            for path in [base / sub, *(base / sub).rglob("*")]:
                os.chown(path, 65534, 65534)
        env = {**os.environ, "HOME": str(base / "home"), "HF_HOME": str(base / "home" / "hf"),
               "MLA_CONVERT_CACHE": str(base / "home" / "cache"), "MPLCONFIGDIR": str(base / "home" / "mpl"),
               "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "mla_convert.cli",
               "export", str(base / "model"), "-o", str(base / "vol"), "--no-verify"]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if "No module named" in done.stderr or "Permission denied: '" + str(Path(__file__).parent) in done.stderr:
            pytest.skip(f"the other user cannot run this checkout: {done.stderr.strip()[-200:]}")
        assert done.returncode == 0, done.stderr
        verify_checkpoint(base / "vol")
        assert sorted(p.name for p in base.iterdir()) == ["home", "model", "vol"]
        assert not [p.name for p in (base / "vol").iterdir() if p.name.startswith(".")]
    finally:
        shutil.rmtree(base, ignore_errors=True)
