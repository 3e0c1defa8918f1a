"""What the benchmark scripts share: a timed subprocess, the machine record, converting and scoring through the CLI.

    from benchmarks.common import harness            # the repository root on sys.path (each run.py puts it there)
    run = harness.timed(cmd, log=path)               # (code, wall_s, peak_rss bytes, output, command)
    conv = harness.convert(["llama", "--kv-budget", "0.25"], out)   # timed `mla-convert llama ... -o out`
    res = harness.score(out, text, 2048, 16)         # `mla-convert eval ... --json`: its result, timed
    row["machine"] = harness.machine()               # CPU, cores, threads, load, GPU, commit

`mla-convert` always runs as this checkout's code under the interpreter running the script (`python -c`, from the
repository root, with argv[0] `mla-convert`), so a conversion's provenance records the command a user would type.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
# `mla-convert ARGS` as this checkout's code: `python -c` puts the working directory (the root) first on sys.path.
LAUNCH = "import sys; sys.argv[0] = 'mla-convert'; from mla_convert.cli import app; sys.exit(app())"
# The environment of a run that must not reach the network (the benchmarks' models and texts are local).
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class Timed(NamedTuple):
    code: int  # exit status (0 unless check=False let a failure through)
    wall_s: float
    peak_rss: int  # bytes: the largest resident set of the process and its waited-for descendants (wait4)
    output: str  # stdout and stderr together
    command: str  # as a reader would type it (`mla-convert ...` for the CLI)


def mla(*args) -> list[str]:
    """The command line running `mla-convert ARGS` (see the module docstring)."""
    return [sys.executable, "-c", LAUNCH, *map(str, args)]


def shown(cmd: list[str]) -> str:
    """A command as a reader would type it: `mla-convert ...` for mla(...)'s."""
    cmd = [str(c) for c in cmd]
    if cmd[1:3] == ["-c", LAUNCH]:
        cmd = ["mla-convert", *cmd[3:]]
    return shlex.join(cmd)


def timed(cmd: list, log: Path | None = None, env: dict | None = None, cwd: Path = ROOT, threads: int | None = None,
          check: bool = True, echo: bool = False, tee: bool = False) -> Timed:
    """Run `cmd`, its output into `log` (when given) or kept in memory. `threads` sets OMP_NUM_THREADS. A failure
    raises SystemExit with the command and the end of its output unless check=False. `echo` prints the command first,
    `tee` the output as it comes (without a log)."""
    cmd = [str(c) for c in cmd]
    env = dict(os.environ if env is None else env)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    command = shown(cmd)
    if echo:
        print("$", command, flush=True)
    start = time.perf_counter()
    if log is not None:
        with Path(log).open("w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env)
            _, status, usage = os.wait4(proc.pid, 0)
        output = Path(log).read_text(errors="replace")
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, env=env, text=True,
                                errors="replace")  # fmt: skip
        parts = []
        for line in proc.stdout:
            parts.append(line)
            if tee:
                sys.stdout.write(line)
                sys.stdout.flush()
        proc.stdout.close()
        _, status, usage = os.wait4(proc.pid, 0)
        output = "".join(parts)
    wall = time.perf_counter() - start
    proc.returncode = code = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    if code and check:
        where = f" (log: {log})" if log is not None else ""
        raise SystemExit(f"failed ({code}): {command}{where}\n{output[-3000:]}")
    return Timed(code, wall, usage.ru_maxrss * 1024, output, command)


class Converted(NamedTuple):
    run: Timed
    provenance: dict | None  # the output's provenance.json (None when the conversion failed or wrote no folder)


def convert(args: list, out: Path | None, log: Path | None = None, env: dict | None = None,
            threads: int | None = None, check: bool = True, echo: bool = False, tee: bool = False) -> Converted:
    """`mla-convert ARGS -o OUT` (ARGS starts with the command: `llama`, `qwen`, `convert`), timed; with the output's
    provenance. out=None runs ARGS alone (a `--dry-run`)."""
    cmd = mla(*args, *(["-o", out] if out is not None else []))
    run = timed(cmd, log=log, env=env, threads=threads, check=check, echo=echo, tee=tee)
    prov = None
    if not run.code and out is not None and (Path(out) / "provenance.json").is_file():
        prov = json.loads((Path(out) / "provenance.json").read_text())
    return Converted(run, prov)


def score(folder: Path | str | None, text: Path | str, seq_len: int = 2048, windows: int = 16,
          engine: str = "transformers", json_out: Path | None = None, log: Path | None = None,
          env: dict | None = None, threads: int | None = None, extra: tuple = ()) -> dict:
    """`mla-convert eval [FOLDER] --data TEXT --seq-len --windows --json` (folder None: the embedded source), timed.
    Returns the eval JSON (perplexity, nll, kv_cache_bytes_per_token, ...) with `command`, `wall_s` and `peak_rss`
    (bytes). The JSON file is `json_out` when given (kept), else a temporary file. A failure raises SystemExit."""
    tmp = None if json_out is not None else Path(tempfile.mkdtemp(prefix="mla-eval-"))
    json_out = json_out if tmp is None else tmp / "eval.json"
    cmd = mla("eval", *([folder] if folder is not None else []), "--data", text, "--seq-len", seq_len,
              "--windows", windows, *(["--engine", engine] if engine != "transformers" else []),
              "--json", json_out, "--overwrite", "-q", *extra)  # fmt: skip
    try:
        run = timed(cmd, log=log, env=env, threads=threads)
        result = json.loads(Path(json_out).read_text())
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return {**result, "command": run.command, "wall_s": run.wall_s, "peak_rss": run.peak_rss}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def commit(full: bool = False) -> str:
    """The checkout's commit hash (short unless `full`); empty outside a git checkout."""
    return git("rev-parse", *([] if full else ["--short"]), "HEAD")


def dirty(prefixes: tuple[str, ...] = ()) -> list[str]:
    """Tracked files with uncommitted changes (those under `prefixes` when given)."""
    paths = [line[3:] for line in git("status", "--short", "--untracked-files=no").splitlines()]
    return [p for p in paths if not prefixes or p.startswith(prefixes)]


def machine() -> dict:
    """The record of where a measurement ran: CPU model and cores, torch and its threads, OMP_NUM_THREADS, the load
    averages at the call (1, 5, 15 minutes), the CUDA device (None without one), the commit and whether tracked files
    had uncommitted changes."""
    import torch

    return {"machine": platform.machine(), "cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "load_before": [round(x, 2) for x in os.getloadavg()],
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "commit": commit(), "dirty": bool(dirty())}  # fmt: skip


def describe(record: dict | str) -> str:
    """A machine record in one line ("CPU, N cores[, GPU]"); a string (older results files) as it is."""
    if isinstance(record, str):
        return record
    return f"{record['cpu']}, {record['cores']} cores" + (f", {record['cuda']}" if record.get("cuda") else "")


def append_jsonl(path: Path, row: dict) -> None:
    """One result row appended to a JSON-lines file."""
    with Path(path).open("a") as f:
        f.write(json.dumps(row) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (none when it does not exist)."""
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
