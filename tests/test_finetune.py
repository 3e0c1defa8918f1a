"""Fine-tuning: settings, data order, losses, and real runs on a tiny converted model (one process in-process, two
processes over gloo with `accelerate launch`, and a kill-and-resume that must repeat the uninterrupted losses)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mla_convert import data, finetune, provenance
from mla_convert.errors import UserError
from test_serving import _compare_in_vllm, needs_vllm
from tiny import tiny_source, tiny_text

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny Llama teacher, its MLA conversion (the student, whose provenance names the teacher), training text and
    a recipe for them."""
    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("finetune")
    teacher = tiny_source("llama-gqa", root / "teacher")
    text = root / "train.txt"
    # lines of 12 words: long enough for the overlap check, short enough to pack many sequences
    words = tiny_text(6000, seed=1).split()
    text.write_text("\n".join(" ".join(words[i : i + 12]) for i in range(0, len(words), 12)) + "\n")
    student = root / "student"
    options = ConvertOptions(kv_budget=0.5, calib_data=str(text), calib_samples=4, calib_seq_len=32)
    convert(open_source(str(teacher)), student, options, progress=False)
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({"finetune": {
        "model": str(student), "data": str(text), "output": str(root / "unused"),
        "seq_len": 32, "batch_size": 2, "grad_accum": 2, "lr": 3e-3, "warmup": 1, "eval_windows": 4,
        "eval_every": 3, "log_every": 1, "threads": 1,
    }}))
    return {"root": root, "teacher": teacher, "student": student, "text": text, "recipe": recipe}


def run_in_process(cfg):
    """finetune.run in this process; accelerate's process-wide state is reset after it, so the next run sets its own."""
    from accelerate.state import AcceleratorState

    try:
        return finetune.run(cfg)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_run_folder_files_of_ours_and_of_a_user(tmp_path):
    """overwrite=true deletes a run folder only if everything in it is the trainer's, the tokenizer's named chat
    templates (additional_chat_templates/*.jinja, which transformers writes for tokenizers with several) included."""
    from mla_convert.training.checkpoints import _foreign_entries

    out = tmp_path / "run"
    (out / "final" / "additional_chat_templates").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "provenance.json", "README.md", "loss.png"):
        (out / "final" / name).write_text("")
    (out / "final" / "additional_chat_templates" / "tool_use.jinja").write_text("{{ x }}")
    assert _foreign_entries(out) == []
    (out / "final" / "additional_chat_templates" / "notes.txt").write_text("mine")
    (out / "final" / "mine").mkdir()
    assert _foreign_entries(out) == ["final/additional_chat_templates/notes.txt", "final/mine"]


# ------------------------------------------------------------------------------------------------ settings


def test_overrides_typed_and_validated(tiny_run):
    cfg = finetune.load_config(tiny_run["recipe"], ["max_steps=7", "finetune.kd_weight=0.25", "train=all", "teacher=auto"])
    assert cfg.max_steps == 7 and cfg.kd_weight == 0.25 and cfg.train == "all" and cfg.eval_seq_len == 32
    # PyYAML reads `3e-4` (no dot) as text: it is still the number a user means, on the command line or in a recipe
    cfg = finetune.load_config(tiny_run["recipe"], ["lr=3e-4", "max_tokens=1e3", "kd_temperature=2"])
    assert cfg.lr == 3e-4 and cfg.max_tokens == 1000 and isinstance(cfg.max_tokens, int) and cfg.kd_temperature == 2.0
    with pytest.raises(UserError, match="lr must be a number, got '3e-4x'"):
        finetune.load_config(tiny_run["recipe"], ["lr=3e-4x"])
    with pytest.raises(UserError, match="max_tokens must be an integer"):
        finetune.load_config(tiny_run["recipe"], ["max_tokens=2.5e0"])
    with pytest.raises(UserError, match="unknown finetune setting"):
        finetune.load_config(tiny_run["recipe"], ["learning_rate=1"])
    with pytest.raises(UserError, match="needs a teacher"):
        finetune.load_config(tiny_run["recipe"], ["kd_weight=1", "teacher=none"])
    with pytest.raises(UserError, match="train must be"):
        finetune.load_config(tiny_run["recipe"], ["train=mlp"])
    with pytest.raises(UserError, match="key=value"):
        finetune.load_config(tiny_run["recipe"], ["max_steps"])
    # `no` is one of mixed_precision's choices, which YAML reads as false, on the command line and in a file
    assert finetune.load_config(tiny_run["recipe"], ["mixed_precision=no"]).mixed_precision == "no"
    with pytest.raises(UserError, match="mixed_precision must be a text, got True"):
        finetune.load_config(tiny_run["recipe"], ["mixed_precision=yes"])


