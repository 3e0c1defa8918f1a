"""Checkpoints (a loadable step_N/ folder + safetensors/JSON trainer state) and the run's output folder."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import torch

from mla_convert.errors import UserError
from mla_convert.conversion.selftext import STYLES
from mla_convert.training.recipe import FINAL_DIR, FinetuneConfig, METRICS_FILE, PLOT_FILE, STATE_FILE, TRAINER_DIR


def complete_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete step_N in `out`, oldest first."""
    found = []
    for folder in out.glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", folder.name)
        if m and (folder / STATE_FILE).is_file():
            found.append((int(m.group(1)), folder))
    return sorted(found)


# trainer/ of a step_N checkpoint, written without pickle (accelerate's save_state pickles the scheduler and the RNG
# states, and its load_state unpickles them with weights_only=False: a checkpoint folder could run code on resume):
#   optimizer.safetensors   the optimizer's per-parameter tensors (AdamW moments, steps), from the main process
#   trainer.json            optimizer layout and param groups, scheduler and GradScaler state (plain numbers)
#   rng_<rank>.safetensors  each process's torch (and CUDA) RNG state; python and numpy RNG in its metadata
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_JSON = "trainer.json"


def _rng_file(rank: int) -> str:
    return f"rng_{rank}.safetensors"


