"""Bad input to every command: exit status 2, exactly one `error:` line that names the fix, no traceback, and nothing
the user had is changed (no file written, replaced or deleted in the workspace, no staging folder left behind).

Every case runs in one shared workspace; a snapshot of its files before and after each case must be equal."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from conftest import assert_user_error
from typer.testing import CliRunner

from mla_convert.cli import app


@pytest.fixture(scope="module")
def ws(tmp_path_factory, sources, convert_tiny, calib_text) -> Path:
    """A workspace: a source (src), one without tokenizer files (notok), a converted model (mla), one with an
    unreadable provenance.json (badprov), texts, a user's own folder (mine) and file, a garbage .gguf."""
    root = tmp_path_factory.mktemp("workspace")
    shutil.copytree(sources["llama-gqa"], root / "src")
    shutil.copytree(sources["llama-gqa"], root / "notok")
    for f in (root / "notok").iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt"):
            f.unlink()
    shutil.copytree(convert_tiny(sources["llama-gqa"], rank=8, rope_dims=8), root / "mla")
    shutil.copytree(root / "mla", root / "badprov")
    (root / "badprov" / "provenance.json").write_text("{not json")
    shutil.copy(calib_text, root / "calib.txt")
    (root / "empty.txt").write_text("")
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("my own notes")
    (root / "file.txt").write_text("a file")
    (root / "bad.gguf").write_bytes(b"GGUF but nothing after")
    (root / "here").mkdir()
    (root / "binary.txt").write_bytes(bytes(range(256)) * 64)  # not text
    shutil.copytree(sources["llama-gqa"], root / "noheads")
    config = json.loads((root / "noheads" / "config.json").read_text())
    del config["num_attention_heads"]  # transformers would fill in its default of 32
    (root / "noheads" / "config.json").write_text(json.dumps(config))
    (root / "runlike").mkdir()  # looks like a run folder (metrics.jsonl) but holds a file of the user's
    (root / "runlike" / "metrics.jsonl").write_text("")
    (root / "runlike" / "train.py").write_text("print('my script')")
    (root / "runfinal").mkdir()  # a finished run of ours whose final/ also holds a file of the user's
    (root / "runfinal" / "metrics.jsonl").write_text("")
    shutil.copytree(root / "mla", root / "runfinal" / "final")
    (root / "runfinal" / "final" / "MY_NOTES.md").write_text("my notes on this run")
    (root / "results.json").write_text('{"mine": true}\n')  # a JSON file of the user's
    (root / "latin1.jsonl").write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))  # not UTF-8
    (root / "latin1.yaml").write_bytes("finetune:\n  lr: 1.0e-4  # caf\u00e9\n".encode("latin-1"))
    shutil.copytree(root / "mla", root / "badcard")
    (root / "badcard" / "README.md").write_text("---\nfoo: [\n---\nmy card\n")  # front matter that YAML rejects
    (root / "badjson").mkdir()
    (root / "badjson" / "config.json").write_text("{oops")
    shutil.copytree(root / "mla", root / "truncated")
    shard = next((root / "truncated").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:4000])  # a copy that stopped half-way
    shutil.copytree(root / "src", root / "truncsrc")  # a source whose header is whole but whose data stops early
    shard = next((root / "truncsrc").glob("*.safetensors"))
    with safe_open(str(shard), framework="pt") as f:  # indexed: the shard is first read tensor by tensor
        index = {"weight_map": {name: shard.name for name in f.keys()}}
    (root / "truncsrc" / "model.safetensors.index.json").write_text(json.dumps(index))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return root


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder below `root`: files by content hash, folders as such."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


CALIB = ["--calib-data", "{ws}/calib.txt", "--calib-samples", "2", "--calib-seq-len", "16"]
FT = ["finetune", "--config", "smollm2-135m", "model={ws}/mla", "data={ws}/calib.txt", "kd_weight=0"]