def test_data_order_is_a_pure_function_of_seed_and_step():
    a = finetune.DataOrder(10, batch_size=2, grad_accum=1, world=2, seed=3)
    b = finetune.DataOrder(10, batch_size=2, grad_accum=1, world=2, seed=3)
    first_epoch = [i for step in range(3) for r in range(2) for i in a.indices(step, 0, r)][:10]
    assert sorted(first_epoch) == list(range(10))  # each sequence once per epoch, across ranks
    assert a.indices(7, 0, 1) == b.indices(7, 0, 1)  # a resumed process asks for step 7 first: same batch
    assert a.indices(0, 0, 0) != a.indices(0, 0, 1)  # ranks read different sequences


def test_pack_and_disjoint_text():
    seqs = data.pack(torch.arange(10), 3)
    assert seqs.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(UserError, match="fewer than one sequence"):
        data.pack(torch.arange(2), 3)
    line = "a line long enough to count as shared text between the two files, clearly over the limit"
    with pytest.raises(UserError, match="shares 1 lines"):
        data.check_disjoint(f"x\n{line}\n", f"{line}\ny\n")
    data.check_disjoint("= = Heading = =\nsome text", "= = Heading = =\nother text")  # short lines never count


def test_training_on_a_test_split_is_refused(tiny_run, tmp_path):
    test_file = tmp_path / "wiki.test.raw"
    test_file.write_text(tiny_run["text"].read_text())
    cfg = finetune.load_config(tiny_run["recipe"], [f"data={test_file}"])
    with pytest.raises(UserError, match="test split"):
        finetune.prepare_data(cfg, None)


def test_losses():
    logits = torch.randn(2, 5, 11)
    assert finetune.kd_loss(logits, logits.clone(), 2.0).abs() < 1e-6
    assert finetune.kd_loss(logits, torch.randn(2, 5, 11), 1.0) > 0
    ids = torch.randint(0, 11, (2, 5))
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    assert torch.allclose(finetune.lm_loss(logits, ids), ref)


def test_trainable_selection(tiny_run):
    model = finetune.load_student(str(tiny_run["student"]), torch.float32)
    attn = finetune.select_trainable(model, "attention")
    assert attn and all(".self_attn." in n for n in attn)
    norms = finetune.select_trainable(model, "attention+norms")
    assert set(norms) - set(attn) and all("norm" in n for n in set(norms) - set(attn))
    assert len(finetune.select_trainable(model, "all")) == len(list(model.parameters()))


# ----------------------------------------------------------------------------------------------------- runs


def _train_losses(out: Path) -> list[float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["event"] == "train"]


