"""Publishing: model cards from real conversions of tiny models (convert, export, finetune, `eval --record`, a user's
edits kept on re-render) and `mla-convert push` against a local stand-in of the Hub's HTTP endpoints (tests/hub_standin.py),
reached through huggingface_hub with HF_ENDPOINT pointing at it. Offline: nothing leaves 127.0.0.1."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hub_standin import HubStandIn
from mla_convert import card as model_card
from mla_convert import provenance
from mla_convert.checkpoint import verify_checkpoint
from mla_convert.cli import app

# A token that looks real enough to be worth leaking: no output may contain it.
SECRET = "hf_StandInSecretToken0123456789abcdef"
SOURCE_LICENSE = "apache-2.0"

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def one_error_line(code, output, *needles) -> str:
    """Exit 2, no traceback, exactly one `error:` line containing every needle, and never the token."""
    assert code == 2, output
    assert "Traceback" not in output and SECRET not in output
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def card_of(folder: Path):
    from huggingface_hub import ModelCard

    return ModelCard.load(folder / "README.md")


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def generated_block(text: str) -> str:
    start, end = text.index(model_card.BEGIN_MARKER), text.index(model_card.END_MARKER)
    return text[start:end]


# ------------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def licensed_source(sources, tmp_path_factory) -> Path:
    """The tiny GQA Llama with a Hub-style README whose front matter names a license."""
    src = tmp_path_factory.mktemp("licensed") / "tiny-llama"
    shutil.copytree(sources["llama-gqa"], src)
    (src / "README.md").write_text(f"---\nlicense: {SOURCE_LICENSE}\n---\n\n# tiny llama\n")
    return src


@pytest.fixture(scope="module")
def converted(licensed_source, convert_tiny) -> Path:
    """A native MLA conversion (rank 8; uniform RoPE pairs so that it exports exactly). Tests copy it before changing
    anything in it."""
    return convert_tiny(licensed_source, rank=8, rope_strategy="uniform")


@pytest.fixture
def model(converted, tmp_path) -> Path:
    """A private copy of the converted folder."""
    return Path(shutil.copytree(converted, tmp_path / "tiny-llama-mla"))


@pytest.fixture
def server(monkeypatch, tmp_path):
    """The stand-in Hub, with huggingface_hub pointed at it by HF_ENDPOINT, online even under HF_HUB_OFFLINE=1
    (scripts/test.sh sets it), the token in HF_TOKEN and no stored login."""
    from huggingface_hub import constants

    with HubStandIn(token=SECRET) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        monkeypatch.setenv("HF_TOKEN", SECRET)
        for name in ("HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
        yield hub_server


# ---------------------------------------------------------------------------------------------------------- cards


def test_card_reads_the_rope_dims_key_of_older_folders():
    """provenance.json's plan names d_r `rope_dims`; folders written before issue 18 name it `rope_dim`."""
    from mla_convert.card import _settings_section

    for key in ("rope_dims", "rope_dim"):
        text = "\n".join(_settings_section([{"kind": "convert", "plan": {"ranks": [8, 12], key: 16}}]))
        assert "Latent dims per layer (d_c): 8..12 (mean 10.0); shared RoPE key dims (d_r): 16." in text


def test_convert_card_names_method_budget_and_cache(converted, licensed_source):
    record = provenance.load(converted)
    kv = record["kv_cache"]
    card = card_of(converted)
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"mla", "mla-convert"} <= set(data["tags"]) and data["license"] == SOURCE_LICENSE
    assert "base_model" not in data  # a local source folder is no Hub id

    text = card.text
    assert f"`{licensed_source}` (llama)" in text and "Steps: conversion." in text
    assert f"**Conversion**: {record['method']}" in text  # the method
    assert "Latent dims per layer (d_c): 8; shared RoPE key dims (d_r): 8; nope query/key dims per head (d_n): 8." in text
    assert "| `rank` | 8 |" in text and "| `rope_strategy` | uniform |" in text
    assert kv["bytes_per_token_before"] == 512 and kv["bytes_per_token_after"] == 128
    assert "| source | 64 | 512 |" in text and "| this model | 16 | 128 |" in text
    assert "Ratio after/before: 0.2500" in text and "4.00x smaller" in text
    # how to load it, from where it lives (not the hidden staging folder the card was written in)
    assert ".incomplete" not in card.content
    assert f"# {converted.name}\n" in text
    assert "import mla_convert" in text and f'AutoModelForCausalLM.from_pretrained("{converted}"' in text
    assert f"torch {record['versions']['torch']}" in text and f"transformers {record['versions']['transformers']}" in text
    assert record["command"] in text and "### Reproduce" in text
    assert "### Measured quality" not in text  # nothing measured yet


