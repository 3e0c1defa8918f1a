#!/usr/bin/env python
"""Quick one-shot quality probe used to choose the defaults (benchmarks/quality/README.md, "Probes").

    W=2 python benchmarks/quality/explore.py NAME key=value ...   (ConvertOptions fields, JSON values)
    e.g. W=2 python benchmarks/quality/explore.py C_r16 kv_budget=96 rope_dims=16
    module.NAME=value sets a constant of mla_convert.module for the probe (e.g. selftext.PROMPTS); a value @FILE is
    the JSON in FILE (recorded as its name and length).

Converts the embedded SmolLM2-135M in process with the data-free default calibration (`self`: its sampled text is
cached, so every probe calibrates on the same tokens) unless `calib_data=` says otherwise, and scores the first W
(env, default 2) 2048-token windows of each text of the development split (benchmarks/quality/run.py DEV_TEXTS:
`wiki-dev`, the second half of wiki.valid.tokens, and two documents of other domains from Debian packages). Its
row holds `ppl` (on `wiki-dev`, the one development text of the earlier probes), `dev` (every development text) and
`dev_ratio` (the geometric mean of their ratios to the source: what a choice is made on since). Never evaluation
text: choices are made here, results are measured by benchmarks/quality/run.py. Appends one JSON line to
benchmarks/quality/quality_probes.jsonl (series D; series C scored `wiki-dev` alone) and prints it. The converted folder
(out/probe-NAME) is removed unless KEEP=1.

`--dump-source DIR` writes a safetensors copy of the embedded model (for probes of other tools).
`--score NAME FOLDER` scores a converted folder (e.g. the main job's) on the same windows and appends its row
(its conversion options from the folder's provenance.json); FOLDER `source` scores the embedded source.
`--model-stage NAME FOLDER [steps=N lr=X scope=S seq_len=T top=K precision=P]` runs the model stage
(`--refine-model-steps`, mla_convert.conversion.model_stage.refine_model; steps in float32 unless precision=bfloat16) on a converted
folder with the calibration windows its provenance names (the same cached tokens), writes out/probe-NAME and scores
it: what the stage adds to a conversion without converting again. Its
row holds the held-out KL at each check (`curve`: [step, KL]).
"""