def test_one_process_distillation_writes_a_complete_checkpoint(tiny_run):
    from transformers import AutoModelForCausalLM

    out = tiny_run["root"] / "one"
    cfg = finetune.load_config(tiny_run["recipe"], [
        f"output={out}", "max_steps=5", "kd_weight=0.5", "teacher=auto", "save_every=2", "keep_last_n=1",
    ])
    final = run_in_process(cfg)
    assert [p.name for p in sorted(out.glob("step_*"))] == ["step_4"]  # step_2 pruned by keep_last_n=1
    assert (out / "step_4" / "trainer_state.json").is_file() and (out / "step_4" / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.model_type == "mla"
    record = provenance.load(final)
    assert record["kind"] == "finetune" and record["parent"]["kind"] == "convert"
    assert record["options"]["teacher_resolved"] == str(tiny_run["teacher"])
    m = record["measurements"]["finetune"]
    assert m["tokens"] == 5 * 32 * 2 * 2 and m["held_out_perplexity_after"] > 1
    records = [json.loads(x) for x in (final / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "eval"] == [0, 3, 5]
    assert all(r["kl"] is not None and r["kl"] >= 0 for r in records if r["event"] == "train")
    assert (final / "loss.png").stat().st_size > 0 and (final / "README.md").is_file()
    with pytest.raises(UserError, match="finished run"):
        finetune.run(cfg)  # refuses to overwrite a finished run without overwrite=true
    from mla_convert.training.checkpoints import _foreign_entries

    assert _foreign_entries(out) == []  # every file the run wrote (final/, step_N/, trainer/) is known as ours
    step = next(out.glob("step_*"))
    (final / "notes.md").write_text("mine")
    (step / "trainer" / "extra.bin").write_bytes(b"mine")
    assert _foreign_entries(out) == ["final/notes.md", f"{step.name}/trainer/extra.bin"]  # overwrite=true refuses


def test_fine_tuning_a_latent_served_in_a_block_type(tiny_run, tmp_path):
    """A student whose latent is served in a block cache type trains through that type's rounding (the gradient
    straight through: tests/test_kvquant.py), keeps the type, and says so in its provenance."""
    import shutil

    from transformers import AutoModelForCausalLM

    student = tmp_path / "student-q8"
    shutil.copytree(tiny_run["student"], student)
    config = json.loads((student / "config.json").read_text())
    (student / "config.json").write_text(json.dumps({**config, "latent_cache_type": "q8_0"}))
    cfg = finetune.load_config(tiny_run["recipe"], [f"model={student}", f"output={tmp_path / 'run'}", "max_steps=2",
                                                    "save_every=0", "eval_every=0"])
    final = run_in_process(cfg)
    assert "through the q8_0 latent cache's rounding" in provenance.load(final)["method"]
    before, after = (AutoModelForCausalLM.from_pretrained(f) for f in (student, final))
    assert after.config.latent_cache_type == "q8_0"
    name = "model.layers.0.self_attn.kv_a_proj.weight"
    assert not torch.equal(before.state_dict()[name], after.state_dict()[name])


@needs_vllm
@pytest.mark.slow
def test_finetuned_folder_serves_exactly_in_vllm(tiny_run):
    """What finetune writes is a native checkpoint the plugin serves: vLLM computes what transformers computes on it."""
    out = tiny_run["root"] / "served"
    cfg = finetune.load_config(tiny_run["recipe"], [f"output={out}", "max_steps=2", "kd_weight=0.5", "teacher=auto",
                                                   "eval_every=0"])  # fmt: skip
    final = run_in_process(cfg)
    assert provenance.load(final)["kind"] == "finetune"
    assert _compare_in_vllm(Path(final))["attention_backend"] == "CPU_MLA"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(recipe: Path, overrides: list[str], crash_after: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    if crash_after:
        env[finetune.CRASH_ENV] = str(crash_after)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(_free_port()), "-m", "mla_convert.finetune", "--config", str(recipe), *overrides]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_two_processes_loss_falls_ranks_agree_and_resume_repeats_losses(tiny_run):
    common = ["max_steps=6", "save_every=2", "keep_last_n=2", "kd_weight=0.5", "teacher=auto", "eval_every=0"]
    straight = tiny_run["root"] / "ddp"
    run = _launch(tiny_run["recipe"], [f"output={straight}", *common])
    assert run.returncode == 0, run.stderr[-3000:]
    losses = _train_losses(straight)
    assert len(losses) == 6 and losses[-1] < losses[0]
    m = provenance.load(straight / "final")["measurements"]["finetune"]
    assert m["processes"] == 2
    assert m["parameter_checksums_per_process"][0] == m["parameter_checksums_per_process"][1]
    rank_losses = [json.loads(x)["rank_losses"] for x in (straight / "metrics.jsonl").read_text().splitlines()
                   if json.loads(x)["event"] == "train"]
    assert all(len(r) == 2 for r in rank_losses) and any(r[0] != r[1] for r in rank_losses)  # different data per rank

    resumed = tiny_run["root"] / "ddp-resumed"
    killed = _launch(tiny_run["recipe"], [f"output={resumed}", *common], crash_after=5)
    assert killed.returncode != 0
    assert (resumed / "step_4" / "trainer_state.json").is_file() and not (resumed / "final").exists()
    # the resume goes through the CLI wrapper (accelerate launch with two CPU processes)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = subprocess.run(
        [sys.executable, "-m", "mla_convert.cli", "finetune", "--config", str(tiny_run["recipe"]), "-n", "2",
         f"output={resumed}", *common],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert _train_losses(resumed) == pytest.approx(losses, rel=1e-6, abs=1e-7)
    assert (resumed / "final" / "model.safetensors").is_file()


def test_two_processes_read_fresh_self_text_the_main_one_samples(tiny_run, tmp_path, monkeypatch):
    """data=self without a pool in two processes: the main process samples each step's text as it is needed and the
    other reads it from the cache; every process trains on its own sequences and they end with the same weights."""
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ddp-fresh"
    run = _launch(tiny_run["recipe"], [f"output={out}", "data=self", "max_steps=3", "kd_weight=0.5", "eval_every=0",
                                       "save_every=0"])  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    m = provenance.load(out / "final")["measurements"]["finetune"]
    assert m["processes"] == 2 and m["tokens"] == 3 * 32 * 2 * 2 * 2
    assert m["parameter_checksums_per_process"][0] == m["parameter_checksums_per_process"][1]
    assert m["fresh_self_text"]["sampled_tokens"] >= m["tokens"]
    rank_losses = [r["rank_losses"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                   if r["event"] == "train"]
    assert len(rank_losses) == 3 and all(r[0] != r[1] for r in rank_losses)


def test_resume_reads_no_pickle_and_repeats_losses(tiny_run):
    """trainer/ holds safetensors and JSON only; a resume from it repeats the uninterrupted losses; a trainer/ that
    holds pickle files (as accelerate's save_state writes them) is refused, never unpickled."""
    import shutil

    def train(out: Path) -> Path:
        cfg = finetune.load_config(tiny_run["recipe"], [
            f"output={out}", "max_steps=4", "save_every=2", "keep_last_n=0", "eval_every=0", "kd_weight=0",
        ])
        return run_in_process(cfg)

    straight = tiny_run["root"] / "single"
    train(straight)
    trainer = straight / "step_2" / finetune.TRAINER_DIR
    assert sorted(p.name for p in trainer.iterdir()) == ["optimizer.safetensors", "rng_0.safetensors", "trainer.json"]

    resumed = tiny_run["root"] / "single-resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "final")  # as if killed after step 3: the run restarts from step_2
    train(resumed)
    assert _train_losses(resumed) == pytest.approx(_train_losses(straight), rel=1e-6, abs=1e-7)

    shutil.rmtree(resumed / "final")
    for f in (resumed / "step_2" / finetune.TRAINER_DIR).iterdir():
        f.unlink()
    (resumed / "step_2" / finetune.TRAINER_DIR / "custom_checkpoint_0.pkl").write_bytes(b"not to be unpickled")
    with pytest.raises(UserError, match="pickle files, which are not loaded"):
        train(resumed)


def test_self_generated_training_text(tiny_run, tmp_path, monkeypatch):
    """data=self without a pool: the held-out windows are samples of a seed of their own, the training sequences the
    run seed's samples from the first on (the conversion's calibration text, then new), sampled as the steps read
    them (in order, each once); the run writes a model with the sampler's and the trainer's rates; a run without a
    bound, or without a teacher, is refused."""
    from mla_convert.conversion import selftext
    from mla_convert.checkpoint import open_source
    from mla_convert.training.data import HELD_OUT_SEED_OFFSET

    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "cache"))
    cfg = finetune.load_config(tiny_run["recipe"], ["data=self", "max_tokens=256", f"output={tmp_path / 'run'}",
                                                    "max_steps=2", "kd_weight=0.5"])  # fmt: skip
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(tiny_run["student"])
    train, windows = finetune.prepare_data(cfg, tokenizer)
    assert isinstance(train, finetune.FreshSequences) and windows.shape == (4, 32)
    stream = train.stream
    assert stream.tokens == []  # nothing of the training text is sampled before a step asks for it
    source = open_source(str(tiny_run["teacher"]))
    held = selftext.Stream(source, HELD_OUT_SEED_OFFSET)  # the held-out stream, read back from the cache
    assert torch.equal(windows.reshape(-1), torch.tensor(held.tokens[: 4 * 32]))
    order = finetune.DataOrder(None, 2, 2, 1, 0)
    assert [order.indices(1, m, 0) for m in range(2)] == [[4, 5], [6, 7]] and order.last(1) == 7
    assert torch.equal(train[[0, 1]], torch.tensor([stream.tokens[:32], stream.tokens[32:64]]))
    assert len(stream.tokens) >= 64 and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    final = run_in_process(cfg)
    m = provenance.load(final)["measurements"]["finetune"]
    assert m["tokens"] == 2 * 32 * 2 * 2
    fresh = m["fresh_self_text"]
    assert fresh["sampled_tokens"] >= 2 * 32 * 2 * 2 and fresh["sampler_tokens_per_second"] > 0
    assert fresh["trainer_tokens_per_second"] > 0
    # what the run read is what the cache holds: the same text again, not sampled anew
    again = selftext.Stream(source, 0)
    n = min(len(stream.tokens), 8 * 32)
    assert len(again.tokens) >= 8 * 32 and again.tokens[:n] == stream.tokens[:n]
    with pytest.raises(UserError, match="max_seconds"):
        finetune.prepare_data(finetune.load_config(tiny_run["recipe"], ["data=self"]), tokenizer)
    with pytest.raises(UserError, match="set teacher"):
        finetune.prepare_data(finetune.load_config(tiny_run["recipe"], ["data=self", "teacher=none",
                                                                        "max_tokens=256"]), tokenizer)


def test_self_doc_training_text_is_one_document_a_window(tiny_run, tmp_path, monkeypatch):
    """data=self-doc: every training sequence and every held-out window is one document the teacher continued from its
    BOS alone (the document style, keyed apart from chat text in the cache), fresh or as a pool."""
    from mla_convert.conversion import selftext

    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "cache"))
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(tiny_run["student"])
    start = selftext.prompts(tokenizer, 0, 1, "document")[0]
    for extra in ([], ["data_tokens=128"]):
        cfg = finetune.load_config(tiny_run["recipe"], ["data=self-doc", "max_tokens=256", "max_steps=2",
                                                        f"output={tmp_path / 'run'}", *extra])  # fmt: skip
        train, windows = finetune.prepare_data(cfg, tokenizer)
        assert isinstance(train, finetune.FreshSequences) == (not extra)
        if not extra:
            assert train.stream.style == "document"
        rows = train[list(range(4))] if not extra else train[:4]
        for row in [*rows, *windows]:
            assert row[: len(start)].tolist() == start
        chat, _ = finetune.prepare_data(finetune.load_config(tiny_run["recipe"], [
            "data=self", "max_tokens=256", "max_steps=2", f"output={tmp_path / 'run'}", *extra]), tokenizer)
        assert not torch.equal(chat[[0, 1]] if not extra else chat[:2], rows[:2])


