"""The current code writes the bytes the REFERENCE commit writes: the conversion's output folders, its stdout, and the
`--dry-run` text, for the main job's options, `--target deepseek`, `--format deepseek` and a resumed conversion.

The reference package is taken from git (`git archive REFERENCE mla_convert`) into a temporary folder; both sides
run the CLI as a subprocess with the same environment (one thread, offline, a self-text cache of their own), the
reference with that folder first on PYTHONPATH, the current code with the repository's. Each pair runs at once, each
side in a run folder of its own (`-o out` relative to it); what legitimately differs between two runs is normalized
before comparing: ISO timestamps (provenance.json "created", the card's "# convert (...)" line), the run folder's path
(the card's load commands) and the model stage's wall-clock "seconds" in provenance.json.

The main job's options are `llama SRC --kv-budget 0.25 -o OUT` (data-free `--calib-data self`, refinement and model
stage on). On the tiny model with the default calibration (16 windows x 2048 tokens) that takes about 75 s per run
on one thread, almost all of it the refinement on 32k tokens; the case adds `--calib-samples 4 --calib-seq-len 32`
and nothing else (refinement steps, model stage, budget and every other option stay the defaults). The `--dry-run`
cases use the main job's options unchanged.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import needs_smollm2
from tiny import tiny_source, tiny_text

# The commit whose outputs the current code must reproduce (5d8e199: `--calib-echo`, a new option, which
# provenance.json and the card's options table list; every other byte as at c336f2d, checked by a diff of the two
# sides' folders for the main job: the one added line in each).
# Move it forward only to a change that means to change outputs (the next commit names it).
REFERENCE = "5d8e199a32382acc8826af88d13a1fbef1d00246"

ROOT = Path(__file__).resolve().parents[1]
THREADS = "1"  # the same on both sides: the thread count changes the order of float sums, so the bytes
TIMEOUT = 600

RUN_CLI = "import sys; sys.argv[0] = 'mla-convert'; from mla_convert.cli import app; app()"

# The CLI, killed (SIGKILL: no cleanup of any kind) once layer 1's file is written: at the first safetensors file
# written after it (in today's code the activations after layer 1; layer 1 is then sealed). save_file is wrapped
# before mla_convert is imported, so it holds wherever the package imports it from and whatever writes the layers.
KILLER = """
import os, signal, sys
import safetensors.torch as st
save, after_layer_1 = st.save_file, []
def save_file(tensors, filename, *args, **kwargs):
    if after_layer_1:
        os.kill(os.getpid(), signal.SIGKILL)
    save(tensors, filename, *args, **kwargs)
    if os.path.basename(str(filename)).startswith("layer-00001.safetensors"):
        after_layer_1.append(filename)
