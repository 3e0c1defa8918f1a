"""`mla-convert generate`: text, tokens per second, and a KV cache whose size is what the conversion plan promised."""

from __future__ import annotations

import json
import re

import pytest
from conftest import assert_user_error
from typer.testing import CliRunner

from mla_convert.cli import app

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def generated_text(*args) -> str:
    """stdout only (stderr holds progress bars), up to the summary."""
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout.split("\n---\n")[0]


def stats(output: str) -> dict:
    """The numbers of the two summary lines."""
    speed = re.search(r"prompt (\d+) tokens, generated (\d+) in [\d.]+ s = ([\d.]+) tokens/s", output)
    cache = re.search(r"KV cache: (\d+) bytes/token .*; (\d+) tokens cached(?: in a static cache of \d+ tokens)? = "
                      r"(\d+) bytes", output)
    assert speed and cache, output
    prompt, new, rate = int(speed[1]), int(speed[2]), float(speed[3])
    return dict(prompt=prompt, new=new, rate=rate, per_token=int(cache[1]), cached=int(cache[2]), total=int(cache[3]))


@pytest.fixture(scope="module")
def converted(sources, convert_tiny):
    return convert_tiny(sources["llama-gqa"], rank=8, rope_dims=4)


def plan_bytes(folder) -> dict:
    return json.loads((folder / "provenance.json").read_text())["kv_cache"]


def test_converted_model_cache_is_what_the_plan_says(converted):
    code, output = run("generate", converted, "--prompt", "w1 w2 w3 w1", "--max-new-tokens", 6)
    assert code == 0, output
    s = stats(output)
    assert s["rate"] > 0 and 1 <= s["new"] <= 6
    assert s["per_token"] == plan_bytes(converted)["bytes_per_token_after"] == 2 * (8 + 4) * 4  # 2 layers, float32
    # the last generated token is never fed back, so it is not cached
    assert s["cached"] == s["prompt"] + s["new"] - 1
    assert s["total"] == s["per_token"] * s["cached"]
    assert "(mla, float32, cpu)" in output


def test_static_cache_gives_the_same_text_and_holds_its_capacity(converted):
    args = ("generate", converted, "--prompt", "w1 w2 w3 w1", "--max-new-tokens", 6)
    assert generated_text(*args, "--cache", "static") == generated_text(*args)
    code, output = run(*args, "--cache", "static")
    assert code == 0, output
    s = stats(output)
    capacity = int(re.search(r"static cache of (\d+) tokens", output)[1])
    # sized for every token generate feeds back: the prompt and all but the last new token
    assert capacity == s["prompt"] + 6 - 1 and s["cached"] == s["prompt"] + s["new"] - 1
    assert s["total"] == s["per_token"] * capacity  # preallocated: latent + rope key for every row it can hold


def test_source_model_and_greedy_is_deterministic(sources, converted):
    code, output = run("generate", sources["llama-gqa"], "-p", "w5 w7", "-n", 4)
    assert code == 0, output
    assert stats(output)["per_token"] == plan_bytes(converted)["bytes_per_token_before"] == 2 * 2 * (2 * 16) * 4
    first = generated_text("generate", sources["llama-gqa"], "-p", "w5 w7", "-n", 4)
    assert first == generated_text("generate", sources["llama-gqa"], "-p", "w5 w7", "-n", 4)


def test_sampling_runs(converted):
    code, output = run("generate", converted, "-p", "w1", "-n", 3, "--sample", "--temperature", 0.8, "--seed", 1)
    assert code == 0, output
    assert stats(output)["new"] >= 1


def test_missing_model_folder(tmp_path):
    assert_user_error(*run("generate", tmp_path / "nope", "--prompt", "hi"), "does not exist")


@pytest.mark.parametrize(
    "extra,needle",
    [(["--chat"], "no chat template"), (["--temperature", "0.5"], "--sample"), (["-n", "0"], "--max-new-tokens"),
     (["--cache", "paged"], "--cache must be dynamic or static")],
)
def test_bad_options(converted, extra, needle):
    assert_user_error(*run("generate", converted, "--prompt", "w1", *extra), needle)