def test_fresh_self_text_bounded_by_time_alone(tiny_run, tmp_path, monkeypatch):
    """data=self without a pool needs no step or token budget: max_seconds alone ends the run (the sampling counted
    in it), and final/ records the steps it took."""
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "cache"))
    cfg = finetune.load_config(tiny_run["recipe"], ["data=self", f"output={tmp_path / 'run'}", "max_seconds=1e-9",
                                                    "kd_weight=0.5", "save_every=0"])  # fmt: skip
    assert cfg.max_steps is None and cfg.max_tokens is None
    m = provenance.load(run_in_process(cfg))["measurements"]["finetune"]
    assert m["steps"] == 1 and m["stopped_for_time"] is True and m["tokens"] == 32 * 2 * 2
    assert m["fresh_self_text"]["sampled_tokens"] >= 32 * 2 * 2 and m["fresh_self_text"]["sampling_seconds"] > 0


def test_max_seconds_ends_the_run_before_a_step_that_would_pass_it():
    """max_seconds is spent when the time so far plus the run's mean step would pass it (a step's batch of samples
    can take minutes: the run ends near the bound, not that past it); the schedule reads the share actually spent."""
    from types import SimpleNamespace

    from mla_convert.training.loop import Trainer

    trainer = SimpleNamespace(cfg=SimpleNamespace(max_seconds=100.0), elapsed=80.0, device="cpu",
                              accelerator=SimpleNamespace(gather=lambda t: t))
    assert Trainer._spend_time(trainer, 4) is False and trainer.time_share == pytest.approx(0.8)  # 80 + 20 = 100
    assert Trainer._spend_time(trainer, 3) is True and trainer.time_share == pytest.approx(0.8)  # 80 + 26.7 > 100
    assert Trainer._spend_time(trainer, 0) is False  # before any step (a resumed run's first call): no projection
    trainer.elapsed = 101.0
    assert Trainer._spend_time(trainer, 0) is True and trainer.time_share == 1.0
    trainer.cfg.max_seconds = None
    assert Trainer._spend_time(trainer, 3) is False