import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def dump_source(folder: str) -> None:
    from safetensors.torch import save_file

    from mla_convert.evaluate import load_model

    model, tok, _ = load_model(None)
    os.makedirs(folder, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied embeddings
    save_file(state, f"{folder}/model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    Path(folder, "config.json").write_text(json.dumps(config, indent=1))
    tok.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)


def dev_scores(folder: Path | None, windows: int) -> dict[str, float]:
    """{development text: perplexity} of a converted folder (None: the embedded source) on the first `windows`
    2048-token windows of each text of the development split (bench_quality.DEV_TEXTS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import mla_convert  # noqa: F401
    from benchmarks.quality.run import DEV_TEXTS, TEXTS, prepare_texts
    from mla_convert import evaluate

    prepare_texts()
    if folder is None:
        model, tok, _ = evaluate.load_model(None)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(folder)
    model.eval()
    return {name: round(evaluate.perplexity(model, evaluate.tokenize(tok, TEXTS[name].read_text()), 2048, windows,
                                            progress=False)["perplexity"], 3)
            for name in DEV_TEXTS}  # fmt: skip


def source_scores(windows: int) -> dict[str, float]:
    """The source's dev_scores, cached beside the texts (keyed by their contents and the window count)."""
    import hashlib

    from benchmarks.quality.run import DEV, DEV_TEXTS, TEXTS, prepare_texts

    prepare_texts()
    key = hashlib.sha256(b"".join(TEXTS[n].read_bytes() for n in DEV_TEXTS)).hexdigest()[:16]
    path = DEV / f"source-{key}-W{windows}.json"
    if not path.is_file():
        path.write_text(json.dumps(dev_scores(None, windows)))
    return json.loads(path.read_text())


def dev_row(folder: Path, windows: int) -> dict:
    """A probe row's scores: `ppl` on `wiki-dev` (the single-domain score of the earlier probes), `dev` on every
    development text, and `dev_ratio`, the geometric mean of their ratios to the source: the score choices use."""
    import math

    source = source_scores(windows)
    scores = source if folder is None else dev_scores(folder, windows)
    ratio = math.exp(sum(math.log(scores[n] / source[n]) for n in scores) / len(scores))
    return {"ppl": scores["wiki-dev"], "dev": scores, "dev_ratio": round(ratio, 4), "W": windows}


OVERRIDES_FILE = "probe_overrides.json"


def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(overrides: dict, given: dict | None = None) -> dict:
    """Set each `module.NAME` of `overrides` on mla_convert.module for this process; returns how to record them
    (`given`: the arguments as typed, so that a @FILE value is recorded as its name and length). Refused where the
    override could not act: a constant another mla_convert module holds under the same name (imported by name:
    setting it here would change nothing there) or the default of a ConvertOptions field (pass the option)."""
    import dataclasses
    import pkgutil

    import mla_convert
    from mla_convert.convert import ConvertOptions

    for info in pkgutil.iter_modules(mla_convert.__path__):  # loaded, so that a copy made at import is seen
        try:
            importlib.import_module(f"mla_convert.{info.name}")
        except ImportError:  # an optional dependency
            pass
    defaults = [f.default for f in dataclasses.fields(ConvertOptions)]
    shown = {}
    for key, value in overrides.items():
        module, attr = key.rsplit(".", 1)
        target = importlib.import_module(f"mla_convert.{module}")
        if not hasattr(target, attr):
            raise SystemExit(f"mla_convert.{module} has no {attr}")
        old = getattr(target, attr)
        copies = [m.__name__ for n, m in list(sys.modules.items())
                  if n.startswith("mla_convert") and m is not target and getattr(m, attr, None) is old]  # fmt: skip
        if copies or any(d is old or (type(d) is type(old) and d == old) for d in defaults):
            held = ", ".join(copies) or "a ConvertOptions default"
            raise SystemExit(f"{key}: also held by {held}, so setting it here would not act: pass the option instead")
        setattr(target, attr, value)
        text = (given or {}).get(key, "")
        shown[key] = f"{text} ({len(value)})" if text.startswith("@") and isinstance(value, list) else value
    return shown


def model_stage(name: str, folder: Path, settings: list[str]) -> dict:
    """The model stage on a converted folder (see the module docstring); returns its probe row."""
    from mla_convert.conversion import model_stage, refine_layer, selftext
    from mla_convert.conversion.calibration import calibration_tokens
    from mla_convert.checkpoint import open_source
    from mla_convert.evaluate import load_model

    kw = {k: json.loads(v) for k, v in (s.split("=", 1) for s in settings)}
    opts = json.loads((folder / "provenance.json").read_text())["options"]
    if (folder / OVERRIDES_FILE).is_file():  # the probe's constants (e.g. its prompt list): the same text again
        apply_overrides(json.loads((folder / OVERRIDES_FILE).read_text()))
    tokens = calibration_tokens(open_source(None), opts["calib_data"], opts["calib_samples"], opts["calib_seq_len"],
                                opts["seed"], temperature=opts.get("calib_temperature", selftext.TEMPERATURE),
                                sample_tokens=opts.get("calib_sample_tokens", selftext.SAMPLE_TOKENS))  # older folders
    source, _, _ = load_model(None)
    with torch.no_grad():
        teacher = torch.cat([source.model(input_ids=ids[None], use_cache=False).last_hidden_state for ids in tokens])
    del source
    model, tok, _ = load_model(str(folder))
    start = time.time()
    rec = model_stage.refine_model(model, tokens, teacher, kw.get("steps", model_stage.MODEL_STEPS), kw.get("lr", model_stage.MODEL_LR),
                              seq_len=kw.get("seq_len", refine_layer.SEQ_LEN), seed=opts["seed"],
                              scope=kw.get("scope", model_stage.MODEL_SCOPE), top=kw.get("top"),
                              precision=kw.get("precision", "float32"))
    seconds = time.time() - start
    out = ROOT / "out" / f"probe-{name}"
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    shutil.copy(folder / "provenance.json", out / "provenance.json")
    windows = int(os.environ.get("W", "2"))
    return {"name": name, "series": "D", **dev_row(out, windows), "stage_s": round(seconds, 1), "from": str(folder),
            **kw,
            "held_kl": [round(rec["before"], 4), round(rec["after"], 4)], "kept": rec["kept"],
            "curve": [[step, round(kl, 4)] for step, kl in rec["curve"]]}


def record(row: dict) -> None:
    print(json.dumps(row))
    with (ROOT / "benchmarks" / "quality" / "quality_probes.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        return print(__doc__)
    if sys.argv[1] == "--dump-source":
        return dump_source(sys.argv[2])
    windows = int(os.environ.get("W", "2"))
    if sys.argv[1] == "--score":
        name, folder = sys.argv[2], Path(sys.argv[3])
        if sys.argv[3] == "source":  # the embedded source itself: the row the ratios are taken against
            return record({"name": name, "series": "D", **dev_row(None, windows)})
        prov = json.loads((folder / "provenance.json").read_text())
        options = {k: v for k in ("kv_budget", "rank") if (v := prov.get("options", {}).get(k)) is not None}
        return record({"name": name, "series": "D", **dev_row(folder, windows),
                       "folder": str(folder), **options, "nope_dims": prov.get("plan", {}).get("nope_dims")})
    if sys.argv[1] == "--model-stage":
        return record(model_stage(sys.argv[2], Path(sys.argv[3]), sys.argv[4:]))
    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, convert

    name = sys.argv[1]
    opts, overrides, typed = dict(dtype="float32"), {}, {}
    for kv in sys.argv[2:]:
        key, typed[key] = kv.split("=", 1)
        value = json.loads(Path(typed[key][1:]).read_text()) if typed[key].startswith("@") else parse_value(typed[key])
        (overrides if "." in key else opts)[key] = value
    shown = apply_overrides(overrides, typed)
    out = ROOT / "out" / f"probe-{name}"
    start = time.time()
    convert(open_source(None), out, ConvertOptions(**opts), overwrite=True, progress=False)
    seconds = time.time() - start
    if overrides:  # kept with the folder, so that --model-stage rebuilds the same calibration text
        (out / OVERRIDES_FILE).write_text(json.dumps(overrides))
    shown = {k: v for k, v in opts.items() if k != "dtype"} | shown
    record({"name": name, "series": "D", **dev_row(out, windows),
            "convert_s": round(seconds, 1), **shown})
    if not os.environ.get("KEEP"):  # KEEP=1: leave the converted folder (e.g. for benchmarks/quality/run.py --folder)
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