CASES = {
    # ----------------------------------------------------------------------------------- convert / llama / qwen
    "convert without -o": (["llama", "{ws}/src", "--rank", "8", *CALIB], "-o OUT"),
    "convert missing model": (["llama", "{ws}/nope", "--rank", "8", "-o", "{ws}/out", *CALIB], "does not exist"),
    "convert a text file as model": (["llama", "{ws}/file.txt", "--rank", "8", "-o", "{ws}/out", *CALIB],
                                     "neither a model folder"),
    "convert a broken gguf": (["llama", "{ws}/bad.gguf", "--rank", "8", "-o", "{ws}/out", *CALIB], "cannot read GGUF"),
    "convert --rank not a number": (["llama", "{ws}/src", "--rank", "abc", "-o", "{ws}/out"], "--rank"),
    "convert --rank and --kv-budget": (["llama", "{ws}/src", "--rank", "8", "--kv-budget", "0.5", "-o", "{ws}/out",
                                        *CALIB], "not more"),
    "convert --kv-budget nan": (["llama", "{ws}/src", "--kv-budget", "nan", "-o", "{ws}/out", *CALIB],
                                "--kv-budget must be a positive"),
    "convert --kv-budget 0": (["llama", "{ws}/src", "--kv-budget", "0", "-o", "{ws}/out", *CALIB],
                              "--kv-budget must be a positive"),
    "convert --rope-dims 0": (["llama", "{ws}/src", "--rank", "8", "--rope-dims", "0", "--dry-run", *CALIB],
                              "at least 2"),
    "convert --nope-dims past head_dim": (["llama", "{ws}/src", "--rank", "8", "--nope-dims", "99", "--dry-run",
                                           *CALIB], "--nope-dims must be between 1 and head_dim"),
    "convert a config without num_attention_heads": (["llama", "{ws}/noheads", "--rank", "8", "-o", "{ws}/out",
                                                      *CALIB], "missing num_attention_heads"),
    "convert a .jsonl calibration file that is not UTF-8": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out",
                                                             "--calib-data", "{ws}/latin1.jsonl"], "not UTF-8"),
    "convert under a file": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/file.txt/sub", *CALIB], "which is a file"),
    "convert binary calibration file": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out", "--calib-data",
                                         "{ws}/binary.txt"], "not UTF-8 text"),
    "eval a truncated model": (["eval", "{ws}/truncated", "--data", "{ws}/calib.txt", "--seq-len", "16"],
                               "cannot load"),
    "generate a truncated model": (["generate", "{ws}/truncated", "--prompt", "w1 w2", "-n", "2"], "cannot load"),
    # no CUDA here: "this torch has no CUDA device"; with one: "only N CUDA device(s) exist"
    "convert --device cuda:99": (["llama", "{ws}/src", "--rank", "8", "--device", "cuda:99", "-o", "{ws}/out",
                                  *CALIB], "CUDA device"),
    "convert a truncated source": (["llama", "{ws}/truncsrc", "--rank", "8", "-o", "{ws}/out", *CALIB],
                                   "truncated or corrupt"),
    "convert --device tpu": (["llama", "{ws}/src", "--rank", "8", "--device", "tpu", "-o", "{ws}/out", *CALIB],
                             "use cpu, cuda or cuda:N"),
    "convert calibration text missing": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out", "--calib-data",
                                          "{ws}/nope.txt"], "does not exist"),
    "convert calibration text is a folder": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out", "--calib-data",
                                              "{ws}/mine"], "is a folder"),
    "convert calibration text empty": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out", "--calib-data",
                                        "{ws}/empty.txt"], "0 tokens"),
    "convert calibration text too short": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out", "--calib-data",
                                            "{ws}/calib.txt", "--calib-seq-len", "1000000"], "--calib-seq-len"),
    "convert calibration weight not positive": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out",
                                                 "--calib-data", "{ws}/calib.txt:0", "--calib-data", "self"],
                                                "positive numbers"),
    "convert calibration mixture part missing": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out",
                                                  "--calib-data", "self:0.5,{ws}/nope.txt:0.5"], "does not exist"),
    "convert calibration weight that is not a number": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out",
                                                          "--calib-data", "{ws}/calib.txt:abc"], "weight of"),
    "convert self with two weights": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out", "--calib-data",
                                       "self:2:3"], "self:WEIGHT"),
    "convert none in a mixture": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out", "--calib-data", "none,self"],
                                  "pass none alone"),
    "convert --calib-echo above a half": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out", *CALIB,
                                          "--calib-echo", "0.6"], "from 0 to 0.5"),
    "convert --calib-echo without calibration text": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out",
                                                       "--calib-data", "none", "--calib-echo", "0.25"],
                                                      "drop --calib-echo"),
    "convert --calib-seq-len 1": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out", "--calib-data",
                                   "{ws}/calib.txt", "--calib-seq-len", "1"], "at least 2"),
    "convert a mixture with an empty file": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out", "--calib-data",
                                              "{ws}/empty.txt,self", "--calib-samples", "2", "--calib-seq-len", "16"],
                                             "empty.txt has 0 tokens"),
    "convert calibration mixture empty part": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out",
                                                "--calib-data", "self,,{ws}/calib.txt"], "empty part"),
    "convert calibration mixture too few windows": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out",
                                                     "--calib-data", "{ws}/calib.txt:0.01,self:1", "--calib-samples",
                                                     "2", "--calib-seq-len", "16"], "raise --calib-samples"),
    "convert --calib-samples 0": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/out", *CALIB[:2],
                                   "--calib-samples", "0"], "positive"),
    "convert --revision on a local folder": (["llama", "{ws}/src", "--rank", "8", "--revision", "main", "-o",
                                              "{ws}/out", *CALIB], "--revision"),
    "convert source without tokenizer": (["llama", "{ws}/notok", "--rank", "8", "-o", "{ws}/out", *CALIB],
                                         "tokenizer"),
    "convert output inside the input": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/src/mla", *CALIB],
                                        "inside the input"),
    "convert output holds the input": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}", "--overwrite", *CALIB],
                                       "contains the input"),
    "convert output is the current directory": (["llama", "{ws}/src", "--rank", "8", "-o", ".", "--overwrite",
                                                 *CALIB], "current directory"),
    "convert output is the user's folder": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/mine", *CALIB],
                                            "--overwrite"),
    "convert --overwrite on the user's folder": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/mine",
                                                  "--overwrite", *CALIB], "not a folder mla-convert wrote"),
    "convert output is a file": (["llama", "{ws}/src", "--rank", "8", "-o", "{ws}/file.txt", "--overwrite", *CALIB],
                                 "existing file"),
    "convert qwen on a llama model": (["qwen", "{ws}/src", "--rank", "8", "-o", "{ws}/out", *CALIB], "llama"),
    "convert an MLA model": (["convert", "{ws}/mla", "--rank", "8", "-o", "{ws}/out", *CALIB], "already an MLA"),
    "convert --format gguf": (["convert", "{ws}/src", "--rank", "8", "--format", "gguf", "-o", "{ws}/out", *CALIB],
                              "--format"),
    "convert --dtype int8": (["convert", "{ws}/src", "--rank", "8", "--dtype", "int8", "-o", "{ws}/out", *CALIB],
                             "--dtype"),
    "convert unknown option": (["llama", "{ws}/src", "--frobnicate", "-o", "{ws}/out"], "No such option"),
    # ------------------------------------------------------------------------------------------------------ eval
    "eval without --data": (["eval", "{ws}/mla"], "--data"),
    "eval text missing": (["eval", "{ws}/mla", "--data", "{ws}/nope.txt"], "does not exist"),
    "eval --seq-len 1": (["eval", "{ws}/mla", "--data", "{ws}/calib.txt", "--seq-len", "1"], "at least 2"),
    "eval --windows 0": (["eval", "{ws}/mla", "--data", "{ws}/calib.txt", "--seq-len", "16", "--windows", "0"],
                         "--windows"),
    "eval --device gpu": (["eval", "{ws}/mla", "--data", "{ws}/calib.txt", "--device", "gpu"], "not a device"),
    "eval --dtype int8": (["eval", "{ws}/mla", "--data", "{ws}/calib.txt", "--dtype", "int8"], "--dtype"),
    "eval missing model": (["eval", "{ws}/nope", "--data", "{ws}/calib.txt"], "does not exist"),
    "eval --json is a folder": (["eval", "{ws}/mla", "--data", "{ws}/calib.txt", "--json", "{ws}/mine"],
                                "is a folder"),
    "eval --json over a user's file": (["eval", "{ws}/mla", "--data", "{ws}/calib.txt", "--json", "{ws}/results.json"],
                                       "already exists"),
    "eval --json --overwrite of a user's file": (["eval", "{ws}/mla", "--data", "{ws}/calib.txt", "--json",
                                                  "{ws}/results.json", "--overwrite"], "not a results file"),
    "eval --json under a file": (["eval", "{ws}/mla", "--data", "{ws}/calib.txt", "--json", "{ws}/file.txt/r.json"],
                                 "which is a file"),
    "eval a .jsonl that is not UTF-8": (["eval", "{ws}/mla", "--data", "{ws}/latin1.jsonl"], "not UTF-8"),
    "eval --record with a card YAML rejects": (["eval", "{ws}/badcard", "--data", "{ws}/calib.txt", "--seq-len", "16",
                                                "--windows", "1", "--record"], "not valid YAML"),
    "eval --record on a source folder": (["eval", "{ws}/src", "--data", "{ws}/calib.txt", "--record"], "drop --record"),
    "eval unreadable provenance": (["eval", "{ws}/badprov", "--data", "{ws}/calib.txt", "--seq-len", "16"],
                                   "provenance.json"),
    # ---------------------------------------------------------------------------------------------------- export
    "export missing model": (["export", "{ws}/nope", "-o", "{ws}/out"], "config.json"),
    "export a source model": (["export", "{ws}/src", "-o", "{ws}/out"], "native MLA checkpoint"),
    "export a broken config.json": (["export", "{ws}/badjson", "-o", "{ws}/out"], "cannot read"),
    "export under a file": (["export", "{ws}/mla", "-o", "{ws}/file.txt/sub"], "which is a file"),
    "export --format gguf": (["export", "{ws}/mla", "-o", "{ws}/out", "--format", "gguf"], "--format"),
    "export --dtype int8": (["export", "{ws}/mla", "-o", "{ws}/out", "--dtype", "int8"], "--dtype"),
    "export without -o": (["export", "{ws}/mla"], "--output"),
    # ------------------------------------------------------------------------------------------------------ push
    "push missing folder": (["push", "{ws}/nope", "me/model", "--dry-run"], "not a folder"),
    "push repo id without namespace": (["push", "{ws}/mla", "model", "--dry-run"], "namespace"),
    "push invalid repo id": (["push", "{ws}/mla", "me/a b", "--dry-run"], "repo id"),
    "push a folder without provenance": (["push", "{ws}/src", "me/model", "--dry-run"], "provenance"),
    "push without repo id": (["push", "{ws}/mla"], "repo_id"),
    "push a card YAML rejects": (["push", "{ws}/badcard", "me/model", "--dry-run"], "not valid YAML"),
    # -------------------------------------------------------------------------------------------------- finetune
    "finetune without --config": (["finetune"], "--config"),
    "finetune missing recipe": (["finetune", "--config", "{ws}/nope.yaml"], "not found"),
    "finetune setting of the wrong type": ([*FT, "output={ws}/run", "max_steps=abc"], "max_steps must be an integer"),
    "finetune negative lr": ([*FT, "output={ws}/run", "lr=-1"], "lr must be a positive"),
    "finetune kd_weight out of range": ([*FT, "output={ws}/run", "kd_weight=2"], "kd_weight"),
    "finetune unknown setting": ([*FT, "output={ws}/run", "learning_rate=1"], "unknown finetune setting"),
    "finetune override without =": ([*FT, "output={ws}/run", "max_steps"], "key=value"),
    "finetune missing student": ([*FT, "output={ws}/run", "model={ws}/nope"], "does not exist"),
    "finetune missing text": ([*FT, "output={ws}/run", "data={ws}/nope.txt"], "does not exist"),
    "finetune output is the user's folder": ([*FT, "output={ws}/mine"], "not a fine-tuning run folder"),
    "finetune overwrite of the user's folder": ([*FT, "output={ws}/mine", "overwrite=true"],
                                                "not a fine-tuning run folder"),
    "finetune output is a file": ([*FT, "output={ws}/file.txt"], "existing file"),
    "finetune output inside the student": ([*FT, "output={ws}/mla/run"], "inside the student"),
    "finetune overwrite of a run folder holding a user's file": ([*FT, "output={ws}/runlike", "overwrite=true"],
                                                                 "did not write"),
    "finetune overwrite of a run whose final/ holds a user's file": ([*FT, "output={ws}/runfinal", "overwrite=true"],
                                                                    "final/MY_NOTES.md"),
    "finetune override that is not YAML": ([*FT, "output={ws}/run", "lr=["], "not a YAML scalar"),
    "finetune recipe that is not UTF-8": (["finetune", "--config", "{ws}/latin1.yaml"], "UTF-8"),
    "finetune output holds the current directory": ([*FT, "output={ws}", "overwrite=true"], "current directory"),
    "finetune zero processes": ([*FT, "output={ws}/run", "-n", "0"], "--num-processes"),
    # -------------------------------------------------------------------------------------------------- generate
    "generate without --prompt": (["generate", "{ws}/mla"], "--prompt"),
    "generate empty prompt": (["generate", "{ws}/mla", "--prompt", ""], "empty"),
    "generate --max-new-tokens 0": (["generate", "{ws}/mla", "-p", "w1", "-n", "0"], "at least 1"),
    "generate --max-new-tokens abc": (["generate", "{ws}/mla", "-p", "w1", "-n", "abc"], "--max-new-tokens"),
    "generate --temperature without --sample": (["generate", "{ws}/mla", "-p", "w1", "--temperature", "0.5"],
                                                "--sample"),
    "generate --device gpu": (["generate", "{ws}/mla", "-p", "w1", "--device", "gpu"], "not a device"),
    "generate missing model": (["generate", "{ws}/nope", "-p", "w1"], "does not exist"),
    # ------------------------------------------------------------------------------------------------------- top
    "unknown command": (["frobnicate"], "No such command"),
}
if not torch.cuda.is_available():
    CASES["eval --device cuda without CUDA"] = (["eval", "{ws}/mla", "--data", "{ws}/calib.txt", "--device", "cuda"],
                                                "no CUDA")
    CASES["generate --device cuda without CUDA"] = (["generate", "{ws}/mla", "-p", "w1", "--device", "cuda"],
                                                    "no CUDA")


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_and_changes_nothing(ws, case, monkeypatch):
    args, needle = CASES[case]
    args = [a.replace("{ws}", str(ws)) for a in args]
    if case == "finetune output holds the current directory":
        monkeypatch.chdir(ws / "here")  # the workspace holds the current directory, the student and the text
    elif case == "convert output is the current directory":
        monkeypatch.chdir(ws / "mine")
    before = snapshot(ws)
    result = CliRunner().invoke(app, args)
    assert_user_error(result.exit_code, result.output, needle)
    assert snapshot(ws) == before, f"{case}: the workspace changed"