def test_self_text_stream_read_in_pieces_is_the_text_sampled_at_once(tiny_run, tmp_path, monkeypatch):
    """selftext.Stream: asked for a little at a time (the sampler's slots kept open between requests) it gives the
    text it gives when asked for all at once, leaves no inference mode behind, and a reader of the cache after it
    (a resumed run) reads that text and samples on where the cache ends."""
    from mla_convert.conversion import selftext
    from mla_convert.checkpoint import open_source

    source = open_source(str(tiny_run["teacher"]))
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "pieces"))
    pieces = selftext.Stream(source, 3, batch=4)
    for n in (10, 150, 151, 400):
        pieces.ensure(n)
        assert len(pieces.tokens) >= n and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    pieces.close()  # the sampler closed mid-sample: still no inference mode left behind
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "whole"))
    whole = selftext.Stream(source, 3, batch=4)
    whole.ensure(400)
    n = min(len(whole.tokens), len(pieces.tokens))
    assert whole.tokens[:n] == pieces.tokens[:n] and pieces.ends[0] == whole.ends[0]
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "pieces"))
    resumed = selftext.Stream(source, 3, batch=4)
    assert resumed.tokens == pieces.tokens and resumed.sampled == 0
    resumed.ensure(len(pieces.tokens) + 50)
    assert resumed.tokens[: len(pieces.tokens)] == pieces.tokens and resumed.sampled >= 50