def test_qwen_kv_budget_card(sources, convert_tiny):
    out = convert_tiny(sources["qwen2"], kv_budget=0.5)
    kv = provenance.load(out)["kv_cache"]
    text = card_of(out).text
    assert "**Conversion**: " in text and "| `kv_budget` | 0.5 |" in text and "(qwen) with its attention" in text
    assert f"| source | 64 | {kv['bytes_per_token_before']} |" in text
    assert f"| this model | {kv['elements_per_token_per_layer_after']:g} | {kv['bytes_per_token_after']} |" in text
    assert f"Ratio after/before: {kv['bytes_per_token_after'] / kv['bytes_per_token_before']:.4f}" in text


def test_eval_record_puts_perplexity_in_card(model, calib_text):
    code, output = run("eval", model, "--data", calib_text, "--seq-len", 16, "--windows", 2, "--record", "-q")
    assert code == 0, output
    ppl = float(re.search(r"perplexity ([0-9.]+)", output).group(1))
    assert provenance.load(model)["measurements"]["perplexity"]["converted"] == pytest.approx(ppl, abs=5e-4)
    text = card_of(model).text
    assert "### Measured quality" in text
    assert f"| converted (no training) | {ppl:.3f} | {calib_text}, 2 x 16 windows, float32 |" in text


def test_rerender_keeps_what_the_user_wrote(model):
    path = model / "README.md"
    content = path.read_text()
    front, body = content.split("\n---\n", 1)
    block = generated_block(body)
    body = body.replace(block, block.replace("## About this model", "## About this model\n\nEDITED INSIDE THE BLOCK"))
    marker = model_card.BEGIN_MARKER
    body = body.replace(marker, "# My MLA model\n\nWritten by hand above.\n\n" + marker)
    body += "\n## Citation\n\nWritten by hand below.\n"
    front = front.replace("tags:\n", "language: en\ntags:\n- custom\n").replace(f"license: {SOURCE_LICENSE}", "license: mit")
    path.write_text(front + "\n---\n" + body)

    model_card.write_model_card(model, repo_id="tester/tiny-llama-mla")
    card = card_of(model)
    data = card.data.to_dict()
    assert data["language"] == "en" and data["license"] == "mit"  # a user's keys win over ours
    assert data["tags"].count("mla") == 1 and {"custom", "mla-convert"} <= set(data["tags"])
    text = card.text
    assert "Written by hand above." in text and "## Citation\n\nWritten by hand below." in text
    assert "EDITED INSIDE THE BLOCK" not in text
    assert text.count(model_card.BEGIN_MARKER) == 1 and text.count(model_card.END_MARKER) == 1
    titles = re.findall(r"^# .*", model_card._FENCE_RE.sub("", text), re.M)
    assert titles == ["# My MLA model"]  # the user's title, no second one from us
    assert 'from_pretrained("tester/tiny-llama-mla"' in text
    again = path.read_text()
    model_card.write_model_card(model, repo_id="tester/tiny-llama-mla")
    assert path.read_text() == again  # re-rendering is stable


def test_base_model_from_a_hub_source(model):
    record = provenance.load(model)
    record["source"]["base_model"] = "tester/tiny-llama"
    provenance.save(model, record)
    model_card.write_model_card(model)
    card = card_of(model)
    assert card.data.base_model == "tester/tiny-llama"
    assert "[`tester/tiny-llama`](https://huggingface.co/tester/tiny-llama)" in card.text
    # a source read from the Hub cache names its repo too
    cached = "/home/u/.cache/huggingface/hub/models--org-a--Model-1B/snapshots/0123abc"
    assert model_card._base_model({"model": cached}) == "org-a/Model-1B"


