"""The training loop: a Trainer with setup / train_step / evaluate / save / finish; `run` drives it."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch

from mla_convert.dtypes import DTYPES
from mla_convert.errors import UserError
from mla_convert.training.recipe import (
    CRASH_ENV, DATA_ORDER_FIELDS, FINAL_DIR, FinetuneConfig, METRICS_FILE, PLOT_FILE, STATE_FILE, TRAINER_DIR,
)
from mla_convert.training.data import DataOrder, FreshSequences, prepare_data, report_windows
from mla_convert.training.models import (
    load_student, load_teacher, lr_lambda, select_trainable, teacher_spec, torch_dtype,
)
from mla_convert.training.losses import kd_loss, lm_loss
from mla_convert.training.checkpoints import (
    check_output, complete_checkpoints, load_trainer_state, lock_run_folder, prepare_output, removed_on_failure,
    save_trainer_state, staging_dir,
)
from mla_convert.training.metrics import Metrics, peak_memory_bytes, plot
from mla_convert.writes import room_for

log = logging.getLogger(__name__)

# The step count of a run bounded by max_seconds alone (fresh self text has no end): the schedule then follows time.
UNBOUNDED_STEPS = 2**62


class Trainer:
    """One fine-tuning run in every process of an accelerate launch: `setup`, then `train_step` per optimizer step
    with `evaluate` and `save` on their schedules, then `finish` (final eval, OUT/final, provenance, card)."""

    def __init__(self, cfg: FinetuneConfig):
        self.cfg = cfg
        self.elapsed = self.teacher_s = self.student_s = 0.0
        self.fresh = False  # data=self without a pool: the training text is sampled as the steps read it
        self.before: dict | None = None

    # ------------------------------------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Accelerator, output folder, resume point, data, models, optimizer (restored on a resume), metrics."""
        self._setup_accelerator()
        self._setup_output()
        self._setup_data()
        self._setup_models()
        self._setup_optimizer()
        cfg = self.cfg
        self.metrics = Metrics(self.out / METRICS_FILE, self.is_main, self.resume_step)
        steps = (f"{self.total_steps} steps of {self.tokens_per_step} tokens" if self.total_steps < UNBOUNDED_STEPS
                 else f"steps of {self.tokens_per_step} tokens for {cfg.max_seconds:g} s")
        log.info("training %s: %d/%d parameters (%s), %s, %d process(es), mixed precision %s%s",
                 cfg.model, self.n_train, sum(p.numel() for p in self.accelerator.unwrap_model(self.model).parameters()),
                 cfg.train, steps, self.world, self.mp,
                 ", fresh self text sampled as it is read" if self.fresh else "")
        if self.cache_type:
            log.info("the latent is read through its %s cache's rounding (latent_cache_type), the gradient passed "
                     "straight through", self.cache_type)

    def _setup_accelerator(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        cfg = self.cfg
        mp = cfg.mixed_precision
        if mp == "auto":
            mp = ("bf16" if torch.cuda.is_bf16_supported() else "fp16") if torch.cuda.is_available() else "no"
        self.mp = mp
        self.accelerator = accelerator = Accelerator(mixed_precision=mp)
        self.device, self.rank, self.world = accelerator.device, accelerator.process_index, accelerator.num_processes
        self.is_main = accelerator.is_main_process
        if self.device.type == "cpu":
            local = max(1, accelerator.num_processes)  # single-node CPU runs: share the cores
            torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local))
        set_seed(cfg.seed)

    def _setup_output(self) -> None:
        """The output folder, and the latest complete checkpoint to resume from (refused if the data order changed)."""
        cfg = self.cfg
        self.out = out = check_output(cfg)
        if self.is_main:
            self._created_out = not out.exists()  # a run refused before it wrote anything leaves no folder of its own
            self._lock = lock_run_folder(out)  # held until the process ends: one run per output folder
            prepare_output(cfg, out, self.is_main)
        self.accelerator.wait_for_everyone()
        checkpoints = complete_checkpoints(out) if cfg.resume else []
        self.resume_step, self.resume_dir = checkpoints[-1] if checkpoints else (0, None)
        resume_dir = self.resume_dir
        self.state: dict = json.loads((resume_dir / STATE_FILE).read_text()) if resume_dir else {}
        if resume_dir:
            changed = [k for k in DATA_ORDER_FIELDS if self.state["config"].get(k) != getattr(cfg, k)]
            if self.state.get("world_size") != self.world:
                changed.append(f"number of processes ({self.state.get('world_size')} -> {self.world})")
            if changed:
                raise UserError(f"cannot resume from {resume_dir}: {', '.join(changed)} changed since it was written; "
                                "restore them or pass overwrite=true to start over")
            log.info("resuming from %s", resume_dir)

    def _setup_data(self) -> None:
        """Tokenizer, train sequences, held-out windows, the number of steps and the data order."""
        from transformers import AutoTokenizer

        cfg, world = self.cfg, self.world
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=False)
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"cannot load the tokenizer of the student {cfg.model} ({type(e).__name__}): pass a model "
                            "folder with its tokenizer (e.g. the output of mla-convert llama)") from None
        self.barrier = self.accelerator.wait_for_everyone if world > 1 else None  # fresh self text's, between processes
        self.train_seqs, self.eval_windows = prepare_data(cfg, self.tokenizer, world, str(self.device), self.is_main,
                                                          self.barrier)  # [N, T] or FreshSequences, [W, T_eval]
        self.fresh = isinstance(self.train_seqs, FreshSequences)
        self.report = report_windows(cfg, self.tokenizer)  # {name: [W, T_report]}
        self.tokens_per_step = cfg.seq_len * cfg.batch_size * cfg.grad_accum * world
        if cfg.max_steps is not None:
            self.total_steps = cfg.max_steps
        elif cfg.max_tokens is not None:
            self.total_steps = cfg.max_tokens // self.tokens_per_step
            if self.total_steps < 1:
                raise UserError(f"max_tokens={cfg.max_tokens} is less than one step of {self.tokens_per_step} tokens")
        elif self.fresh:
            self.total_steps = UNBOUNDED_STEPS  # max_seconds ends it
        else:
            self.total_steps = max(1, self.train_seqs.shape[0] // (cfg.batch_size * cfg.grad_accum * world))
        self.order = DataOrder(None if self.fresh else self.train_seqs.shape[0], cfg.batch_size, cfg.grad_accum, world,
                               cfg.seed)

    def _setup_models(self) -> None:
        """The student (from the resume checkpoint if any) with its trainable parameters, and the teacher if distilling."""
        cfg = self.cfg
        self.model = model = load_student(str(self.resume_dir) if self.resume_dir else cfg.model, DTYPES[cfg.dtype])
        select_trainable(model, cfg.train)
        self.n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # the room the run writes: a step_N checkpoint (the model, AdamW's two float32 moments) and final/ (the model)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.room = 2 * model_bytes + 8 * self.n_train
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        # a latent served in a block cache type: every forward reads the type's values, the gradient passes its
        # rounding straight through (kvquant.round_trip), so the run trains for the cache it will be served with
        self.cache_type = getattr(model.config, "latent_cache_type", None)
        self.teacher = None
        if cfg.kd_weight > 0:
            self.teacher = load_teacher(teacher_spec(cfg), torch_dtype(cfg.teacher_dtype, self.device)).to(self.device)
            t_vocab = self.teacher.get_output_embeddings().weight.shape[0]
            s_vocab = model.get_output_embeddings().weight.shape[0]
            if t_vocab != s_vocab:
                raise UserError(f"teacher vocabulary ({t_vocab}) differs from the student's ({s_vocab}): "
                                "distil only from the model the student was converted from")

    def _setup_optimizer(self) -> None:
        """AdamW + schedule, wrapped by accelerate; on a resume, their state (and the scaler's) from trainer/."""
        from accelerate.utils import DistributedType

        cfg, accelerator = self.cfg, self.accelerator
        params = [p for p in self.model.parameters() if p.requires_grad]
        fused = {"fused": True} if self.device.type == "cuda" else {}  # one kernel for all parameters on a GPU
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
        self.time_share = 0.0  # share of max_seconds spent, agreed by every process (set after each step)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, self.total_steps,
                                                                                lambda: self.time_share))
        self.model, self.optimizer = accelerator.prepare(self.model, optimizer)
        # FSDP replaces the parameters with sharded ones (and points the optimizer at them): clip and checksum those
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.fsdp = accelerator.distributed_type == DistributedType.FSDP
        for name, count in (("eval_windows", cfg.eval_windows), ("report_windows", cfg.report_windows)):
            if self.fsdp and count % self.world:
                raise UserError(f"under FSDP every process must run the same forwards: make {name} ({count}) "
                                f"a multiple of the {self.world} processes")
        if self.resume_dir:
            # The weights come from step_N/ itself (from_pretrained above); optimizer, schedule, RNG from trainer/.
            optim_state, scheduler_state, scaler_state = load_trainer_state(self.resume_dir / TRAINER_DIR, self.rank)
            if self.fsdp:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

                set_optimizer_state_dict(self.model, self.optimizer.optimizer, optim_state,
                                         options=StateDictOptions(full_state_dict=True))
            else:
                self.optimizer.load_state_dict(optim_state)
            self.scheduler.load_state_dict(scheduler_state)
            if scaler_state and accelerator.scaler is not None:
                accelerator.scaler.load_state_dict(scaler_state)

    def optimizer_state(self) -> dict:
        """The optimizer's full state (under FSDP gathered from the shards: a collective, call on every process)."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_optimizer_state_dict(self.model, self.optimizer.optimizer, options=full)
        return self.optimizer.state_dict()

    # ------------------------------------------------------------------------------------------------ steps

    def evaluate(self) -> dict:
        """Perplexity on the held-out windows (and on each report text), split over the processes."""
        self.model.eval()
        nll, tokens = self._nll(self.eval_windows)
        result = {"perplexity": math.exp(nll), "nll": nll, "eval_tokens": tokens}
        if self.report:
            result["report"] = {name: round(math.exp(self._nll(windows)[0]), 4) for name, windows in self.report.items()}
        self.model.train()
        return result

    def _nll(self, windows: torch.Tensor) -> tuple[float, int]:
        """(mean next-token nll, tokens scored) of the model on `windows` [W, T], the windows split over the processes."""
        from mla_convert import evaluate

        device, accelerator = self.device, self.accelerator
        mine = windows[self.rank :: self.world]  # [W_rank, T]
        nll_sum = torch.zeros(2, dtype=torch.float64, device=device)
        if mine.shape[0]:
            with accelerator.autocast():
                r = evaluate.perplexity(self.model, mine.reshape(-1), windows.shape[1], mine.shape[0], progress=False)
            nll_sum += torch.tensor([r["nll"] * r["tokens"], r["tokens"]], dtype=torch.float64, device=device)
        nll_sum = accelerator.reduce(nll_sum, reduction="sum")
        return (nll_sum[0] / nll_sum[1]).item(), int(nll_sum[1].item())

    def train_step(self, step: int) -> tuple[torch.Tensor, float, torch.Tensor | None]:
        """One optimizer step over grad_accum micro-batches. -> (per-process mean [loss, ce, kl] [world, 3], the
        learning rate used, the gradient norm before clipping or None)."""
        cfg, device, accelerator = self.cfg, self.device, self.accelerator
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, ce, kl over micro-batches
        if self.fresh:  # this step's text, sampled now if nobody has yet (the time counts toward max_seconds)
            self.train_seqs.prepare(self.order.last(step), self.barrier)
        for micro in range(cfg.grad_accum):
            ids = self.train_seqs[self.order.indices(step, micro, self.rank)].to(device)  # [B, T]
            sync = micro == cfg.grad_accum - 1
            with contextlib.nullcontext() if sync else accelerator.no_sync(self.model):
                loss, ce, kl = self._micro_step(ids)
            sums += torch.tensor([loss.item(), ce.item(), kl.item() if kl is not None else 0.0],
                                 dtype=torch.float64, device=device)
            del loss
        grad_norm = None
        if cfg.max_grad_norm > 0:
            grad_norm = accelerator.clip_grad_norm_(self.params, cfg.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        local = sums / cfg.grad_accum
        return accelerator.gather(local.unsqueeze(0)).cpu(), lr, grad_norm  # [world, 3]

    def _micro_step(self, ids: torch.Tensor):
        """Forward (teacher, then student), loss, backward on one micro-batch ids [B, T]. -> (loss, ce, kl or None)."""
        cfg = self.cfg
        kl = None
        if self.teacher is not None:
            t1 = time.perf_counter()
            with torch.no_grad():
                teacher_logits = self.teacher(input_ids=ids, use_cache=False).logits  # [B, T, V]
            self.teacher_s += time.perf_counter() - t1
        t1 = time.perf_counter()
        logits = self.model(input_ids=ids, use_cache=False).logits  # [B, T, V]
        ce = lm_loss(logits, ids)
        loss = ce
        if self.teacher is not None:
            kl = kd_loss(logits, teacher_logits, cfg.kd_temperature)
            loss = (1 - cfg.kd_weight) * ce + cfg.kd_weight * kl
            del teacher_logits
        self.accelerator.backward(loss / cfg.grad_accum)
        self.student_s += time.perf_counter() - t1
        del logits
        return loss, ce, kl

    def save(self, step: int) -> Path:
        """OUT/step_N: the loadable model, trainer/ state, and trainer_state.json last (marks it complete)."""
        cfg, accelerator, is_main = self.cfg, self.accelerator, self.is_main
        folder = self.out / f"step_{step}"
        if self.fresh and is_main:
            self.train_seqs.stream.flush()  # a resume from this checkpoint reads back the text sampled so far
        stage = staging_dir(folder)  # written under a hidden name, renamed into place once complete
        if is_main and stage.exists():
            shutil.rmtree(stage)  # an incomplete leftover of a killed run
        accelerator.wait_for_everyone()
        state_dict = accelerator.get_state_dict(self.model)  # full state dict on the main process (FSDP gathers)
        with removed_on_failure(stage, is_main):  # a full disk gets the room back
            if is_main:
                accelerator.unwrap_model(self.model).save_pretrained(stage, state_dict=state_dict)
                self.tokenizer.save_pretrained(stage)
            optim_state = self.optimizer_state() if self.fsdp or is_main else None  # FSDP: every process gathers
            save_trainer_state(stage / TRAINER_DIR, optim_state if is_main else None, self.scheduler,
                               accelerator.scaler, self.rank)
            del optim_state
            accelerator.wait_for_everyone()
            if is_main:
                record = {"step": step, "total_steps": self.total_steps, "tokens": step * self.tokens_per_step,
                          "elapsed_s": self.elapsed, "world_size": self.world, "config": dataclasses.asdict(cfg)}
                (stage / STATE_FILE).write_text(json.dumps(record, indent=1) + "\n")  # last: marks it complete
        if is_main:
            if folder.exists():
                shutil.rmtree(folder)  # a step_N of an older mla-convert that a killed run left incomplete
            os.replace(stage, folder)
            if cfg.keep_last_n:  # 0 keeps every checkpoint
                for _, old in complete_checkpoints(self.out)[: -cfg.keep_last_n]:
                    shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return folder

    # ------------------------------------------------------------------------------------------------- loop

    def train(self) -> Path:
        """The run after `setup`: step-0 eval (or its record on a resume), the steps, then `finish`. -> OUT/final."""
        cfg = self.cfg
        self.best = None  # keep_best: (held-out perplexity, step, copies of the trained parameters)
        if self.resume_step == 0:
            self.before = self.evaluate()
            self._remember(0, self.before)
            self.metrics.write(event="eval", step=0, tokens=0, **self.before)
            log.info("step 0: held-out perplexity %.3f%s", self.before["perplexity"], _reported(self.before))
        else:
            evals = [r for r in self.metrics.read() if r.get("event") == "eval" and r["step"] == 0] if self.is_main else []
            self.before = evals[0] if evals else None
        self.elapsed = float(self.state.get("elapsed_s", 0.0))
        self.stopped_for_time = False
        self._spend_time()  # a resumed run continues its schedule where the time budget left it
        crash_after = int(os.environ.get(CRASH_ENV, "0") or 0)
        self.model.train()
        for step in range(self.resume_step, self.total_steps):
            t0 = time.perf_counter()
            per_rank, lr, grad_norm = self.train_step(step)
            self.elapsed += time.perf_counter() - t0
            done = step + 1
            if not bool(torch.isfinite(per_rank).all()):  # every process holds every rank's losses: all stop here
                self._log_step(done, per_rank, lr, grad_norm)
                raise UserError(f"the loss is NaN or infinite at step {done}: the run diverged, and no final/ is "
                                "written; lower lr (or use dtype=float32) and run again")
            out_of_time = self._spend_time(done)
            if out_of_time:
                of = f" of {self.total_steps}" if self.total_steps < UNBOUNDED_STEPS else ""
                log.info("max_seconds=%g spent after %d%s steps: finishing", cfg.max_seconds, done, of)
                self.stopped_for_time, self.total_steps = True, done
            if done % cfg.log_every == 0 or done == self.total_steps:
                self._log_step(done, per_rank, lr, grad_norm)
            if cfg.eval_every and done % cfg.eval_every == 0 and done != self.total_steps:
                r = self.evaluate()
                self.metrics.write(event="eval", step=done, tokens=done * self.tokens_per_step, **r)
                log.info("step %d: held-out perplexity %.3f%s", done, r["perplexity"], _reported(r))
                self._remember(done, r)
            if cfg.save_every and done % cfg.save_every == 0 and done != self.total_steps:
                self.save(done)
            if crash_after and done == crash_after:
                self.accelerator.wait_for_everyone()
                log.warning("%s=%d: exiting as if killed", CRASH_ENV, crash_after)
                os._exit(17)
            if out_of_time:
                break
        return self.finish()

    def _remember(self, step: int, result: dict) -> None:
        """keep_best: copy the trained parameters (each process its own, FSDP shards included) when `result` is the
        best held-out perplexity so far."""
        if self.cfg.keep_best and (self.best is None or result["perplexity"] < self.best[0]):
            with torch.no_grad():
                self.best = (result["perplexity"], step, [p.detach().clone() for p in self.params])

    def _restore_best(self, last: dict) -> int:
        """keep_best: put back the best evaluation's parameters when it beat the last one (`last`). -> the step
        whose weights final/ holds."""
        if self.best is None or self.best[0] >= last["perplexity"]:
            return self.total_steps
        with torch.no_grad():
            for p, b in zip(self.params, self.best[2]):
                p.copy_(b)
        log.info("keep_best: final/ holds the weights of step %d (held-out perplexity %.3f, last %.3f)",
                 self.best[1], self.best[0], last["perplexity"])
        return self.best[1]

    def _spend_time(self, done: int = 0) -> bool:
        """With max_seconds: the share of it spent (the slowest process's, so that all agree) into self.time_share,
        which the schedule reads. -> whether it is spent, or would be by the end of one more step of the run's mean
        step time after `done` steps (so that a run ends near max_seconds rather than a step, or a batch of samples
        taken in it, past)."""
        if self.cfg.max_seconds is None:
            return False
        elapsed = torch.tensor([self.elapsed], dtype=torch.float64, device=self.device)
        slowest = self.accelerator.gather(elapsed).max().item()
        self.time_share = min(1.0, slowest / self.cfg.max_seconds)
        return slowest + (slowest / done if done else 0.0) > self.cfg.max_seconds

    def _log_step(self, done: int, per_rank: torch.Tensor, lr: float, grad_norm) -> None:
        mean = per_rank.mean(0)
        self.metrics.write(event="train", step=done, tokens=done * self.tokens_per_step, loss=mean[0].item(),
                           ce=mean[1].item(), kl=mean[2].item() if self.teacher is not None else None, lr=lr,
                           grad_norm=float(grad_norm) if grad_norm is not None else None,
                           elapsed_s=round(self.elapsed, 3), rank_losses=per_rank[:, 0].tolist())
        total = self.total_steps if self.total_steps < UNBOUNDED_STEPS else "?"
        log.info("step %d/%s  loss %.4f  ce %.4f  lr %.2e  %.1fs", done, total, mean[0], mean[1], lr, self.elapsed)

    # ----------------------------------------------------------------------------------------------- finish

    def finish(self) -> Path:
        """Final eval; OUT/final with metrics, plot, provenance and card (main process); frees the processes."""
        accelerator, device, out = self.accelerator, self.device, self.out
        if self.fresh:
            self.train_seqs.close()  # the last samples into the cache; the sampler's model freed
        after = self.evaluate()
        self.metrics.write(event="eval", step=self.total_steps, tokens=self.total_steps * self.tokens_per_step, **after)
        log.info("final held-out perplexity %.3f%s", after["perplexity"], _reported(after))
        self.kept_step = self._restore_best(after)
        if self.kept_step != self.total_steps:
            after = self.evaluate()  # what final/ holds, scored again

        # Both ranks must hold the same weights: compare a checksum of the trained parameters.
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.params]  # FSDP2: gather the shards
        checksum = torch.tensor([sum(p.detach().double().sum().item() for p in full)], dtype=torch.float64, device=device)
        checksums = accelerator.gather(checksum).cpu().tolist()
        peak = accelerator.gather(torch.tensor([peak_memory_bytes(device)], device=device)).cpu().tolist()
        timing = accelerator.gather(torch.tensor([[self.teacher_s, self.student_s]], dtype=torch.float64,
                                                 device=device)).cpu()  # [world, 2]
        final = out / FINAL_DIR
        state_dict = accelerator.get_state_dict(self.model)
        if self.is_main:
            # written under a hidden name with provenance.json last, renamed into place only then: a run killed
            # (or out of disk) on the way leaves no final/ that looks complete
            stage = staging_dir(final)
            if stage.exists():
                shutil.rmtree(stage)
            with removed_on_failure(stage):  # a full disk gets the room back
                accelerator.unwrap_model(self.model).save_pretrained(stage, state_dict=state_dict)
                self.tokenizer.save_pretrained(stage)
                records = self.metrics.read()
                plot(records, out / PLOT_FILE)
                shutil.copy(out / PLOT_FILE, stage / PLOT_FILE)
                shutil.copy(out / METRICS_FILE, stage / METRICS_FILE)
                self._write_provenance(stage, records, after, checksums, peak, timing)
            if final.exists():
                shutil.rmtree(final)  # an incomplete final/ of an older mla-convert
            os.replace(stage, final)
            if len(set(checksums)) != 1:
                log.error("processes disagree on the trained weights: checksums %s", checksums)
        accelerator.wait_for_everyone()
        # Free the DDP wrapper while every process is still here: its Reducer holds the process group, and when it was
        # freed only on return, after end_training and after a peer had exited, ~ProcessGroupGloo hung (seen in the
        # 2-process test under load: rank 0 idle in the destructor, py-spy).
        del self.model, self.optimizer, state_dict
        accelerator.free_memory()
        gc.collect()
        accelerator.wait_for_everyone()
        accelerator.end_training()
        return final

    def _write_provenance(self, final: Path, records: list[dict], after: dict, checksums, peak, timing) -> None:
        """final/provenance.json (with the run's measurements) and final/README.md."""
        from mla_convert import provenance
        from mla_convert.card import write_model_card

        cfg, teacher, before = self.cfg, self.teacher, self.before
        train_records = [r for r in records if r.get("event") == "train"]
        parent = provenance.load(cfg.model) if Path(cfg.model).is_dir() else None
        measurement = {
            "steps": self.total_steps,
            "tokens": self.total_steps * self.tokens_per_step,
            "processes": self.world,
            "device": self.device.type,
            "mixed_precision": self.mp,
            "seconds": round(self.elapsed, 1),
            "stopped_for_time": self.stopped_for_time,
            "kept_step": self.kept_step,  # the step whose weights final/ holds (keep_best), else the last
            "teacher_forward_seconds_per_process": [round(float(t), 1) for t in timing[:, 0]] if teacher else None,
            "student_seconds_per_process": [round(float(t), 1) for t in timing[:, 1]],
            "peak_memory_bytes_per_process": peak,
            "trainable_parameters": self.n_train,
            "loss_first": train_records[0]["loss"] if train_records else None,
            "loss_last": train_records[-1]["loss"] if train_records else None,
            "held_out_perplexity_before": before["perplexity"] if before else None,
            "held_out_perplexity_after": after["perplexity"],
            "tokens_per_second": round(self.total_steps * self.tokens_per_step / max(self.elapsed, 1e-9), 1),
            "report_perplexity_before": before.get("report") if before else None,
            "report_perplexity_after": after.get("report"),
            "report_protocol": (f"{cfg.report_windows} x {cfg.report_seq_len}-token windows, mixed precision "
                                f"{self.mp}" if self.report else None),
            "held_out_protocol": (f"{cfg.eval_windows} x {cfg.eval_seq_len}-token windows of "
                                  f"{cfg.eval_data or 'the held-out tail of ' + cfg.data}"),
            "parameter_checksums_per_process": checksums,
        }
        if self.fresh:  # the loop as run: the sampler's rate against the trainer's (main process, which samples)
            stream = self.train_seqs.stream
            train_s = max(self.elapsed - stream.seconds, 1e-9)
            measurement["fresh_self_text"] = {
                "sampled_tokens": stream.sampled,
                "sampling_seconds": round(stream.seconds, 1),
                "sampler_tokens_per_second": round(stream.sampled / stream.seconds, 1) if stream.seconds else None,
                "trainer_tokens_per_second": round(self.total_steps * self.tokens_per_step / train_s, 1),
            }
        loss = "distillation" if cfg.kd_weight == 1 else "LM" if cfg.kd_weight == 0 else "LM + distillation"
        through = f", through the {self.cache_type} latent cache's rounding" if self.cache_type else ""
        record = provenance.new(
            "finetune",
            source=(parent or {}).get("source") or {"model": cfg.model},
            method=f"fine-tune ({loss}, train={cfg.train}{through})",
            options={**dataclasses.asdict(cfg), "teacher_resolved": teacher_spec(cfg) if teacher else None},
            kv_cache=(parent or {}).get("kv_cache"),
            measurements={"finetune": measurement},
            seed=cfg.seed,
            parent=parent,
        )
        provenance.save(final, record)
        write_model_card(final)


def _reported(result: dict) -> str:
    """The report texts' perplexities of an evaluation, for its log line ("" without report_data)."""
    report = result.get("report") or {}
    return "".join(f"; {name} {ppl:.3f}" for name, ppl in report.items())


def run(cfg: FinetuneConfig) -> Path:
    """Train as configured (in every process of an accelerate launch); returns OUT/final."""
    import mla_convert  # noqa: F401  (registers the MLA model)

    trainer = Trainer(cfg)
    try:
        trainer.setup()
        with room_for(trainer.out, trainer.room, "the fine-tuning run in"):  # a disk that fills while it writes
            return trainer.train()
    except UserError:
        if getattr(trainer, "_created_out", False) and trainer._lock is not None:
            with contextlib.suppress(OSError):  # only while it is still empty (rmdir refuses otherwise)
                trainer.out.rmdir()
        raise
    finally:
        if getattr(trainer, "_lock", None) is not None:  # the run folder's lock (main process)
            os.close(trainer._lock)
            trainer._lock = None
