"""Writing output folders safely, and checking a written one.

`check_output()` refuses an output a write must not touch (the current directory, an input, a user's own folder).
`staged_output()` builds the folder under a hidden sibling name and renames it into place only when complete, so a
failure never leaves a folder that looks finished; a resumable step keeps its finished work there, sealed with a
checksum (`seal_kept_file`, `kept_file_intact`). `ShardedWriter` writes shards under temporary names and the index
last. `verify_checkpoint()` checks that a folder holds a complete checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from mla_convert import provenance
from mla_convert.errors import UserError
from mla_convert.sources import AUX_FILES, INDEX_NAME, read_weight_map
from mla_convert.writes import save_tensors, write_text_whole

log = logging.getLogger(__name__)

SHARD_BYTES = 2 * 1024**3  # the shard writer's largest shard: what it holds in memory before writing one


def read_own_text(path: Path, limit: int = 64 << 20) -> str:
    """The text of `path`, a small file mla-convert wrote: a regular file of at most `limit` bytes, not read through a
    link. Anything else (a FIFO, which would block; a link to /dev/zero, which never ends) raises OSError."""
    import errno
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise OSError(errno.EINVAL, "not a small regular file", str(path))
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1).decode("utf-8")
    finally:
        os.close(fd)


def written_by_us(folder: Path) -> bool:
    """True when `folder` holds a `provenance.json` that mla-convert wrote (its marker of an output folder)."""
    try:
        record = json.loads(read_own_text(Path(folder) / "provenance.json"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "mla_convert_version" in record and "kind" in record


def nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (what writing `path` would create folders under)."""
    return next(p for p in (path, *path.parents) if p.exists())


def check_location(out: Path, inputs: list[tuple[str, Path]], example: str) -> Path:
    """`out` resolved, unless it is the current directory or holds it, lies under a file, or is, holds or lies inside
    one of the (label, path) inputs: then a UserError (`example` shows a good choice, e.g. "-o out/NAME")."""
    given = out
    out = Path(out).expanduser().resolve()
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise UserError(f"output {given} is the current directory or contains it: choose a new folder, e.g. {example}")
    blocking = nearest_existing(out.parent)
    if not blocking.is_dir():
        raise UserError(f"output {given} lies under {blocking}, which is a file, not a folder: choose another "
                        f"location, e.g. {example}")
    for label, src in inputs:
        src = Path(src).expanduser().resolve()
        if out == src or src in out.parents:
            raise UserError(f"output {given} is inside the {label} {src}: choose a folder outside it")
        if out in src.parents:
            raise UserError(f"output {given} contains the {label} {src}: choose a folder that does not hold it")
    return out


def check_output(out: Path, overwrite: bool, inputs: tuple[Path, ...] = (), marker=written_by_us) -> Path:
    """Refuse an output folder that a write (or --overwrite) must not touch; returns it resolved.

    Refused always: the current directory or a folder that contains it, a folder that is or holds an input, an
    output inside an input, an existing file. Refused without `overwrite`: a non-empty folder. Refused even with
    `overwrite`: a non-empty folder that `marker` does not recognise as one this tool wrote (so --overwrite never
    deletes a user's own files)."""
    given = out
    out = check_location(out, [("input", src) for src in inputs], "-o out/NAME")
    if out.exists() and not out.is_dir():
        raise UserError(f"output {given} is an existing file: choose a folder name")
    if out.is_dir() and _contents(out) and not _half_moved(out):
        if not overwrite:
            raise UserError(f"{given} already exists and is not empty: pass --overwrite or choose another -o")
        if not marker(out):
            raise UserError(f"{given} is not a folder mla-convert wrote (no provenance.json of ours), so --overwrite "
                            "will not delete it: remove it yourself or choose another -o")
        if marker is written_by_us:
            foreign = foreign_files(out)
            if foreign:
                shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
                raise UserError(f"{given} holds files mla-convert did not write ({shown}), so --overwrite will not "
                                "delete it: move them out or choose another -o")
    return out


