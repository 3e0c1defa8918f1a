"""Hostile files, planted links and faults (issue 54): every case ends in one `error:` line and exit status 2 (or
runs, where the input is valid), with no traceback, nothing a user had changed, removed or uploaded, no output that
looks complete after a failure, and nothing unpickled."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error
from safetensors.torch import load_file
from hostile import CALIB, convert_args, finetune_args, os_strerror, run, snapshot, variant, _fail_on, _with_template


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