def test_export_card_loads_with_stock_classes(converted, tmp_path):
    from mla_convert.export import ExportOptions, export

    out = tmp_path / "tiny-llama-deepseek"
    export(converted, out, ExportOptions(dtype="float32", verify=False))
    card = card_of(out)
    assert card.data.license == SOURCE_LICENSE and {"mla", "mla-convert"} <= set(card.data.tags)
    text = card.text
    assert "Steps: conversion -> export." in text and "**Export**: DeepSeek-V3 export" in text
    assert "| source | 64 | 512 |" in text and "| native MLA (before export) | 16 | 128 |" in text
    assert "| this model | 16 | 128 |" in text and "Ratio after/before: 0.2500" in text
    assert "DeepseekV3ForCausalLM" in text and f"vllm serve {out}" in text and "import mla_convert" not in text
    assert ".incomplete" not in card.content and f"# {out.name}\n" in text


def test_finetune_card_has_the_training_numbers(converted, calib_text, tmp_path):
    import yaml
    from accelerate.state import AcceleratorState

    from mla_convert import finetune

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"finetune": {
        "model": str(converted), "data": str(calib_text), "output": str(tmp_path / "ft"), "seq_len": 16,
        "batch_size": 2, "grad_accum": 1, "max_steps": 2, "lr": 3e-3, "warmup": 1, "eval_windows": 2,
        "eval_every": 100, "log_every": 1, "threads": 1, "kd_weight": 0, "teacher": "none",
    }}))  # fmt: skip
    try:
        final = finetune.run(finetune.load_config(str(recipe), []))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    m = provenance.load(final)["measurements"]["finetune"]
    text = card_of(final).text
    assert "Steps: conversion -> fine-tuning." in text and "**Fine-tuning**: fine-tune (LM" in text
    protocol = m["held_out_protocol"]
    assert f"| before fine-tuning (held out) | {m['held_out_perplexity_before']:.3f} | {protocol} |" in text
    assert f"| fine-tuned (held out) | {m['held_out_perplexity_after']:.3f} | {protocol} |" in text
    assert "optimizer steps 2" in text and f"training tokens {m['tokens']}" in text
    assert "| source | 64 | 512 |" in text and "| this model | 16 | 128 |" in text
    assert "# ft\n" in text and verify_checkpoint(final)["tensors"] > 0


# ----------------------------------------------------------------------------------------------------------- push


def test_push_uploads_the_folder_byte_for_byte(model, server):
    code, output = run("push", model, "tester/tiny-llama-mla", "--commit-message", "First MLA upload")
    assert code == 0, output
    assert SECRET not in output
    repo = server.repos["tester/tiny-llama-mla"]
    assert not repo.private
    uploaded = repo.files()
    assert uploaded.pop(".gitattributes")  # the Hub's own first commit
    assert uploaded == folder_files(model)  # everything, byte-equal, nothing else (no upload state left behind)
    assert 'from_pretrained("tester/tiny-llama-mla"' in uploaded["README.md"].decode()
    commit = repo.commits[-1]
    assert commit.summary == "First MLA upload" and commit.branch == "main"
    assert sorted(commit.added) == sorted(uploaded)
    assert f"pushed {len(uploaded)} files" in output and "(created, branch main)" in output and commit.oid in output

    # a user edit, pushed to a new branch with the default message: main keeps the first upload
    (model / "README.md").write_text((model / "README.md").read_text() + "\nMore notes.\n")
    code, output = run("push", model, "tester/tiny-llama-mla", "--revision", "dev")
    assert code == 0, output
    assert "(updated, branch dev)" in output
    last = repo.commits[-1]
    assert last.branch == "dev" and last.summary == "Upload MLA model (convert) with mla-convert"
    assert last.added == ["README.md"]  # unchanged files are not sent again
    assert repo.files("dev")["README.md"].endswith(b"More notes.\n")
    assert not repo.files("main")["README.md"].endswith(b"More notes.\n")


