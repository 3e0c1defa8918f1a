"""Hostile input, third part: a disk that fills while a command writes, a file-size limit, a mount point as the output
(issue 84), on a real tmpfs where this machine mounts one (as tests/test_hostile.py)."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error
from hostile import convert_args, finetune_args, os_strerror, run, snapshot, variant


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