# What a convert or export output folder holds besides the AUX_FILES it copies: nothing else is ours to delete.
OWN_FILES = ("config.json", "generation_config.json", "provenance.json", "README.md", "model.safetensors.index.json")
_SHARD = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")

# An output folder that cannot be renamed (a mount point) is written in place: its staging folders lie inside it,
# and while the finished files move in, a marker says so (a run killed then left a part, not an output).
IN_PLACE_STAGE = ".mla-convert-staging"
MOVING = ".mla-convert-moving"


def written_in_place(out: Path) -> bool:
    """Whether the output folder `out` is written in place: an existing folder that cannot be renamed, so that no
    finished folder can be moved onto it (a mount point, or a folder in a parent this process cannot write)."""
    out = Path(out)
    return (out.is_dir() and not out.is_symlink()
            and (os.path.ismount(out) or not os.access(out.parent, os.W_OK | os.X_OK)))


def _contents(out: Path) -> list[Path]:
    """The entries that make an output folder non-empty: in one written in place, not this tool's staging folders
    and marker there, nor the empty lost+found a file system keeps at its root."""
    entries = list(Path(out).iterdir())
    if not written_in_place(out):
        return entries
    return [p for p in entries if not (p.name.startswith(IN_PLACE_STAGE) or p.name == MOVING
                                       or (p.name == "lost+found" and p.is_dir() and not any(_quiet_iter(p))))]


def _quiet_iter(folder: Path):
    try:
        yield from folder.iterdir()
    except OSError:  # lost+found is readable only by its owner: then it is left alone and counts as empty
        return


def _half_moved(out: Path) -> bool:
    """An output written in place that a run killed while it moved the finished files in left behind: the marker,
    no provenance.json (moved last) and nothing but files of ours. The next run replaces it without --overwrite."""
    marker = Path(out) / MOVING
    return (marker.is_file() and not marker.is_symlink() and not (Path(out) / provenance.FILENAME).exists()
            and not foreign_files(out))


def foreign_files(folder: Path) -> list[str]:
    """Entries of an output folder that mla-convert does not write there (a user's notes, another tool's files)."""
    return sorted(p.name for p in _contents(folder)
                  if not (p.is_file() and not p.is_symlink()
                          and (p.name in OWN_FILES or p.name in AUX_FILES or _SHARD.fullmatch(p.name))))


RESUME_DIR = ".resume"  # inside a resumable staging folder: the run's fingerprint, its lock and the work kept


def resume_dir(stage: Path) -> Path:
    """Where a resumable step keeps its finished work inside `stage` (removed before the folder moves into place)."""
    return Path(stage) / RESUME_DIR


