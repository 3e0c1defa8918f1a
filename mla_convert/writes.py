"""Writing files whole or not at all, and a full disk as one line.

`room_for(place, needed)` turns a full disk, a used-up quota or a file-size limit met inside its block (an OSError,
or the error safetensors raises for one) into a `UserError` that names the place and the room the step needs.
`save_tensors` writes a safetensors file and `write_text_whole` a text file; when the write fails, the partial file
is removed and the error is an OSError naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from mla_convert.errors import UserError, as_os_error

# what ran out, and the fix, by errno: a file-size limit shows as EFBIG (Python ignores SIGXFSZ)
_NO_ROOM = {
    errno.ENOSPC: ("the disk is full", "free space there and re-run, or choose a folder on another disk"),
    errno.EDQUOT: ("the disk quota is used up", "free space there and re-run, or choose a folder on another disk"),
    errno.EFBIG: ("a file reached the file-size limit", "raise the limit (ulimit -f) or choose a folder on another "
                  "disk, and re-run"),
}


def size_text(n: int) -> str:
    """`n` bytes for a person: GiB from 1 GiB up, MiB from 1 MiB up, else KiB."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{max(n, 1024) / 2**10:.0f} KiB"


def check_room(out: Path, needed: int, what: str = "the checkpoint") -> None:
    """Refuse, before any work, an output whose file system cannot take `needed` bytes (`what` they hold) or whose
    folder cannot be written."""
    parent = Path(out).expanduser().resolve()
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write under {parent} (permission denied): choose an output folder you can write to")
    free = shutil.disk_usage(parent).free
    if free < needed:
        raise UserError(f"{parent} has {size_text(free)} free, the output needs about {size_text(needed)} ({what}): "
                        "free space or choose another output folder")


def is_no_room(err: BaseException) -> bool:
    """Whether `err` is a full disk, a used-up quota or a file-size limit met (`room_for` words it)."""
    oserr = as_os_error(err)
    return oserr is not None and oserr.errno in _NO_ROOM


def no_room_line(err: BaseException, place: Path, needed: int | None, what: str = "the output") -> str | None:
    """One line for a full disk (or quota, or file-size limit) met while writing `place` (`what` writes there, e.g.
    "the conversion to"), naming the file when known and the room it needs (`needed` bytes); None for any other
    error."""
    if not is_no_room(err):
        return None
    oserr = as_os_error(err)
    cause, fix = _NO_ROOM[oserr.errno]
    file = f" ({oserr.strerror})" if oserr.strerror else ""
    file += f" writing {oserr.filename}" if oserr.filename else ""
    room = f"needs about {size_text(needed)} free on that disk" if needed else "needs more room on that disk"
    return f"{cause}{file}: {what} {place} {room}: {fix}"


@contextlib.contextmanager
def room_for(place: str | os.PathLike, needed: int | None, what: str = "the output"):
    """Run the block; a full disk, quota or file-size limit inside it becomes a `UserError` (`no_room_line`)."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        line = no_room_line(e, Path(place), needed, what)
        if line is None:
            raise
        raise UserError(line) from None


def _remove_partial(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_file() and not path.is_symlink():
            path.unlink()


def save_tensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """`safetensors.torch.save_file`, with a failed write's partial file removed and its error (safetensors reports an
    I/O error as its own exception) raised as an OSError naming `path`."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as e:
        oserr = as_os_error(e)
        _remove_partial(Path(path))
        if oserr is None:
            raise
        raise OSError(oserr.errno, oserr.strerror, str(oserr.filename or path)) from None


def short_write_cause(path: Path, err: OSError) -> OSError:
    """The operating system's error behind `err`, a short write reported without one (numpy's "6144 requested and
    1984 written"): one more byte at the end of `path` tells why (a full disk, a file-size limit). `err` itself when
    it has an errno or the byte goes in."""
    if err.errno is not None:
        return err
    try:
        with open(path, "ab", buffering=0) as f:
            f.write(b"\0")
    except OSError as e:
        return OSError(e.errno, e.strerror, str(path))
    return err


def write_text_whole(path: str | os.PathLike, text: str) -> None:
    """`text` at `path`, written under `path.tmp` and renamed into place: the file is the old one or the new one,
    never a part; a failed write leaves no temporary file behind."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        _remove_partial(tmp)
        raise