def test_report_texts_scored_at_every_evaluation(tiny_run, tmp_path, monkeypatch):
    """report_data: texts scored beside the held-out windows at every evaluation (metrics, provenance, plot), never
    text the run trains on; data=self samples in batches of sample_batch (its own cache entry)."""
    from accelerate.state import AcceleratorState

    from mla_convert.conversion import selftext
    from mla_convert.checkpoint import open_source

    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "cache"))
    words = tiny_text(3000, seed=7).split()
    texts = []
    for name in ("alpha", "beta"):
        path = tmp_path / f"{name}.txt"
        path.write_text("\n".join(" ".join(words[i : i + 9]) for i in range(0, len(words), 9)) + "\n")
        words = words[::-1]
        texts.append(path)
    out = tmp_path / "run"
    cfg = finetune.load_config(tiny_run["recipe"], [
        "data=self", "max_steps=4", "eval_every=2", "kd_weight=0.5", "sample_batch=3", f"output={out}",
        f"report_data={texts[0]},{texts[1]}", "report_windows=2", "report_seq_len=16",
    ])
    calls = []
    real = selftext.sample_stream
    monkeypatch.setattr(selftext, "sample_stream", lambda *a, **kw: calls.append(a[6]) or real(*a, **kw))
    final = run_in_process(cfg)
    assert calls and set(calls) == {3}  # sample_batch sequences at a time
    settings, path = selftext.cache_entry(open_source(str(tiny_run["teacher"])), 0, selftext.TEMPERATURE,
                                          selftext.SAMPLE_TOKENS, 3)
    assert path.is_file() and settings["batch"] == 3
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(set(r["report"]) == {"alpha", "beta"} and all(p > 1 for p in r["report"].values()) for r in evals)
    assert evals[0]["report"] != evals[-1]["report"]  # the model changed between the first and last evaluation
    m = provenance.load(final)["measurements"]["finetune"]
    assert m["report_perplexity_after"] == evals[-1]["report"] and m["report_perplexity_before"] == evals[0]["report"]
    assert m["tokens_per_second"] > 0 and "2 x 16-token windows" in m["report_protocol"]

    # a report text the run trains on is refused before any work
    clash = finetune.load_config(tiny_run["recipe"], [f"output={tmp_path / 'clash'}", "max_steps=1",
                                                      f"report_data={tiny_run['text']}"])
    with pytest.raises(UserError, match="training text"):
        finetune.run(clash)
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(UserError, match="sample_batch"):
        finetune.load_config(tiny_run["recipe"], ["sample_batch=0"])