def optimizer_to_files(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state dict -> (tensors for safetensors, a JSON-able layout that names them)."""
    tensors: dict[str, torch.Tensor] = {}
    state = []
    for key, values in state_dict["state"].items():
        entry = {}
        for name, value in values.items():
            if torch.is_tensor(value):
                tensors[f"{key}/{name}"] = value.detach().cpu().contiguous()
                entry[name] = {"tensor": f"{key}/{name}"}
            else:
                entry[name] = {"value": value}
        state.append({"key": key, "values": entry})
    return tensors, {"state": state, "param_groups": state_dict["param_groups"]}


def optimizer_from_files(tensors: dict[str, torch.Tensor], layout: dict) -> dict:
    """The inverse of `optimizer_to_files` (JSON lists back to the tuples torch's param groups hold)."""
    state = {}
    for item in layout["state"]:
        state[item["key"]] = {name: tensors[v["tensor"]] if "tensor" in v else v["value"]
                              for name, v in item["values"].items()}
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
              for g in layout["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_trainer_state(folder: Path, optimizer_state: dict | None, scheduler, scaler, rank: int) -> None:
    """Write trainer/ (see OPTIMIZER_FILE): `optimizer_state` and the rest from the main process (rank 0), the RNG
    state from every process."""
    import random

    import numpy as np

    from mla_convert.writes import save_tensors

    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        tensors, layout = optimizer_to_files(optimizer_state)
        save_tensors(tensors, folder / OPTIMIZER_FILE)
        record = {"optimizer": layout, "scheduler": scheduler.state_dict(),
                  "scaler": scaler.state_dict() if scaler is not None else None}
        (folder / TRAINER_JSON).write_text(json.dumps(record) + "\n")
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    rng["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    meta = {"python": json.dumps(random.getstate()), "numpy": json.dumps([kind, int(pos), int(has_gauss), float(cached)])}
    save_tensors(rng, folder / _rng_file(rank), metadata=meta)


def load_trainer_state(folder: Path, rank: int) -> tuple[dict, dict, dict | None]:
    """Read trainer/ written by `save_trainer_state` and restore this process's RNG state; returns (optimizer state
    dict, scheduler state, GradScaler state). Nothing is unpickled."""
    import random

    import numpy as np
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not (folder / TRAINER_JSON).is_file():
        pickled = sorted(p.name for p in folder.glob("*") if p.suffix in (".pkl", ".bin", ".pt"))
        why = f" (it holds {', '.join(pickled[:3])}: pickle files, which are not loaded)" if pickled else ""
        raise UserError(f"{folder} has no {TRAINER_JSON}{why}: it was written by an older mla-convert or is "
                        "incomplete; start over with overwrite=true")
    try:
        record = json.loads((folder / TRAINER_JSON).read_text())
        optimizer = optimizer_from_files(load_file(str(folder / OPTIMIZER_FILE)), record["optimizer"])
        with safe_open(str(folder / _rng_file(rank)), framework="pt") as f:
            meta = f.metadata()
            rng = {k: f.get_tensor(k) for k in f.keys()}
        torch.set_rng_state(rng["torch"])
        cuda = [rng[f"cuda_{i}"] for i in range(len(rng)) if f"cuda_{i}" in rng]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
        python = json.loads(meta["python"])
        random.setstate((python[0], tuple(python[1]), python[2]))
        kind, pos, has_gauss, cached = json.loads(meta["numpy"])
        np.random.set_state((kind, rng["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise UserError(f"{folder} is damaged ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}): "
                        "resume from an earlier step_N (delete this one) or start over with overwrite=true") from None
    return optimizer, record["scheduler"], record.get("scaler")


def _check_output(cfg: FinetuneConfig, out: Path) -> None:
    """Refuse an output folder that is the current directory (or holds it), or that is, holds or lies inside an input."""
    from mla_convert.outputs import check_location

    inputs = [(label, Path(spec)) for label, spec in (("student", cfg.model), ("training text", cfg.data),
                                                       ("eval_data", cfg.eval_data), ("teacher", cfg.teacher))
              if spec not in (None, "auto", "embedded") and Path(spec).expanduser().exists()]
    check_location(out, inputs, "output=runs/NAME")
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is an existing file: set output to a folder")
    if out.is_dir() and any(out.iterdir()) and not _is_run_folder(out):
        raise UserError(f"{out} exists and is not a fine-tuning run folder of mla-convert, so it is neither resumed "
                        "nor deleted (not even with overwrite=true): remove it yourself or choose another output")
    foreign = _foreign_entries(out) if out.is_dir() else []
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"{out} holds files the trainer did not write ({shown}), so it is neither resumed nor "
                        "deleted: move them out or choose another output")


def check_output(cfg: FinetuneConfig) -> Path:
    """The run folder, resolved, once it is safe to write (and with overwrite=true, to delete), and the local inputs
    exist: call before launching."""
    from mla_convert import data

    student = Path(cfg.model).expanduser()
    if not student.exists() and (cfg.model.startswith((".", "/", "~")) or cfg.model.count("/") != 1):
        raise UserError(f"the student {cfg.model} does not exist: set model to a converted model folder "
                        "(the output of mla-convert llama) or a hub id like org/name")
    if student.exists() and not (student / "config.json").is_file():
        raise UserError(f"the student {cfg.model} has no config.json: set model to a converted model folder")
    for spec in (cfg.data, cfg.eval_data):
        if spec is not None and spec not in STYLES:
            data.check_text_spec(spec)
    out = Path(cfg.output).expanduser().resolve()
    _check_output(cfg, out)
    return out


# trainer/'s files: ours, and those of accelerate's save_state that older mla-convert wrote there (refused on resume
# as pickle, never loaded; a run folder that holds them is still ours to delete with overwrite=true)
_TRAINER_FILE = re.compile(rf"{re.escape(OPTIMIZER_FILE)}|{re.escape(TRAINER_JSON)}|rng_\d+\.safetensors"
                           r"|(optimizer|scheduler|scaler)(_\d+)?\.(bin|pt)|(random_states|custom_checkpoint)_\d+\.pkl"
                           r"|(model|pytorch_model)(_\d+)?\.(safetensors|bin)")
TEMPLATES_DIR = "additional_chat_templates"  # where transformers saves a tokenizer's named chat templates
_TEMPLATE_FILE = re.compile(r".+\.jinja")


def _foreign_entries(out: Path) -> list[str]:
    """Entries of a run folder that the trainer does not write there (a user's files: never ours to delete), looked
    for inside the model folders it writes (final/, step_N/ and their known subfolders) as well, as paths relative to
    `out`."""
    from mla_convert.outputs import foreign_files

    foreign = []
    for entry in sorted(out.iterdir()):
        if entry.is_symlink():  # a link is never the trainer's: neither written through nor removed
            foreign.append(entry.name)
            continue
        if entry.name == PLOT_FILE and entry.is_file():
            continue
        if entry.name == METRICS_FILE and entry.is_file() and _our_metrics(entry):
            continue
        if entry.is_dir() and _STAGING.fullmatch(entry.name):  # a model folder a killed run was writing
            continue
        if not (entry.is_dir() and (entry.name == FINAL_DIR or re.fullmatch(r"step_\d+", entry.name))):
            foreign.append(entry.name)
            continue
        # a model folder as convert writes it, plus the run's copies (final/) or the checkpoint's state (step_N/),
        # and subfolders that hold only the files their pattern names
        files, folders = (({METRICS_FILE, PLOT_FILE}, {TEMPLATES_DIR: _TEMPLATE_FILE}) if entry.name == FINAL_DIR
                          else ({STATE_FILE}, {TEMPLATES_DIR: _TEMPLATE_FILE, TRAINER_DIR: _TRAINER_FILE}))
        for name in foreign_files(entry):
            path = entry / name
            if name in folders and path.is_dir():
                foreign += [f"{entry.name}/{name}/{p.name}" for p in sorted(path.iterdir())
                            if not (p.is_file() and folders[name].fullmatch(p.name))]
            elif not (name in files and path.is_file()):
                foreign.append(f"{entry.name}/{name}")
    return foreign


# hidden names the trainer writes a model folder under before it renames it into place (final/, step_N/)
_STAGING = re.compile(rf"\.({re.escape(FINAL_DIR)}|step_\d+)\.incomplete")


def staging_dir(folder: Path) -> Path:
    """The hidden name a model folder (OUT/final, OUT/step_N) is written under until it is complete."""
    return folder.with_name(f".{folder.name}.incomplete")


@contextlib.contextmanager
def removed_on_failure(stage: Path, main: bool = True):
    """Remove `stage` (a model folder being written under its hidden name) when the block fails in the main process:
    a full disk gets back the room the part took."""
    from mla_convert.errors import as_os_error

    try:
        yield stage
    except BaseException as e:
        if main:
            shutil.rmtree(stage, ignore_errors=True)
        oserr = as_os_error(e)
        if oserr is not None and not oserr.filename:  # transformers' writes name no file: the folder, then
            raise OSError(oserr.errno, oserr.strerror, str(stage)) from None
        raise


def _our_metrics(path: Path) -> bool:
    """True when `path` reads as the trainer's metrics.jsonl: empty, or every line a JSON record of a train or eval
    event (a user's file of that name is neither rewritten nor deleted)."""
    try:
        with open(path, "rb") as f:
            lines = f.read(64 * 2**20 + 1).decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    try:
        records = [json.loads(line) for line in lines if line.strip()]
    except ValueError:
        return False
    return all(isinstance(r, dict) and r.get("event") in ("train", "eval") and isinstance(r.get("step"), int)
               for r in records)


def _is_run_folder(out: Path) -> bool:
    """A folder this trainer wrote: a finished run, complete checkpoints, or the metrics of a started run."""
    metrics = out / METRICS_FILE
    return ((out / FINAL_DIR / "provenance.json").is_file() or bool(complete_checkpoints(out))
            or (metrics.is_file() and not metrics.is_symlink() and _our_metrics(metrics)))


def lock_run_folder(out: Path):
    """Create `out` if needed and lock it for this run (an advisory lock on the folder itself, released when the
    process ends): a second run into the same folder is refused instead of interleaving with this one. Returns the
    open descriptor to keep."""
    import fcntl
    import os

    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"another fine-tuning run is writing {out}: wait for it to finish or stop it, or choose "
                        "another output") from None
    return fd


def prepare_output(cfg: FinetuneConfig, out: Path, is_main: bool) -> None:
    """Main process only: refuse or clear an output that a resume cannot use. overwrite=true deletes only a run
    folder this trainer wrote, never a foreign one."""
    if not out.exists() or not any(out.iterdir()):
        out.mkdir(parents=True, exist_ok=True)
        return
    _check_output(cfg, out)  # again, right before a delete
    for stale in out.iterdir():  # a model folder a killed run was still writing: never complete, never reused
        if _STAGING.fullmatch(stale.name) and stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
    if cfg.overwrite:  # the folder's entries, not the folder: it holds this run's lock
        for entry in list(out.iterdir()):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    elif (out / FINAL_DIR / "provenance.json").is_file():
        raise UserError(f"{out} holds a finished run ({out / FINAL_DIR}): pass overwrite=true or another output")
    elif not cfg.resume and complete_checkpoints(out):
        raise UserError(f"{out} holds checkpoints: pass resume=true to continue, or overwrite=true to start over")