def test_push_leaves_hidden_files_out(model, server):
    """A user's secrets and tool state inside the folder (hidden files, hidden folders at any depth) never reach the
    Hub, in the dry run's list or in the upload, and the push names what it left out."""
    (model / ".env").write_text(f"HF_TOKEN={SECRET}\n")
    (model / ".ipynb_checkpoints").mkdir()
    (model / ".ipynb_checkpoints" / "notes.txt").write_text("draft\n")
    (model / "extra").mkdir()
    (model / "extra" / ".DS_Store").write_bytes(b"\0")
    (model / "extra" / "notes.md").write_text("kept\n")
    code, output = run("push", model, "tester/tiny-llama-mla", "--dry-run")
    assert code == 0, output
    listed = [line.split()[0] for line in output.splitlines() if line.startswith("  ")]
    assert "extra/notes.md" not in listed and not [p for p in listed if "/." in "/" + p]
    assert "not pushed (hidden): .env, .ipynb_checkpoints/, extra/.DS_Store" in output
    assert "not pushed (not written by mla-convert): extra/notes.md" in output  # a user's visible file stays too
    code, output = run("push", model, "tester/tiny-llama-mla")
    assert code == 0, output
    uploaded = server.repos["tester/tiny-llama-mla"].files()
    assert "extra/notes.md" not in uploaded
    assert sorted(p for p in uploaded if "/." in "/" + p) == [".gitattributes"]  # the Hub's own
    assert not any(SECRET.encode() in data for data in uploaded.values())
    assert "not pushed (hidden): .env, .ipynb_checkpoints/, extra/.DS_Store" in output


def test_push_uploads_only_its_own_files_never_links_or_tokens(model, server, tmp_path):
    """Only the files mla-convert writes go up: a visible link to the token file and a plain token file beside the
    model stay out (named); a link or a token in one of its own files refuses the whole push in one line."""
    token = "hf_" + "Q" * 34
    token_file = tmp_path / "hf-home-token"
    token_file.write_text(token + "\n")
    (model / "notes.txt").symlink_to(token_file)  # looks like a note, is the Hub token
    (model / "hf_token.txt").write_text(token + "\n")
    code, output = run("push", model, "tester/tiny-llama-mla")
    assert code == 0, output
    assert "not pushed (not written by mla-convert): hf_token.txt, notes.txt" in output
    uploaded = server.repos["tester/tiny-llama-mla"].files()
    assert "notes.txt" not in uploaded and "hf_token.txt" not in uploaded
    assert not any(token.encode() in data for data in uploaded.values())

    commits = len(server.repos["tester/tiny-llama-mla"].commits)
    (model / "generation_config.json").unlink()
    (model / "generation_config.json").symlink_to(token_file)
    one_error_line(*run("push", model, "tester/tiny-llama-mla"), "generation_config.json", "symbolic link")
    one_error_line(*run("push", model, "tester/tiny-llama-mla", "--dry-run"), "symbolic link")
    (model / "generation_config.json").unlink()
    (model / "generation_config.json").write_text("{}\n")
    with open(model / "README.md", "a") as f:
        f.write(f"\nmy token: {token}\n")
    code, output = run("push", model, "tester/tiny-llama-mla")
    one_error_line(code, output, "README.md", "access token")
    assert token not in output
    assert len(server.repos["tester/tiny-llama-mla"].commits) == commits  # nothing more was uploaded
    assert token_file.read_text() == token + "\n"