def test_self_text_sampled_on_a_gpu_has_its_own_cache_entry(tiny_run):
    """Text sampled on a CUDA device (bfloat16, other random streams) never stands in for the CPU's, nor the reverse;
    the CPU's key is the one its caches were written with."""
    from mla_convert.conversion import selftext
    from mla_convert.checkpoint import open_source

    source = open_source(str(tiny_run["teacher"]))
    cpu, cpu_path = selftext.cache_entry(source, 0, 1.0, 64, 4)
    gpu, gpu_path = selftext.cache_entry(source, 0, 1.0, 64, 4, device="cuda")
    assert "device" not in cpu and gpu["device"] == "cuda" and cpu_path != gpu_path


@pytest.mark.gpu
def test_self_text_samples_on_cuda(tiny_run, tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mla_convert.conversion import selftext
    from mla_convert.checkpoint import open_source

    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "cache"))
    source = open_source(str(tiny_run["teacher"]))
    a = selftext.self_tokens(source, 300, seed=0, batch=8, device="cuda")
    assert a.numel() >= 300 and torch.equal(selftext.self_tokens(source, 300, seed=0, batch=8, device="cuda"), a)


def test_self_text_pool_smaller_than_the_budget_repeats(tiny_run, tmp_path, monkeypatch):
    """data_tokens: data=self samples that many tokens (plus the held-out windows) and the steps read the pool again
    epoch after epoch, instead of sampling the whole budget."""
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "cache"))
    cfg = finetune.load_config(tiny_run["recipe"], ["data=self", "max_steps=20", "data_tokens=96"])
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(tiny_run["student"])
    train, _ = finetune.prepare_data(cfg, tokenizer)
    big, _ = finetune.prepare_data(finetune.load_config(tiny_run["recipe"], ["data=self", "max_steps=20",
                                                                          "data_tokens=4096"]), tokenizer)
    assert 3 <= train.shape[0] < big.shape[0] and big.shape[0] * 32 >= 20 * 128  # 20 steps of 2 x 2 x 32 tokens
    order = finetune.DataOrder(train.shape[0], 2, 2, 1, 0)
    seen = {i for step in range(20) for micro in range(2) for i in order.indices(step, micro, 0)}
    assert seen == set(range(train.shape[0]))  # every pooled sequence is read, epoch after epoch
    with pytest.raises(UserError, match="data_tokens"):
        finetune.load_config(tiny_run["recipe"], ["data_tokens=8"])


