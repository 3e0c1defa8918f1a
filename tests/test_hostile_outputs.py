"""Hostile input, second part: exports, eval and generate on damaged folders, long lines, pipes and devices, NaN
weights, two fine-tunes at once, FIFOs in the folders read (issue 54's guarantees, as tests/test_hostile.py)."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error
from safetensors.torch import load_file, save_file
from hostile import CALIB, convert_args, finetune_args, os_strerror, run, snapshot, _fail_on, _with_template


# ------------------------------------------------------------------------------------------------ export, eval


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
