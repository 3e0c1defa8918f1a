"""The conversion driver: resolve the options and the plan, then one decoder layer at a time (calibration statistics,
the per-layer method, refinement, the resume store), the model stage, and the shards, config, provenance and card.

Two public steps: `prepare` (options -> one `Prepared`: the family, the target's rules, `resolve`: the options as they
run and the plan) and `run` (the prepared conversion -> the output folder); `convert` is the two in one call.
Phases of `run`: setup (`Conversion.__init__`: device, RoPE, calibration stream), statistics
(`Conversion.allocate_ranks`, with the energy allocation), layers (`Conversion.convert_layers`), the model stage
(`Conversion.train_model`) and the write (`Conversion.write`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mla_convert import provenance, rope
from mla_convert.card import write_model_card
from mla_convert.outputs import SHARD_BYTES, ShardedWriter, kept_file_intact, resume_dir, staged_output
from mla_convert.sources import Source
from mla_convert.writes import check_room, room_for
from mla_convert.conversion import estimates, refine_layer, selftext, store, workers
from mla_convert.conversion.method import convert_attention, layer_spectrum
from mla_convert.conversion.modules import (attention_tensors, converted_decoder_layer, float32_on, gemma_fields,
                                            mla_config, other_tensor_names, raw_layer, source_decoder_layer)
from mla_convert.conversion.options import (ConvertOptions, as_planned, describe_method, needs_attention_profile,
                                            needs_attention_statistics, needs_statistics, resolve_allocation,
                                            without_calibration)
from mla_convert.conversion import target as target_rules
from mla_convert.conversion.plan import ROOM_COPIES, Geometry, Plan, allocate, make_geometry, max_rank, output_bytes
from mla_convert.conversion.stages import model_stage, refined_layer
from mla_convert.dtypes import DTYPES
from mla_convert.errors import UserError
from mla_convert.families import Family, family_for

log = logging.getLogger(__name__)

ATTENDED_EVERY = 4  # attended-input statistics on every 4th block of calibration queries (they cost a [T, T] x [T, D])
# The statistics pass keeps each layer's statistics for the conversion pass (which would take the same ones again from
# the same source stream) while they add up to at most this: a small model's (SmolLM2-135M: about 3 MB a layer), not an
# 8B model's (about 1.3 GB a layer).
KEEP_STATISTICS_BYTES = 1 << 30
REBASE_WINDOWS = 4  # calibration windows the balanced latent basis is fitted on (as `mla-convert rebase`'s default)


def resolve_device(device: str) -> str:
    """--device: cpu, cuda, cuda:N, or auto (cuda when this torch sees a CUDA device, else cpu). A UserError names
    the fix for a device this machine lacks."""
    from mla_convert.evaluate import check_device

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if check_device(device).startswith("mps"):
        raise UserError("--device mps: the factorization needs float64, which MPS lacks: use --device cpu or cuda")
    return device


class LayerClock:
    """Seconds each layer spends calibrating (statistics, forwards) and factorizing, shown beside the progress bar's
    ETA and logged (-v). A CUDA device is synchronized at each lap so its queued work is counted where it ran."""

    def __init__(self, device: torch.device):
        import time

        self.device, self.time = device, time.perf_counter
        self.seconds: dict[str, float] = {}
        self.last = self.time()

    def lap(self, what: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = self.time()
        self.seconds[what] = self.seconds.get(what, 0.0) + now - self.last
        self.last = now

    def report(self, bar, layer: int, phase: str = "") -> None:
        text = ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items())
        bar.set_postfix_str(text, refresh=False)
        log.info("%slayer %d: %s", phase, layer, text)


@dataclass
class RunRecord:
    """What a run decided and measured as it went, apart from the plan: each layer's RoPE pairs, the nope score energy
    kept, the layer refinement's and the model stage's records (provenance.json's "plan" section)."""

    rope_pairs: list[list[int]]
    nope_kept: list = field(default_factory=list)
    refine: list = field(default_factory=list)
    refine_model: dict = field(default_factory=dict)

    def add(self, layer_record: dict) -> None:
        """One layer's record (its nope energy kept, its refinement's), in layer order: from the layer just
        converted, or from a kept layer's file when resuming."""
        if layer_record.get("nope_kept") is not None:
            self.nope_kept.append(layer_record["nope_kept"])
        if layer_record.get("refine") is not None:
            self.refine.append(layer_record["refine"])

    def provenance(self, plan: Plan) -> dict:
        """The record, layers in order (layers refined in worker processes finish in any order)."""
        def by_layer(rows: list) -> list:
            return sorted(rows, key=lambda row: row["layer"])

        return {"ranks": plan.kv_lora_rank, "rope_dims": plan.rope_dims, "nope_dims": plan.nope_dims,
                "nope_kept": by_layer(self.nope_kept), "rope_pairs": self.rope_pairs, "refine": by_layer(self.refine),
                "refine_model": self.refine_model}


def resolve(source: Source, family: Family, options: ConvertOptions) -> tuple[ConvertOptions, Plan]:
    """The options as they will run (defaults that depend on the source or the cache kept filled in: what provenance
    records) and the whole plan (`make_plan`)."""
    options = resolve_allocation(without_calibration(options))
    if options.factorization == "split" and options.value_inputs == "attended" and not options.latent_rounds:
        # the attended refit fits values in the whole latent, which a split factorization keeps for keys and values
        # apart: record what runs
        log.info("--factorization split: values keep their per-token fit (--value-inputs token)")
        options = dataclasses.replace(options, value_inputs="token")
    plan = make_plan(source, family, options)
    return as_planned(options, plan), plan


def make_plan(source: Source, family: Family, options: ConvertOptions) -> Plan:
    """The whole plan, made once: the geometry (`plan.make_geometry`: the checks, shapes, cache and memory), then each
    stage as it will run on this machine with its time estimate (`plan_stages`; nothing heavy, nothing written)."""
    geometry = make_geometry(source, family, options)
    shape = {f.name: getattr(geometry, f.name) for f in dataclasses.fields(Geometry)}
    return Plan(**shape, **plan_stages(source, geometry, options))


def plan_stages(source: Source, geometry: Geometry, options: ConvertOptions) -> dict:
    """The stages of a conversion of `geometry` as they will run, `Plan`'s fields beyond the geometry: the self
    text's temperature and its sampling time; the layer refinement's window, precision, positions, steps, workers and
    time; the model stage's steps, rate and time; the calibration forwards' time. Each auto (None) option resolved
    here, from the cache kept, the device and the estimates (conversion.estimates, .refine_layer and .workers)."""
    temperature = options.calib_temperature
    if temperature is None:
        temperature = selftext.calib_temperature(geometry.ratio)
    window = min(options.refine_seq_len, options.calib_seq_len)  # the refinement windows are calibration windows
    precision = refine_layer.resolve_precision(options.refine_precision, options.device, geometry.hidden)
    rate = estimates.cpu_rate(precision)
    queries = estimates.resolve_queries(options.refine_queries, window, geometry.ratio, options.device)
    steps = (estimates.resolve_steps(options.refine_steps, geometry, options.device, window, rate, queries)
             if options.calib_data else 0)
    seconds = estimates.estimate_seconds(geometry, steps, window, rate, queries)
    processes = workers.resolve_workers(options.refine_workers, options.device, steps, options.calib_propagate,
                                        geometry.layers, seconds)
    if processes > 1:
        seconds /= workers.speedup(queries)
    model_rate = estimates.cpu_rate(precision, model_stage=True)
    distils = (options.calib_data and options.calib_propagate == "source"
               and (needs_statistics(options) or steps > 0))  # a calibration stream runs (refined layers need one)
    model_steps = (estimates.resolve_model_steps(options.refine_model_steps, geometry, options.device, window, model_rate)
                   if distils else 0)
    return dict(
        refine_steps=steps, refine_queries=queries, refine_workers=processes, refine_seconds=seconds,
        refine_precision=precision, refine_seq_len=window, refine_model_steps=model_steps,
        refine_model_seconds=estimates.estimate_model_seconds(geometry, model_steps, window, model_rate),
        refine_model_scope=options.refine_model_scope,
        refine_model_lr=estimates.resolve_model_lr(options.refine_model_lr, model_steps), calib_temperature=temperature,
        calibration_seconds=estimates.calibration_seconds(geometry, options.rank_allocation == "energy"),
        sample_seconds=_sample_seconds(source, geometry, options, temperature),
    )


def _sample_seconds(source: Source, geometry: Geometry, options: ConvertOptions, temperature: float) -> float:
    """The time on this CPU to sample the self text the cache lacks (0 without calibration text)."""
    if not options.calib_data:
        return 0.0
    from mla_convert.conversion.calibration import self_tokens_to_sample

    device = resolve_device(options.device)
    to_sample = self_tokens_to_sample(source, options.calib_data, geometry.memory["samples"], options.calib_seq_len,
                                      options.seed, temperature=temperature, sample_tokens=options.calib_sample_tokens,
                                      device=device)
    bf16 = selftext.sampling_dtype(source, device) == torch.bfloat16
    document = options.calib_data == selftext.SELF_DOC
    width = selftext.default_batch(device, document)
    length = options.calib_seq_len if document else options.calib_sample_tokens
    prompt, shared = selftext.prompt_tokens(source.tokenizer()) if to_sample and not document else (0.0, 0)
    return estimates.sample_seconds(source.config, to_sample, width, bf16, length, document, prompt, shared)


@dataclass
class Prepared:
    """A conversion decided before any work (`prepare`): the source and its family, the options as they will run, the
    plan, the target, and what the target's resolution chose (`notes`) or warns of (`warnings`), for the caller to
    say."""

    source: Source
    family: Family
    options: ConvertOptions
    plan: Plan
    target: str = "native"
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return self.plan.describe(self.target)


def prepare(source: Source, options: ConvertOptions, family_name: str | None = None, *, target: str = "native",
            format: str = "native", explicit: frozenset[str] | set[str] = frozenset()) -> Prepared:
    """The conversion's first step: the family, the source's shapes, the options resolved for `target` (native or
    deepseek; `format` is the export that follows, deepseek or gguf, whose limits are checked now), the defaults and
    the plan, each once. `explicit` names the options the user set (the target keeps them or refuses). Nothing heavy,
    nothing written: `--dry-run` prints `Prepared.describe()`."""
    from mla_convert.validate import check_source_shapes

    family = family_for(source.config, family_name)
    warnings = target_rules.check_source(family, source.config, target, options.qk_norm)
    options, notes = target_rules.target_options(source.config, family, options, target, format, explicit)
    check_source_shapes(source, family)  # every tensor present, of the config's shape: before the plan
    options, plan = resolve(source, family, options)
    target_rules.check_plan(plan, format)
    return Prepared(source, family, options, plan, target, notes, warnings)


def run(prepared: Prepared, out: Path, *, overwrite: bool = False, progress: bool = True) -> Path:
    """The conversion's second step: the prepared conversion written as a native MLA checkpoint at `out` (staged,
    resumable, moved into place whole). Returns `out`."""
    from mla_convert.validate import check_source_finite

    source, family, options, plan = prepared.source, prepared.family, prepared.options, prepared.plan
    check_source_finite(source, family)  # before any work: a NaN or inf weight would convert into a broken output
    source.tokenizer()  # read even without calibration text: a broken tokenizer is refused, not copied into the output
    run = Conversion(source, family, options, plan, progress)
    inputs = (Path(source.origin),) if Path(source.origin).exists() else ()  # the folder or the .gguf file read
    needed = ROOM_COPIES * output_bytes(source.config, plan)
    # before the staging folder and the calibration forwards
    check_room(Path(out), needed, "the checkpoint and the layers kept for a resume")
    # the disk may still fill while the run writes (another program writes there too): one line, the layers kept
    with room_for(out, needed, "the conversion to"), \
            staged_output(out, overwrite, inputs, fingerprint=store.fingerprint(source, options, plan)) as stage:
        run.kept = resume_dir(stage)  # one file per converted layer: what a killed run keeps for the next one
        if options.rank_allocation == "energy":
            run.allocate_ranks()
        run.convert_layers()
        trained = run.train_model()
        run.write(stage, trained)
    log.info("wrote %s", out)
    return Path(out)


def convert(
    source: Source,
    out: Path,
    options: ConvertOptions,
    family_name: str | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    progress: bool = True,
) -> Plan:
    """Convert `source` into a native MLA checkpoint at `out` (`prepare`, then `run`); returns the plan as it ran.
    With `dry_run`, only prepare and return the plan."""
    prepared = prepare(source, options, family_name)
    if not dry_run:
        run(prepared, out, overwrite=overwrite, progress=progress)
    return prepared.plan


class Conversion:
    """One conversion's state between its phases: the source, the resolved options and plan, the device, each layer's
    RoPE, the calibration stream (`runner`: None without calibration text) and the resume folder (`kept`)."""

    def __init__(self, source: Source, family: Family, options: ConvertOptions, plan: Plan, progress: bool):
        self.source, self.family, self.options, self.plan, self.progress = source, family, options, plan, progress
        self.config = config = source.config
        # calibration runs source layers causally (statistics.layer_mask); eager where sdpa would drop the source's
        # score soft-capping (Gemma 2)
        config._attn_implementation = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
        # each layer's RoPE (Gemma 3: a base per layer type)
        self.frequencies = [rope.source_frequencies(rope.rope_config(config, rope.layer_type(config, i)))
                            for i in range(plan.layers)]
        self.device = torch.device(resolve_device(options.device))
        torch.manual_seed(options.seed)
        # the calibration text and tokenizer are read before anything is staged: their errors come first
        self.runner = self.new_runner() if needs_statistics(options) and options.calib_data else None
        self.record = RunRecord([[0] * (plan.rope_dims // 2) for _ in range(plan.layers)])
        self.kept: Path | None = None
        self.statistics: dict[int, tuple] = {}  # layer -> statistics the statistics pass kept for the conversion pass
        self.hidden: dict[int, torch.Tensor] = {}  # layer -> the source stream's hidden states after it (same pass)
        self.waiting: dict[int, tuple] = {}  # layer -> (prefix, tensors, record) while a worker refines it

    def new_runner(self):
        """A calibration stream at the embeddings, on the device (its hidden states stay there for the whole run)."""
        return calibration_runner(self.source, self.options).to(self.device)

    def bar(self, desc: str):
        from tqdm.auto import tqdm

        return tqdm(range(self.plan.layers), desc=desc, disable=not self.progress, unit="layer")

    def layer_inputs(self, i: int):
        """(prefix, the layer's tensors, its attention tensors, the source layer module or None, statistics =
        (cov, phase, attended, keyed)): the statistics taken at the runner's current hidden states (or those the
        statistics pass kept for layer i, taken at the same hidden states)."""
        options, device = self.options, self.device
        prefix = self.family.layer_prefix.format(i=i)
        layer_tensors = raw_layer(self.source, i, self.family)  # in the source's dtype: most of them pass through
        attn = float32_on(attention_tensors(layer_tensors, self.family, i, prefix, self.plan.qk_norm), device)
        source_layer = cov = phase = attended = keyed = None
        if self.runner is not None:
            from mla_convert.conversion.statistics import second_moment

            source_layer = source_decoder_layer(self.config, self.family, i, float32_on(layer_tensors, device))
            if i in self.statistics:
                statistics = tuple(None if t is None else t.to(device) for t in self.statistics.pop(i))
                return prefix, layer_tensors, attn, source_layer, statistics
            with torch.device(device):  # factory calls (eye, zeros, ones) land beside their inputs
                cov = second_moment(self.runner.attention_input(source_layer))
                if needs_attention_statistics(options):
                    every = ATTENDED_EVERY if options.value_inputs == "attended" else 0
                    profile, attended, keyed = self.runner.attention_statistics(source_layer, attended_every=every)
                    if needs_attention_profile(options):
                        phase = rope.attention_phases(profile, self.frequencies[i][0].to(device))
                    keyed = keyed if options.key_inputs == "attended" else None
        return prefix, layer_tensors, attn, source_layer, (cov, phase, attended, keyed)

    def allocate_ranks(self) -> None:
        """The statistics pass of the energy allocation: every layer's spectrum first (on the source's activations),
        then the ranks. The conversion pass takes the statistics again from a second calibration stream, so memory
        does not grow with depth, except those kept here (`KEEP_STATISTICS_BYTES`) where that stream is the source's
        too: the same hidden states, the same statistics."""
        plan, spectra, room = self.plan, [], KEEP_STATISTICS_BYTES if self.options.calib_propagate == "source" else 0
        keep_hidden = self.runner is not None and self.plan.memory.get("kept_hidden", 0) > 0  # plan.KEEP_HIDDEN_BYTES
        bar = self.bar("layers: statistics")
        for i in bar:
            clock = LayerClock(self.device)
            _, _, attn, source_layer, statistics = self.layer_inputs(i)
            clock.lap("calibration")
            with torch.device(self.device):
                spectra.append(layer_spectrum(attn, plan, self.options, self.frequencies[i][1], *statistics).cpu())
            size = sum(t.numel() * t.element_size() for t in statistics if t is not None)
            if self.runner is not None and size <= room:
                self.statistics[i], room = tuple(None if t is None else t.cpu() for t in statistics), room - size
            del attn, statistics
            if self.runner is not None:
                self.runner.advance(source_layer)
                if keep_hidden:
                    self.hidden[i] = self.runner.hidden.cpu().clone()
            clock.lap("factorization")
            clock.report(bar, i, "statistics pass, ")
        self.runner = self.new_runner() if self.runner is not None else None
        plan.set_kv_lora_rank(allocate(plan, spectra, max_rank(self.config)))
        log.info("rank allocation (energy): %s", plan.kv_lora_rank)

    def convert_layers(self) -> None:
        """Every layer converted (or passed over where an earlier run kept it), each kept in the resume folder."""
        kept, plan = self.kept, self.plan
        done = {i for i in range(plan.layers) if kept_file_intact(kept / store.layer_file(i))}
        if done:
            log.warning("resuming in %s: %d of %d layers were converted already", kept.parent, len(done), plan.layers)
        if needs_statistics(self.options) and self.runner is None:
            log.warning("no calibration data: RoPE selection and factorization use weight-only statistics")
        skip_through = -1  # layers up to this one need no calibration forward: their output activations are kept
        bar = self.bar("layers: convert")
        processes = self.options.refine_workers if self.runner is not None and len(done) < plan.layers else 1
        with (workers.RefinePool(processes, self.refined) if processes > 1 else contextlib.nullcontext()) as pool:
            for i in bar:
                bar.set_description(f"({i + 1}/{plan.layers}) layers: convert")
                if i in done:
                    skip_through = self.pass_kept_layer(i, done, skip_through)
                else:
                    self.convert_layer(i, bar, pool)

    def pass_kept_layer(self, i: int, done: set[int], skip_through: int) -> int:
        """A layer converted by an earlier run: only carry the calibration activations past it (from the kept
        activations where they reach past it). Returns the last layer whose output activations were kept."""
        kept, runner, record = self.kept, self.runner, self.record
        prefix = self.family.layer_prefix.format(i=i)
        hidden = self.hidden.pop(i, None)  # the statistics pass's hidden states after layer i, if it kept them
        record.rope_pairs[i], layer_record = store.read_layer_meta(kept / store.layer_file(i))
        record.add(layer_record)
        if runner is not None and i == 0:
            past = store.read_activations(kept)  # the hidden states after the last layer a run finished, if kept
            if past is not None and all(j in done for j in range(past[0] + 1)):
                skip_through, runner.hidden = past[0], past[1].to(self.device)
        if runner is not None and i > skip_through:
            if self.options.calib_propagate == "converted":  # the layer as kept (its MLP too, if refined)
                kept_tensors = {n[len(prefix) :]: t.to(self.device)
                                for n, t in store.read_layer(kept / store.layer_file(i)).items()}
                mla_tensors = {n[len("self_attn.") :]: t for n, t in kept_tensors.items() if n.startswith("self_attn.")}
                runner.advance(converted_decoder_layer(self.config, self.plan, self.family, record.rope_pairs, i,
                                                       kept_tensors, mla_tensors))
            elif hidden is not None:
                runner.hidden = hidden.to(self.device)
            else:
                runner.advance(source_decoder_layer(self.config, self.family, i,
                                                    float32_on(raw_layer(self.source, i, self.family), self.device)))
        return skip_through

    def convert_layer(self, i: int, bar, pool: workers.RefinePool | None = None) -> None:
        """Layer i: statistics, the per-layer method, refinement where it runs (on one of `pool`'s workers, which
        hands the layer to `refined`), kept in the resume folder; the calibration stream advanced past it."""
        options, plan, device, runner, record = self.options, self.plan, self.device, self.runner, self.record
        clock = LayerClock(device)
        prefix, layer_tensors, attn, source_layer, statistics = self.layer_inputs(i)
        targets = None
        refining = runner is not None and options.refine_steps > 0
        # the whole layer along the source's stream: its update is what the advance below computes anyway
        from_advance = refining and options.refine_scope == "layer" and options.calib_propagate == "source"
        if refining and not from_advance:  # on the stream the runner carries
            targets = refine_layer.stream_targets(source_layer, runner, options.refine_scope)
        if runner is not None and options.calib_propagate == "source":
            inputs = runner.hidden
            if i in self.hidden:  # the statistics pass's: the same layer on the same hidden states
                runner.hidden = self.hidden.pop(i).to(device)
            else:
                runner.advance(source_layer)  # now, so that its float32 copy is gone before the factorization
            source_layer = None
            if from_advance:
                targets = (inputs, runner.hidden - inputs)  # = refine_layer.stream_targets(..., "layer")
            del inputs
        clock.lap("calibration")
        with torch.device(device):
            mla_tensors, record.rope_pairs[i], nope_kept = convert_attention(attn, plan, i, options,
                                                                             self.frequencies[i][1], *statistics)
        layer_record = {"nope_kept": None if nope_kept is None else {"layer": i, "kept": round(nope_kept, 6)}}
        clock.lap("factorization")
        if targets is not None:
            job = (self.config, plan, self.family, record.rope_pairs, i, layer_tensors, mla_tensors, targets,
                   runner.embeddings_at(i), options, device)
            targets = None
            self.waiting[i] = (prefix, layer_tensors, layer_record)
            if pool is not None:
                pool.submit(i, job)
            else:
                mla_tensors = self.refined(i, refined_layer(*job))
            del job
            clock.lap("refine" if pool is None else "sent to a worker")  # a worker's refinement logs its own time
        else:
            record.add(layer_record)
            self.keep_layer(i, prefix, layer_tensors, mla_tensors, layer_record)
        if runner is not None:
            if options.calib_propagate == "converted":
                runner.advance(converted_decoder_layer(self.config, plan, self.family, record.rope_pairs, i,
                                                       float32_on(layer_tensors, device), mla_tensors))
            if i < plan.layers - 1 or options.refine_model_steps:  # the model stage reads the last ones
                store.write_activations(self.kept, i, runner.hidden.cpu())
            clock.lap("calibration")
        clock.report(bar, i)

    def refined(self, i: int, result: tuple) -> dict[str, torch.Tensor]:
        """Layer i after `refined_layer` (its `result`; the rest of the layer is what `waiting` holds for it), kept
        in the resume folder. Returns its refined attention tensors."""
        prefix, layer_tensors, layer_record = self.waiting.pop(i)
        mla_tensors, trained, layer_record["refine"] = result
        layer_tensors.update(trained)  # the MLP and norms, where the whole layer was trained and kept
        self.record.add(layer_record)
        self.keep_layer(i, prefix, layer_tensors, mla_tensors, layer_record)
        return mla_tensors

    def keep_layer(self, i: int, prefix: str, layer_tensors: dict, mla_tensors: dict, layer_record: dict) -> None:
        """Layer i's output tensors into the resume folder. Unchanged tensors (MLP, norms, unless refined with the
        layer) go out as read, in the source's dtype: never through float32. Kept in the output dtype (the cast the
        shards would make anyway), in float32 when the converted layers carry the calibration activations on (they
        ran in float32)."""
        kept_dtype = torch.float32 if self.options.calib_propagate == "converted" else DTYPES[self.plan.dtype]
        out_tensors = {prefix + n: t for n, t in layer_tensors.items() if not n.startswith("self_attn.")}
        out_tensors.update({f"{prefix}self_attn.{n}": t.cpu() for n, t in mla_tensors.items()})
        store.write_layer(self.kept / store.layer_file(i), out_tensors, self.record.rope_pairs[i], kept_dtype,
                          layer_record)

    def train_model(self) -> dict[str, torch.Tensor]:
        """The model stage where it runs: the trained attention tensors, which replace the kept layers' in the
        shards ({} otherwise). The calibration stream is released after it."""
        trained = {}
        if self.runner is not None and self.options.refine_model_steps:
            trained, self.record.refine_model = model_stage(self.source, self.config, self.plan, self.family,
                                                            self.record.rope_pairs, self.runner, self.kept,
                                                            self.options, self.device)
        self.runner = None
        return trained

    def write(self, stage: Path, trained: dict[str, torch.Tensor]) -> None:
        """The shards (the source's other tensors, then each layer's as kept: a resumed run writes the same bytes),
        the MLA config, the tokenizer files, provenance.json and the model card."""
        source, plan, options, config = self.source, self.plan, self.options, self.config
        writer = ShardedWriter(stage, DTYPES[plan.dtype], SHARD_BYTES)
        for name in other_tensor_names(source, self.family):
            writer.add(name, source.get_raw(name))  # as stored: cast only when --dtype differs
        for i in range(plan.layers):
            for name, tensor in store.read_layer(self.kept / store.layer_file(i)).items():
                writer.add(name, trained.get(name, tensor))
        writer.finalize()
        mla_config(config, plan, self.family, self.record.rope_pairs, plan.dtype).save_pretrained(stage)
        if plan.latent_basis() != "native":
            self.rebase(stage)
        copied = source.copy_aux_files(stage)
        record = provenance.new(
            "convert",
            source={
                "model": source.origin,
                "revision": source.revision,
                "family": self.family.name,
                "model_type": config.model_type,
                "license": source.license(),
                "base_model": source.base_model() or (source.origin if not Path(source.origin).exists() else None),
            },
            method=describe_method(options),
            options=dataclasses.asdict(options),
            kv_cache=plan.kv_cache_record(),
            plan=self.record.provenance(plan),
            seed=options.seed,
            copied_files=copied,
        )
        provenance.save(stage, record)
        write_model_card(stage)


    def rebase(self, stage: Path) -> None:
        """The latent in the basis its block cache type holds best (`latent_basis.rebase_in_place`), fitted on the
        first REBASE_WINDOWS calibration windows (a seeded rotation without calibration text)."""
        from mla_convert.conversion.calibration import calibration_tokens
        from mla_convert.latent_basis import rebase_in_place

        options, windows = self.options, None
        if self.plan.latent_basis() == "balanced":
            windows = calibration_tokens(self.source, options.calib_data, min(REBASE_WINDOWS, self.plan.memory["samples"]),
                                         options.calib_seq_len, options.seed, temperature=options.calib_temperature,
                                         sample_tokens=options.calib_sample_tokens, echo=options.calib_echo)
        error = rebase_in_place(stage, windows)
        log.info("latent basis %s for the %s cache (largest logit change %.2e of the largest logit)",
                 self.plan.latent_basis(), self.plan.latent_cache_type, error)


def calibration_runner(source: Source, options: ConvertOptions):
    from mla_convert.conversion.calibration import calibration_tokens
    from mla_convert.conversion.statistics import LayerRunner, advance_batch

    device = resolve_device(options.device)
    tokens = calibration_tokens(source, options.calib_data, options.calib_samples, options.calib_seq_len, options.seed,
                                temperature=options.calib_temperature, sample_tokens=options.calib_sample_tokens,
                                device=device, echo=options.calib_echo)
    embed = source.get_raw("model.embed_tokens.weight")  # rows are looked up, then made float32: no float32 table
    family = family_for(source.config)
    embed_scale = gemma_fields(source.config, None)["embed_scale"] if family.gemma(source.config) else None
    return LayerRunner(source.config, embed, tokens, batch=advance_batch(device), embed_scale=embed_scale)