def _claim_resumable_stage(out: Path, stage: Path, fingerprint: dict):
    """The staging folder `stage` of `out`, locked for this process; its kept work is wiped unless it was written
    under the same `fingerprint`. Returns (stage, open lock file)."""
    import fcntl

    keep = resume_dir(stage)
    for path in (stage, keep):  # never followed through a link, never a file taken for a folder
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise UserError(f"the staging name {path} is taken by a {'link' if path.is_symlink() else 'file'} "
                            f"mla-convert did not make: move it away (it is not touched) or choose another -o")
        path.mkdir(exist_ok=True)
    try:  # O_NOFOLLOW: a link planted as the lock file is refused, its target never truncated
        lock = os.fdopen(os.open(keep / "lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644), "w")
    except OSError as e:
        raise UserError(f"cannot open the lock file {keep / 'lock'} ({e.strerror}): remove {stage} (a leftover of "
                        "mla-convert) and re-run") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UserError(f"another mla-convert is writing {out} (staging folder {stage}): wait for it to finish "
                        "or stop it, then re-run") from None
    state = keep / "fingerprint.json"
    wanted = json.loads(json.dumps(fingerprint))  # as it reads back from JSON (tuples become lists)
    try:
        kept = json.loads(read_own_text(state))
    except (OSError, ValueError):
        kept = None
    # Only the kept work in .resume/ may carry over: files a killed run was writing beside it go either way.
    leftovers = [c for c in stage.iterdir() if c.name != RESUME_DIR]
    if kept != wanted:  # other source, options, threads or version: nothing kept can be reused
        if isinstance(kept, dict) and any(p.name.endswith(".safetensors") for p in keep.iterdir()):
            changed = sorted(k for k in set(kept) | set(wanted) if kept.get(k) != wanted.get(k))
            log.warning("starting over in %s: its kept work was done with another %s", stage, ", ".join(changed))
        leftovers += [c for c in keep.iterdir() if c.name != "lock"]
    for child in leftovers:  # a link is removed itself, never what it points at
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    if kept != wanted:
        tmp = state.with_name(state.name + ".tmp")
        tmp.write_text(json.dumps(fingerprint, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, state)
    return stage, lock


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def seal_kept_file(tmp: Path, path: Path) -> None:
    """Move a finished file of kept work (`tmp`) to `path` and write its checksum beside it (`path.sha256`, last):
    `kept_file_intact` accepts it on a resume only while both agree."""
    digest = _sha256(tmp)
    os.replace(tmp, path)
    seal = path.with_name(path.name + ".sha256")
    seal_tmp = seal.with_name(seal.name + ".tmp")
    seal_tmp.write_text(digest + "\n")
    os.replace(seal_tmp, seal)


def kept_file_intact(path: Path) -> bool:
    """True when `path` (kept work, written by `seal_kept_file`) is a plain file whose bytes match its checksum. A
    damaged, unsealed or linked one is removed with a warning, so the work is done again."""
    seal = path.with_name(path.name + ".sha256")
    if not path.exists() and not path.is_symlink():
        return False
    try:
        intact = (not path.is_symlink() and path.is_file() and not seal.is_symlink()
                  and seal.read_text().strip() == _sha256(path))
    except OSError:
        intact = False
    if not intact:
        log.warning("%s is damaged or was not finished (its checksum does not match): doing that work again", path)
        for p in (path, seal):
            if p.is_symlink() or p.is_file():
                p.unlink()
    return intact


class _DirLock:
    """An exclusive advisory lock on a folder itself, held until `close()` or the end of the process."""

    def __init__(self, folder: Path):
        import fcntl

        self.fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _lock_dir(folder: Path) -> _DirLock:
    return _DirLock(folder)


def _remove_stale_stages(base: Path) -> None:
    """Remove the private staging folders (`BASE-XXXX`, e.g. `.NAME.incomplete-XXXX` beside the output) that a killed
    run left: real folders of that name whose lock no live process holds (links and files of that name are left
    alone)."""
    for stage in base.parent.glob(f"{glob_escape(base.name)}-*"):
        if stage.is_symlink() or not stage.is_dir():
            continue
        try:
            held = _DirLock(stage)
        except BlockingIOError:  # in use by a running conversion or export
            continue
        try:
            log.warning("removing %s, left by a run that was killed", stage)
            shutil.rmtree(stage)
        finally:
            held.close()


def glob_escape(name: str) -> str:
    """`name` as a glob pattern that matches only itself."""
    import re as _re

    return _re.sub(r"([*?\[])", r"[\1]", name)


@contextlib.contextmanager
def staged_output(out: Path, overwrite: bool, inputs: tuple[Path, ...] = (), fingerprint: dict | None = None):
    """Yield a hidden staging folder beside `out`; move it into place only if the block completes.
    `out` is checked by `check_output` first: an existing folder is replaced only if mla-convert wrote it. An empty
    folder that cannot be renamed (a mount point) is written in place: the staging folder lies inside it and the
    finished files move in, provenance.json last (`written_in_place`).

    Without `fingerprint` the staging folder is private to this call and removed on any failure. With one (a
    JSON-able record of everything the result depends on) it is `.NAME.incomplete`, locked while in use, and work the
    block keeps in `resume_dir(stage)` survives a failure or a kill: the next call with the same fingerprint gets the
    same folder back with that work in it (and with another fingerprint, an emptied one)."""
    out = check_output(out, overwrite, inputs)
    in_place = written_in_place(out)
    base = out / IN_PLACE_STAGE if in_place else out.parent / f".{out.name}.incomplete"
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = None
    if fingerprint is None:
        _remove_stale_stages(base)
        stage = Path(tempfile.mkdtemp(prefix=f"{base.name}-", dir=base.parent))
        lock = _lock_dir(stage)  # held while in use: a later run removes it only once this process is gone
    else:
        stage, lock = _claim_resumable_stage(out, base, fingerprint)
    try:
        yield stage
        check_output(out, overwrite, inputs)  # again: the folder may have changed during a long conversion
    except BaseException:
        kept = fingerprint is not None and any(p.name not in ("lock", "fingerprint.json")
                                               for p in resume_dir(stage).iterdir())
        if kept:
            log.warning("the finished part stays in %s: run the same command again to resume", stage)
        else:
            shutil.rmtree(stage, ignore_errors=True)
        if lock is not None:
            lock.close()
        raise
    for f in stage.iterdir():
        if f.is_file():
            os.chmod(f, 0o644)  # mkdtemp made the folder private; the files are readable like any output's
    if in_place:
        _move_in(stage, out)
    else:
        _move_onto(stage, out)
    lock.close()


def _move_onto(stage: Path, out: Path) -> None:
    """Rename the finished `stage` to `out` (an earlier output there is moved aside first, then removed: there is
    never a moment without one of them complete); then drop the kept work it carried."""
    os.chmod(stage, 0o755)
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
        os.replace(out, old / out.name)
        os.replace(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, out)
    # the kept work (and the lock file) go only now: the lock is held until the output is in place, so a second run
    # of the same command cannot claim the staging folder while this one moves it
    shutil.rmtree(out / RESUME_DIR, ignore_errors=True)


def _move_in(stage: Path, out: Path) -> None:
    """Move the finished files of `stage` into `out`, which cannot be renamed: under the MOVING marker, an earlier
    output's files (checked ours) go first, provenance.json comes last. A kill on the way leaves no complete-looking
    output, and the next run replaces the part."""
    fd = os.open(out / MOVING, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    os.close(fd)
    for old in _contents(out):
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    finished = sorted((p for p in stage.iterdir() if p.name != RESUME_DIR),
                      key=lambda p: (p.name == provenance.FILENAME, p.name))
    for path in finished:
        os.replace(path, out / path.name)
    os.unlink(out / MOVING)
    shutil.rmtree(stage, ignore_errors=True)  # the kept work and the lock file


class ShardedWriter:
    """Collect tensors into safetensors shards of at most `max_shard_bytes`; `finalize()` names them and writes the
    index last. Tensors are cast to `dtype` as they are added and freed once their shard is written."""

    def __init__(self, folder: Path, dtype: torch.dtype, max_shard_bytes: int = SHARD_BYTES):
        self.folder = Path(folder)
        self.dtype = dtype
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to(self.dtype).contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        tmp = f".shard-{len(self.shards):05d}.safetensors.tmp"
        save_tensors(self.pending, self.folder / tmp, metadata={"format": "pt"})
        self.shards.append((tmp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finalize(self) -> list[str]:
        """Rename shards to their final names and write the index; returns the shard file names."""
        self.flush()
        n = len(self.shards)
        weight_map, names = {}, []
        for i, (tmp, tensors) in enumerate(self.shards):
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / tmp, self.folder / name)
            names.append(name)
            weight_map.update({t: name for t in tensors})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_text_whole(self.folder / INDEX_NAME, json.dumps(index, indent=2) + "\n")
        return names


# ----------------------------------------------------------------------------------------------------------- verify

TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_SHARD_RE = re.compile(r"^model-\d+-of-\d+\.safetensors$")


def _safetensors_problem(path: Path) -> tuple[str | None, set[str]]:
    """(why the file is not a readable safetensors file or None, tensor names in its header)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return "truncated", set()
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 * 2**20):  # the format caps headers at 100 MB
                return "truncated or corrupt header", set()
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"unreadable ({e.__class__.__name__})", set()
    names = {k for k in header if k != "__metadata__"}
    end = max((header[k]["data_offsets"][1] for k in names), default=0)
    if 8 + n + end != size:
        return f"truncated ({size} of {8 + n + end} bytes)", names
    return None, names


def _check_config(folder: Path, missing: list[str], broken: list[str]) -> None:
    """Note a missing or unparsable config.json."""
    config = folder / "config.json"
    if not config.is_file():
        missing.append("config.json")
    else:
        try:
            json.loads(config.read_text())
        except ValueError:
            broken.append("config.json (not valid JSON)")


def _check_sharded_weights(folder: Path, index_path: Path, missing: list[str], broken: list[str]) -> tuple[list, int]:
    """Note the missing, broken or incomplete shards an index lists; returns (shard names, tensors listed)."""
    weights: list[str] = []
    tensors = 0
    try:
        weight_map = read_weight_map(index_path)
    except UserError:
        broken.append("model.safetensors.index.json (no weight_map of plain shard names beside it)")
        weight_map = {}
    by_shard: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(name)
    for shard, names in sorted(by_shard.items()):
        path = folder / shard
        if not path.is_file():
            missing.append(shard)
            continue
        problem, present = _safetensors_problem(path)
        if problem:
            broken.append(f"{shard} ({problem})")
        elif names - present:
            broken.append(f"{shard} (lacks {len(names - present)} tensors the index lists, e.g. "
                          f"{sorted(names - present)[0]})")
        weights.append(shard)
        tensors += len(names)
    return weights, tensors


def _check_weights(folder: Path, missing: list[str], broken: list[str]) -> tuple[list, int]:
    """Note missing or broken weights (an index and its shards, or one model.safetensors); returns (weight file
    names, tensor count)."""
    index_path = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index_path.is_file():
        return _check_sharded_weights(folder, index_path, missing, broken)
    if single.is_file():
        problem, present = _safetensors_problem(single)
        if problem:
            broken.append(f"model.safetensors ({problem})")
        return [single.name], len(present)
    shards = sorted(p.name for p in folder.glob("*.safetensors") if _SHARD_RE.match(p.name))
    if shards:
        missing.append(f"model.safetensors.index.json (found {len(shards)} shards without an index: the write "
                       "did not finish)")
    else:
        missing.append("model.safetensors or model.safetensors.index.json")
    return [], 0


def _check_tokenizer_and_provenance(folder: Path, missing: list[str], broken: list[str]) -> None:
    """Note a missing tokenizer config or vocabulary, and a missing or unreadable provenance.json."""
    if not (folder / "tokenizer_config.json").is_file():
        missing.append("tokenizer_config.json")
    if not any((folder / name).is_file() for name in TOKENIZER_VOCAB_FILES):
        missing.append("a tokenizer vocabulary (" + " or ".join(TOKENIZER_VOCAB_FILES[:2]) + ")")
    if not (folder / provenance.FILENAME).is_file():
        missing.append(provenance.FILENAME)
    else:
        try:
            if "kind" not in json.loads((folder / provenance.FILENAME).read_text()):
                broken.append(f"{provenance.FILENAME} (no kind)")
        except ValueError:
            broken.append(f"{provenance.FILENAME} (not valid JSON)")


def verify_checkpoint(folder: str | os.PathLike) -> dict:
    """Check that `folder` holds a complete checkpoint; returns {"weights": [...], "tensors": int}.

    Needs: config.json (valid JSON), the weights as model.safetensors or model.safetensors.index.json plus every shard
    it lists (each shard's header readable, the file not truncated, every tensor the index maps to it present),
    tokenizer_config.json and a vocabulary file (tokenizer.json, tokenizer.model, ...), and provenance.json. Raises
    `UserError` naming everything that is missing or broken.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder: give the output folder of convert, finetune or export")
    missing: list[str] = []
    broken: list[str] = []
    _check_config(folder, missing, broken)
    weights, tensors = _check_weights(folder, missing, broken)
    _check_tokenizer_and_provenance(folder, missing, broken)
    if missing or broken:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"broken {', '.join(broken)}"] if broken
                                                                           else [])
        raise UserError(f"{folder} is not a complete checkpoint: {'; '.join(parts)}; re-run the step that wrote it")
    return {"weights": weights, "tensors": tensors}