st.save_file = save_file
sys.argv[0] = "mla-convert"
from mla_convert.cli import app
app()
"""

MAIN = ["--kv-budget", "0.25"]  # the main job's options (the model: the default, or SRC)
SMALL_CALIBRATION = ["--calib-samples", "4", "--calib-seq-len", "32"]

# what legitimately differs between two runs (on bytes: every file is compared whole)
TIMESTAMP = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d\d:\d\d|Z)?")
SECONDS = re.compile(rb'("seconds": )[0-9.eE+-]+')


@dataclass
class Side:
    name: str  # "reference" or "current"
    pythonpath: Path
    cache: Path  # MLA_CONVERT_CACHE: each side samples its own self-text

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.pythonpath), "OMP_NUM_THREADS": THREADS,
                "MKL_NUM_THREADS": THREADS, "HF_HUB_OFFLINE": "1", "MLA_CONVERT_CACHE": str(self.cache),
                "TQDM_DISABLE": "1"}  # progress bars carry rates: not part of the text compared


@dataclass
class Run:
    folder: Path  # the run's working directory (its outputs are in it)
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def sides(tmp_path_factory) -> dict[str, Side]:
    found = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{REFERENCE}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        pytest.fail(f"the reference commit {REFERENCE} is not in the repository at {ROOT} (a shallow clone?): "
                    f"fetch it with `git fetch --unshallow` or `git fetch origin {REFERENCE}` "
                    f"({found.stderr.strip()})", pytrace=False)
    root = tmp_path_factory.mktemp("house")
    package = root / "reference-package"
    package.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", REFERENCE, "mla_convert"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(package)], input=archive, check=True)
    assert (package / "mla_convert" / "__init__.py").is_file()
    out = {}
    for name, path in (("reference", package), ("current", ROOT)):
        (root / f"cache-{name}").mkdir()
        out[name] = Side(name, path, root / f"cache-{name}")
    # each side imports its own package (PYTHONPATH before the editable install; `python -c` puts the working
    # directory first, so every run is started in a folder of its own)
    for side in out.values():
        where = subprocess.run([sys.executable, "-c", "import mla_convert; print(mla_convert.__file__)"], cwd=root,
                               env=side.env(), capture_output=True, text=True, check=True).stdout.strip()
        assert Path(where).resolve() == (side.pythonpath / "mla_convert" / "__init__.py").resolve(), where
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return tiny_source("llama-gqa", tmp_path_factory.mktemp("house-src") / "src", seed=3, num_hidden_layers=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("house-runs")


def start(side: Side, args: list[str], folder: Path, script: str = RUN_CLI) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=folder, env=side.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, folder: Path) -> Run:
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    return Run(folder, process.returncode, stdout, stderr)


def run(side: Side, args: list[str], folder: Path, script: str = RUN_CLI) -> Run:
    return finish(start(side, args, folder, script), folder)


def run_pair(sides: dict[str, Side], args: list[str], folder: Path) -> dict[str, Run]:
    """The same command on both sides at once (one thread each), each in `folder`/<side>; both must succeed."""
    started = {name: start(side, args, folder / name) for name, side in sides.items()}
    done = {name: finish(p, folder / name) for name, p in started.items()}
    for name, r in done.items():
        assert r.returncode == 0, f"{name}: mla-convert {' '.join(args)} exited {r.returncode}:\n{r.stderr[-3000:]}"
    return done


def normalized(data: bytes, folder: Path) -> bytes:
    data = data.replace(str(folder).encode(), b"<RUN>")
    data = TIMESTAMP.sub(b"<TIME>", data)
    return SECONDS.sub(rb"\1<SECONDS>", data)


def first_difference(a: bytes, b: bytes) -> str:
    try:
        lines_a, lines_b = a.decode().splitlines(), b.decode().splitlines()
    except UnicodeDecodeError:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"first differing byte at offset {at} of {len(a)} (reference) / {len(b)} (current) bytes"
    for n, (x, y) in enumerate(zip(lines_a, lines_b), 1):
        if x != y:
            return f"line {n}:\n    reference: {x!r}\n    current:   {y!r}"
    return f"{len(lines_a)} lines (reference) / {len(lines_b)} lines (current): one ends where the other goes on"


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink())


def assert_same_outputs(reference: Run, current: Run, skip: tuple[str, ...] = (), stdout: bool = True) -> None:
    """Every file under both run folders (the output folders, and anything left beside them; less `skip`) and the
    stdout, byte for byte after `normalized`."""
    names = [n for n in files(reference.folder) if n not in skip]
    assert names == [n for n in files(current.folder) if n not in skip], (
        f"different files: reference {names}, current {files(current.folder)}")
    assert names, "nothing written"
    differences = []
    for name in names:
        a = normalized((reference.folder / name).read_bytes(), reference.folder)
        b = normalized((current.folder / name).read_bytes(), current.folder)
        if a != b:
            differences.append(f"{name}: {first_difference(a, b)}")
    a, b = (normalized(r.stdout.encode(), r.folder) for r in (reference, current))
    if stdout and a != b:
        differences.append(f"stdout: {first_difference(a, b)}")
    assert not differences, "the current code's outputs differ from the reference's:\n" + "\n".join(differences)


@pytest.fixture(scope="module")
def main_job(sides, source, runs) -> dict[str, Run]:
    return run_pair(sides, ["llama", str(source), *MAIN, *SMALL_CALIBRATION, "-o", "out"], runs / "main")


def test_main_job_options(main_job):
    assert_same_outputs(main_job["reference"], main_job["current"])


def test_target_deepseek(sides, source, runs, tmp_path):
    """Calibrated on a text file (the other calibration path), with a short refinement and model stage."""
    text = tmp_path / "calib.txt"
    text.write_text(tiny_text(seed=1))
    done = run_pair(sides, ["llama", str(source), *MAIN, *SMALL_CALIBRATION, "--calib-data", str(text),
                            "--refine-steps", "20", "--refine-model-steps", "8", "--target", "deepseek", "-o", "out"],
                    runs / "target-deepseek")
    assert_same_outputs(done["reference"], done["current"])


def test_format_deepseek(sides, source, runs):
    """The verified DeepSeek-V3 export in OUT and the native checkpoint in OUT-native."""
    done = run_pair(sides, ["llama", str(source), *MAIN, *SMALL_CALIBRATION, "--refine-steps", "20",
                            "--refine-model-steps", "8", "--format", "deepseek", "-o", "out"], runs / "format-deepseek")
    assert sorted(p.name for p in done["current"].folder.iterdir()) == ["out", "out-native"]
    assert_same_outputs(done["reference"], done["current"])


def test_resumed_conversion(sides, source, runs, main_job):
    """The main job killed (SIGKILL) once layer 1 of 4 is written, then the same command, on both sides: the same
    model. The current code's resumed run writes every byte of the reference's uninterrupted run, the record of the
    run too (provenance.json and the card: the refinement and nope records of the layers the killed run converted
    are kept with them), where the reference's resumed run recorded only the layers it converted itself."""
    args = ["llama", str(source), *MAIN, *SMALL_CALIBRATION, "-o", "out"]
    folder = runs / "resumed"
    started = {name: start(side, args, folder / name, script=KILLER) for name, side in sides.items()}
    for name, process in started.items():
        killed = finish(process, folder / name)
        assert killed.returncode == -signal.SIGKILL, (
            f"{name}: the conversion was not killed after layer 1 (exit {killed.returncode}): does it still write "
            f"layer-00001.safetensors with safetensors.torch.save_file? (KILLER)\n{killed.stderr[-3000:]}")
        assert not (folder / name / "out").exists()
    resumed = run_pair(sides, args, folder)
    for name, r in resumed.items():
        assert "2 of 4 layers were converted already" in r.stderr, f"{name} did not resume:\n{r.stderr[-3000:]}"
    assert_same_outputs(resumed["reference"], resumed["current"], skip=("out/provenance.json", "out/README.md"))
    assert_same_outputs(main_job["reference"], resumed["current"], stdout=False)


def assert_same_text(done: dict[str, Run]) -> None:
    reference, current = done["reference"], done["current"]
    for stream in ("stdout", "stderr"):
        a, b = (normalized(getattr(r, stream).encode(), r.folder) for r in (reference, current))
        assert a == b, f"--dry-run {stream}: {first_difference(a, b)}"
    assert reference.stdout.strip() and not files(reference.folder) and not files(current.folder)


def test_dry_run_text(sides, source, runs):
    assert_same_text(run_pair(sides, ["llama", str(source), *MAIN, "--dry-run"], runs / "dry-run"))


@pytest.mark.slow
def test_dry_run_text_default_model(sides, runs):
    """The embedded SmolLM2-135M, as `mla-convert llama --kv-budget 0.25 --dry-run`."""
    needs_smollm2()
    assert_same_text(run_pair(sides, ["llama", *MAIN, "--dry-run"], runs / "dry-run-default"))
