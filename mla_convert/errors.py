"""User-facing errors.

A `UserError` is raised for anything the user can fix (bad option, missing file, unsupported model). Its message is
one line that names the fix. The CLI prints it as `error: <message>` and exits with status 2, without a traceback.
Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """An error caused by input the user can fix; the message names the fix."""


_OS_FIXES = {
    "ENOSPC": "the disk is full: free space there or choose a folder on another disk",
    "EDQUOT": "the disk quota is used up: free space there or choose a folder on another disk",
    "EROFS": "the file system is read-only: choose a folder you can write to",
    "EACCES": "permission denied: choose a folder you can write to (or fix its permissions)",
    "EPERM": "not permitted: choose a folder you can write to (or fix its permissions)",
    "EBUSY": "the path is busy (a mount point, or in use by another program): choose another folder",
    "EXDEV": "the path lies on another file system than its staging folder: choose a plain folder (not a mount point)",
    "ENOTDIR": "a part of the path is a file, not a folder: choose another path",
    "ELOOP": "the path goes through a symbolic link loop: choose a plain path",
    "ENAMETOOLONG": "the path is too long: choose a shorter one",
    "EMFILE": "too many open files: raise the limit (ulimit -n) and re-run",
    "EIO": "an input/output error of the device: check the disk and re-run",
    "EFBIG": "a file reached the file-size limit: raise it (ulimit -f) or choose a folder on another disk",
}


def as_os_error(err: BaseException) -> OSError | None:
    """`err` as an OSError: itself, or the one behind a safetensors write error (it reports the operating system's
    error only in its message, "... I/O error: No space left on device (os error 28)"); None for anything else."""
    import re

    if isinstance(err, OSError):
        return err
    found = re.search(r"(?:I/O error: )?([^:]*) \(os error (\d+)\)", str(err))
    if type(err).__name__ != "SafetensorError" or found is None:
        return None
    return OSError(int(found.group(2)), found.group(1).strip())


def is_environment_error(err: BaseException) -> bool:
    """An operating-system error that the place or the machine causes (a full disk, a read-only, busy or
    forbidden place, a device error), not a bug: these become one `error:` line (`os_error_line`)."""
    import errno as _errno

    err = as_os_error(err)
    return err is not None and _errno.errorcode.get(err.errno or 0, "") in _OS_FIXES


def os_error_line(err: OSError) -> str:
    """One line for an operating-system error (full disk, read-only or busy place, permissions): what failed, on
    which path, and the fix. Never a traceback: whatever was being written was staged, and a re-run resumes."""
    import errno as _errno

    err = as_os_error(err) or err
    name = _errno.errorcode.get(err.errno or 0, "")
    where = " -> ".join(str(p) for p in (err.filename, err.filename2) if p)
    what = err.strerror or str(err) or type(err).__name__
    fix = _OS_FIXES.get(name, "check the path and the disk, then re-run")
    return f"{what}{f' ({where})' if where else ''}: {fix}"


def out_of_memory_line(err: BaseException) -> str | None:
    """One line for running out of memory (Python's MemoryError, torch's CPU allocator, torch.OutOfMemoryError on a
    GPU); None for any other error."""
    if isinstance(err, MemoryError):
        detail = ""
    elif isinstance(err, RuntimeError) and (type(err).__name__ == "OutOfMemoryError"
                                            or "can't allocate memory" in str(err)):
        detail = f" ({(str(err).splitlines() or [''])[0][:160]})"
    else:
        return None
    return (f"out of memory{detail}: use a smaller batch, sequence length or model, or a machine (GPU) with more "
            "memory")


def one_line(err: BaseException) -> str | None:
    """The one `error:` line for a user error, an environment error (`os_error_line`) or running out of memory
    (`out_of_memory_line`); None for anything else (a bug, which keeps its traceback)."""
    if isinstance(err, UserError):
        return str(err)
    if is_environment_error(err):
        return os_error_line(err)
    return out_of_memory_line(err)
