"""The conversion's two training stages as the pipeline runs them: `refined_layer` (one layer: built from its
converted tensors, trained by `refine_layer.refine_module`) and `model_stage` (the whole converted model, built from
the source's other tensors and the kept layers, trained by `model_stage.refine_model`, its result kept in the resume
folder). They assemble the layers and the model (`modules`, `store`), which read the plan; the training code they call
is below the plan (`estimates` reads its sizes), so it stays apart from them."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

from mla_convert.conversion.model_stage import MODEL_STAGE_FILE, model_parameter_names, refine_model
from mla_convert.conversion.modules import converted_decoder_layer, mla_config, other_tensor_names
from mla_convert.conversion.options import ConvertOptions
from mla_convert.conversion.plan import Plan
from mla_convert.conversion.refine_layer import REFINED_LINE, attention_output, layer_update, refine_module
from mla_convert.conversion.store import layer_file, read_layer
from mla_convert.families import Family
from mla_convert.outputs import kept_file_intact, seal_kept_file
from mla_convert.sources import Source
from mla_convert.writes import save_tensors

log = logging.getLogger(__name__)


def refined_layer(config, plan, family, rope_pairs, i, layer_tensors, mla_tensors, targets, position_embeddings, options,
                  device) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(the layer's MLA attention tensors, its other tensors where they were trained and kept, else {}, the layer's
    refinement record) after `refine_module` on the calibration targets: of the attention, or of the whole
    layer (`--refine-scope layer`, its MLP and norms on copies: the source's tensors are not touched)."""
    whole = options.refine_scope == "layer"
    others = {n: t.to(device=device, dtype=torch.float32, copy=whole) for n, t in layer_tensors.items()}
    layer = converted_decoder_layer(config, plan, family, rope_pairs, i, others, mla_tensors)
    if whole:
        module, forward = layer, layer_update
        slow = tuple(p for n, p in layer.named_parameters() if not n.startswith("self_attn."))
    else:
        module, forward, slow = layer.self_attn, attention_output, ()
    clock = time.perf_counter()
    record = refine_module(module, *targets, position_embeddings, options.refine_steps, options.refine_lr,
                           seq_len=options.refine_seq_len, seed=options.seed + i, forward=forward,
                           slow=slow, slow_lr=options.refine_lr * options.refine_mlp_lr_scale,
                           precision=options.refine_precision, queries=options.refine_queries)
    log.info(REFINED_LINE, i, record["before"], record["after"], "kept" if record["kept"] else "not kept",
             time.perf_counter() - clock)
    row = {"layer": i, **{k: round(v, 6) if isinstance(v, float) else v for k, v in record.items()}}
    trained = {n: t.detach().cpu() for n, t in layer.state_dict().items() if not n.startswith("self_attn.")}
    return ({k: v.detach() for k, v in layer.self_attn.state_dict().items()},
            trained if whole and record["kept"] else {}, row)


def model_stage(source: Source, config, plan: Plan, family: Family, rope_pairs, runner, kept: Path,
                options: ConvertOptions, device) -> tuple[dict[str, torch.Tensor], dict]:
    """The model stage (`refine_model`): the whole converted model, built in float32 from the source's other
    tensors and the kept layers, trained end to end to the source's next-token distributions on the calibration
    windows (the runner's hidden states are the source's after its last layer). Returns (the trained attention
    tensors, none if the stage did not help; the stage's record): the tensors replace the kept layers' when the
    shards are written; they and the record are kept in the resume folder first, so a run killed later does not
    train again."""
    from mla_convert.modeling.modeling_mla import MLAForCausalLM

    done = kept / MODEL_STAGE_FILE
    if kept_file_intact(done):
        with safe_open(str(done), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}, json.loads(f.metadata()["record"])
    clock = time.perf_counter()
    state = {name: source.get_raw(name).float() for name in other_tensor_names(source, family)}
    for i in range(plan.layers):
        state.update({n: t.float() for n, t in read_layer(kept / layer_file(i)).items()})
    with torch.device(device):
        model = MLAForCausalLM(mla_config(config, plan, family, rope_pairs, "float32"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # a tied head is the embedding
        raise RuntimeError(f"model stage: the converted state does not fit the model ({missing[:3]}, {unexpected[:3]})")
    model.tie_weights()
    del state
    model.eval()
    with torch.no_grad():
        teacher = model.model.norm(runner.hidden)  # the source's final norm is the converted model's (not converted)
    record = refine_model(model, runner.tokens.to(device), teacher, options.refine_model_steps,
                          options.refine_model_lr, seq_len=options.refine_seq_len, seed=options.seed,
                          scope=options.refine_model_scope, precision=options.refine_precision)
    del teacher
    record = {k: round(v, 6) if isinstance(v, float) else v for k, v in record.items()}
    record["curve"] = [[step, round(kl, 6)] for step, kl in record["curve"]]
    record["seconds"] = round(time.perf_counter() - clock, 1)
    record["scope"] = options.refine_model_scope
    log.info("refine model: held-out KL %.4g -> %.4g (%s)", record["before"], record["after"],
             f"kept after step {record['step']} of {options.refine_model_steps}" if record["kept"] else "not kept")
    names = set(model_parameter_names(model, options.refine_model_scope)) if record["kept"] else set()
    trained = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if n in names}
    tmp = done.with_name(done.name + ".tmp")
    save_tensors(trained, tmp, metadata={"record": json.dumps(record)})
    seal_kept_file(tmp, done)
    return trained, record