def test_cases_cover_every_command():
    commands = {args[0] for args, _ in CASES.values()}
    assert {"convert", "llama", "qwen", "eval", "export", "push", "finetune", "generate"} <= commands
    assert len(CASES) >= 40


def test_overwrite_replaces_a_folder_mla_convert_wrote(ws, tmp_path):
    """The other side of the refusals above: --overwrite does replace our own output, and nothing is left beside it."""
    out = tmp_path / "ours"
    args = ["llama", str(ws / "src"), "--rank", "8", *[a.replace("{ws}", str(ws)) for a in CALIB]]
    assert CliRunner().invoke(app, [*args, "-o", str(out)]).exit_code == 0
    first = json.loads((out / "provenance.json").read_text())["created"]
    (out / "notes.txt").write_text("left by hand")  # a user's file inside our folder: never deleted
    result = CliRunner().invoke(app, [*args, "--rope-dims", "4", "-o", str(out), "--overwrite"])
    assert_user_error(result.exit_code, result.output, "notes.txt", "did not write")
    assert (out / "notes.txt").read_text() == "left by hand"
    (out / "notes.txt").unlink()
    result = CliRunner().invoke(app, [*args, "--rope-dims", "4", "-o", str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["qk_rope_head_dim"] == 4
    assert json.loads((out / "provenance.json").read_text())["created"] >= first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours"]


def test_eval_warns_on_calibration_text(ws):
    """Perplexity on the text the model was calibrated on is flattering: eval says so (and still measures)."""
    record = json.loads((ws / "mla" / "provenance.json").read_text())
    calib = record["options"]["calib_data"]
    result = CliRunner().invoke(app, ["eval", str(ws / "mla"), "--data", calib, "--seq-len", "16", "--windows", "1"])
    assert result.exit_code == 0, result.output
    assert "warning:" in result.output and "calibrated on" in result.output
    held_out = ws / "here" / "other.txt"
    held_out.write_text("\n".join(f"w{i} w{i + 1} w{i + 2} w{i + 3}" for i in range(0, 100)))
    result = CliRunner().invoke(app, ["eval", str(ws / "mla"), "--data", str(held_out), "--seq-len", "16",
                                      "--windows", "1"])
    held_out.unlink()
    assert result.exit_code == 0, result.output
    assert "warning:" not in result.output


def test_trust_remote_code_is_never_taken(ws, tmp_path):
    """A source whose config and tokenizer point at custom code (auto_map) converts and evaluates with the stock
    classes: the custom module is never imported."""
    src = tmp_path / "remote"
    shutil.copytree(ws / "src", src)
    sentinel = tmp_path / "imported"
    (src / "evil.py").write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n")
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model"}
    (src / "config.json").write_text(json.dumps(config))
    tok = json.loads((src / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["evil.Tokenizer", None]}
    (src / "tokenizer_config.json").write_text(json.dumps(tok))
    calib = [a.replace("{ws}", str(ws)) for a in CALIB]
    result = CliRunner().invoke(app, ["llama", str(src), "--rank", "8", "-o", str(tmp_path / "out"), *calib])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["eval", str(src), "--data", str(ws / "calib.txt"), "--seq-len", "16",
                                      "--windows", "1"])
    assert result.exit_code == 0, result.output
    assert not sentinel.exists()


def test_full_disk_is_refused_before_any_work(ws, monkeypatch):
    """A file system without room for the checkpoint (and the layers kept for a resume): one line, nothing staged."""
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    before = snapshot(ws)
    args = ["llama", str(ws / "src"), "--rank", "8", "-o", str(ws / "out"),
            *[a.replace("{ws}", str(ws)) for a in CALIB]]
    result = CliRunner().invoke(app, args)
    assert_user_error(result.exit_code, result.output, "free", "choose another output folder")
    assert snapshot(ws) == before