def test_time_budget_stops_the_run_and_drives_the_schedule(tiny_run, tmp_path):
    """max_seconds: the run stops once the training time is spent and still writes a complete final/ whose
    provenance says so; the schedule decays with the time share when it runs ahead of the step share."""
    from mla_convert.training.models import lr_lambda

    cfg = finetune.load_config(tiny_run["recipe"], [f"output={tmp_path / 'run'}", "max_steps=50", "save_every=0",
                                                    "max_seconds=1e-9"])  # fmt: skip
    final = run_in_process(cfg)
    m = provenance.load(final)["measurements"]["finetune"]
    assert m["steps"] == 1 and m["stopped_for_time"] is True and m["tokens"] == 32 * 2 * 2
    records = [json.loads(x) for x in (final / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "eval"] == [0, 1]
    share = {"now": 0.0}
    factor = lr_lambda(finetune.load_config(tiny_run["recipe"], ["max_steps=100", "warmup=10"]), 100, lambda: share["now"])
    assert factor(20) > 0.95  # early in both budgets
    share["now"] = 1.0
    assert factor(20) == pytest.approx(0.1)  # time spent: the floor (min_lr_ratio), whatever the step
    # a time budget far shorter than the step budget: the warmup (10% of the steps) follows the time share too
    factor = lr_lambda(finetune.load_config(tiny_run["recipe"], ["max_steps=1000", "warmup=0.1"]), 1000,
                       lambda: share["now"])
    share["now"] = 0.05
    assert factor(5) == pytest.approx(0.5)  # halfway through the warmup's share of the time, at step 5 of 100
    share["now"] = 0.1
    assert factor(6) == pytest.approx(1.0)  # warmed up by time; the decay starts from there
    share["now"] = 0.55
    assert factor(40) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay's time: cosine at its middle
    share["now"] = 0.0
    assert factor(5) == pytest.approx(6 / 101) and factor(500) < 1.0  # without time spent: by the steps alone
    with pytest.raises(UserError, match="max_seconds"):
        finetune.load_config(tiny_run["recipe"], ["max_seconds=0"])


def test_keep_best_holds_the_best_evaluated_weights(tiny_run, tmp_path, monkeypatch):
    """keep_best: final/ holds the weights of the evaluation with the lowest held-out perplexity (here step 3 of 6, its
    scores set by the test, the weights checked against the step_3 checkpoint), and provenance says which step."""
    from safetensors.torch import load_file

    from mla_convert.training import loop

    real, scores = loop.Trainer.evaluate, iter([10.0, 5.0, 8.0])  # steps 0, 3 and 6; then the real score

    def scripted(self):
        result = real(self)
        return {**result, "perplexity": next(scores, result["perplexity"])}

    monkeypatch.setattr(loop.Trainer, "evaluate", scripted)
    out = tmp_path / "run"
    cfg = finetune.load_config(tiny_run["recipe"], [f"output={out}", "max_steps=6", "save_every=3", "keep_last_n=0",
                                                    "keep_best=true"])  # fmt: skip
    final = run_in_process(cfg)
    m = provenance.load(final)["measurements"]["finetune"]
    assert m["kept_step"] == 3 and m["steps"] == 6
    at3, kept = load_file(out / "step_3" / "model.safetensors"), load_file(final / "model.safetensors")
    start = load_file(tiny_run["student"] / "model.safetensors")
    attention = [k for k in kept if ".self_attn." in k]
    assert attention and all(torch.equal(at3[k], kept[k]) for k in attention)
    assert not all(torch.equal(start[k], kept[k]) for k in attention)  # it trained: step 3 is not the start