def test_push_private_with_the_stored_login(model, server, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN")
    Path(constants.HF_TOKEN_PATH).parent.mkdir(parents=True)
    Path(constants.HF_TOKEN_PATH).write_text(SECRET)
    code, output = run("push", model, "test-org/tiny-private", "--private", "-vv")  # debug logs too
    assert code == 0, output
    assert SECRET not in output
    assert server.repos["test-org/tiny-private"].private


def test_push_dry_run_lists_files_and_uploads_nothing(model, server, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")  # a dry run needs no token
    before = folder_files(model)
    code, output = run("push", model, "tester/tiny-llama-mla", "--dry-run")
    assert code == 0, output
    assert f"would push {len(before)} files" in output and "nothing uploaded" in output
    listed = [line.split()[0] for line in output.splitlines() if line.startswith("  ")]
    assert listed == sorted(before)
    assert server.requests == [] and server.repos == {}
    assert folder_files(model) == before  # the card is not rewritten either


def test_large_files_go_through_lfs_and_a_rerun_resumes(model, server, monkeypatch):
    """Without hf_xet: files over the stand-in's LFS threshold are uploaded with the LFS batch API before the commit.
    A push whose commit fails leaves the uploaded objects on the Hub; the re-run commits without sending them again."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    server.lfs_min_size = 8192
    # the card is rewritten with the repo id just before the upload (its local paths go): sized by what is sent
    large = {path for path, data in folder_files(model).items() if len(data) >= 8192 and path != "README.md"}
    assert "model.safetensors" in large and "tokenizer.json" in large
    server.fail("commit", 400)
    one_error_line(*run("push", model, "tester/tiny-lfs"), "400", "while uploading", "re-run")
    puts = server.count("PUT", "/lfs-upload/")
    assert puts == len(large) and len(server.repos["tester/tiny-lfs"].commits) == 1  # objects sent, no commit

    code, output = run("push", model, "tester/tiny-lfs")
    assert code == 0, output
    assert server.count("PUT", "/lfs-upload/") == puts  # resumed: no object sent twice
    repo = server.repos["tester/tiny-lfs"]
    assert {path for path, f in repo.branches["main"].items() if f.lfs} == large
    uploaded = repo.files()
    uploaded.pop(".gitattributes")
    assert uploaded == folder_files(model)


# ------------------------------------------------------------------------------------------------- failure modes


def test_no_token(model, server, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    one_error_line(*run("push", model, "tester/x"), "no Hugging Face token", "HF_TOKEN", "hf auth login")
    assert server.requests == []


def test_rejected_token(model, server, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_WrongToken0123456789")
    line = one_error_line(*run("push", model, "tester/x"), "rejected the token", "401")
    assert "hf_WrongToken" not in line


def test_network_down(model, server, monkeypatch):
    with HubStandIn(token=SECRET) as gone:
        url = gone.url  # a port that nothing listens on once the block ends
    monkeypatch.setenv("HF_ENDPOINT", url)
    one_error_line(*run("push", model, "tester/x"), f"cannot reach the Hub at {url}", "re-run")


def test_existing_repo_without_write_access(model, server):
    server.add_repo("someone-else/their-model", {"README.md": b"theirs\n"})
    one_error_line(*run("push", model, "someone-else/their-model"), "no write access to someone-else/their-model",
                   "403")
    theirs = server.repos["someone-else/their-model"]
    assert len(theirs.commits) == 2 and theirs.files()["README.md"] == b"theirs\n"  # untouched


def test_namespace_without_rights(model, server):
    before = folder_files(model)
    one_error_line(*run("push", model, "nobody/x"), "cannot create nobody/x", "namespace")
    assert "nobody/x" not in server.repos
    assert folder_files(model) == before  # refused before the upload: the card does not name the repo


def test_offline_mode(model, server, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    one_error_line(*run("push", model, "tester/x"), "HF_HUB_OFFLINE")
    assert server.requests == []


@pytest.mark.parametrize("repo_id,needle", [("not a repo", "invalid repo id"), ("just-a-name", "no namespace")])
def test_bad_repo_id(model, server, repo_id, needle):
    one_error_line(*run("push", model, repo_id), needle)
    assert server.requests == []


@pytest.mark.parametrize("damage,needle", [
    ("missing shard", "missing model.safetensors"),
    ("truncated shard", "model.safetensors (truncated"),
    ("no tokenizer", "missing tokenizer_config.json"),
    ("no provenance", "missing provenance.json"),
])  # fmt: skip
def test_incomplete_folder_is_refused_before_any_upload(model, server, damage, needle):
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shard = model / sorted(set(index["weight_map"].values()))[0]
    if damage == "missing shard":
        shard.unlink()
    elif damage == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "no tokenizer":
        (model / "tokenizer_config.json").unlink()
    else:
        (model / "provenance.json").unlink()
    for extra in ([], ["--dry-run"]):
        one_error_line(*run("push", model, "tester/x", *extra), "not a complete checkpoint", needle)
    assert server.requests == [] and server.repos == {}
