"""The model stage (`--refine-model-steps`): after every layer is converted (and refined), the converted model's
attention is trained end to end so that its next-token distributions match the source's on the same calibration
windows: KL(source || converted) per token (`refine_model`); `stages.model_stage` is the conversion's stage, which builds
the whole converted model from the kept layers and keeps what it trained in the resume folder.

Layer-wise targets cannot see how the errors of successive layers compound; the source's own output distribution can.
It reads no other text (the calibration windows, one held out), and needs the source's final hidden states only, which
the calibration stream already computed: no second model. Its steps, time and memory on a CPU:
`conversion.estimates`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math

import torch

from mla_convert.conversion.refine_layer import EXACT, SEQ_LEN, _compute, adam
from mla_convert.schema import DEFAULTS, choices

log = logging.getLogger(__name__)
MODEL_STAGE_FILE = "model_stage.safetensors"  # in the resume folder: the trained attention tensors and the record

# Steps and rate chosen on the development split: docs/decisions.md#the-model-stage. MODEL_STEPS on a GPU; on a CPU
# `policy.MODEL_STEPS_CPU` by the cache kept (fewer, for time: docs/decisions.md#the-model-stage-on-a-cpu). MODEL_LR
# for a stage of MODEL_STEPS or more steps, SHORT_MODEL_LR for a shorter one.
MODEL_STEPS = 64
MODEL_LR = 1e-4
SHORT_MODEL_LR = 2e-4
MODEL_WARMUP = 0.1  # of the steps, linear, then cosine to zero
LOGIT_CHUNK = 512  # positions whose logits are formed at once: memory does not grow with vocabulary x window
MODEL_CHECKS = 8  # held-out evaluations during the stage: the best weights seen are kept (early stopping)
# positions of a step's window whose KL the stage trains on, drawn at random each step (0: every position): the head
# and its log-softmaxes over the vocabulary run at those alone, the layers still at every position
MODEL_POSITIONS = 0
# what the stage trains: every converted attention, or every decoder layer whole (attention, MLP, norms; embeddings,
# the final norm and the head stay the source's either way)
MODEL_SCOPES = choices("refine_model_scope")
MODEL_SCOPE = DEFAULTS["refine_model_scope"]


def teacher_terms(model, teacher: torch.Tensor) -> torch.Tensor:
    """What the KL to the teacher needs of it, formed once: `teacher` [..., T, D] (the source's final normed hidden
    states) -> [..., T, D + 1] float32, each position's expected head row under the teacher's distribution p (W^T p)
    and, last, the constant sum_v p_v (log p_v - b_v) (b: the head's bias, if any). For student logits s = W h + b,
    KL(p || softmax(s)) = that constant - h . W^T p + logsumexp(s): a step then forms only the student's logits."""
    head = model.get_output_embeddings()
    weight, bias = head.weight.float(), None if head.bias is None else head.bias.float()
    flat = teacher.reshape(-1, teacher.shape[-1])
    terms = torch.empty(flat.shape[0], flat.shape[1] + 1, dtype=torch.float32, device=flat.device)
    with torch.no_grad():
        for start in range(0, flat.shape[0], LOGIT_CHUNK):
            logits = torch.nn.functional.linear(flat[start : start + LOGIT_CHUNK].float(), weight, bias)
            logp = torch.log_softmax(logits, dim=-1)
            p = logp.exp()
            constant = (p * (logp if bias is None else logp - bias)).sum(-1)
            terms[start : start + LOGIT_CHUNK, :-1] = p @ weight
            terms[start : start + LOGIT_CHUNK, -1] = constant
    return terms.view(*teacher.shape[:-1], -1)


def _kl_chunks(model, hidden, terms, backward: bool, precision: str = "float32") -> float:
    """Sum over positions of KL(teacher || softmax(lm_head(hidden))), hidden [T, D] (after the final norm) and the
    teacher's `teacher_terms` [T, D + 1]; the logits of LOGIT_CHUNK positions at a time, their products in `precision`
    (log-sum-exp and KL in float32). With `backward`, the gradient of the mean is written into hidden.grad (hidden: a
    leaf), formed directly: the head is frozen, and d KL / d h = W^T softmax(s) - W^T p."""
    head = model.get_output_embeddings()
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    weight = head.weight.detach().to(dtype)
    bias = None if head.bias is None else head.bias.detach().to(dtype)
    if backward:
        hidden.grad = torch.empty_like(hidden)  # every chunk's rows written below
    total = 0.0
    count = hidden.shape[0]
    with torch.no_grad():
        for start in range(0, count, LOGIT_CHUNK):
            h, t = hidden[start : start + LOGIT_CHUNK].detach(), terms[start : start + LOGIT_CHUNK]
            logits = torch.nn.functional.linear(h.to(dtype), weight, bias).float()
            normalizer = torch.logsumexp(logits, dim=-1)
            total += (normalizer - (h.float() * t[:, :-1]).sum(-1) + t[:, -1]).sum().item()
            if backward:
                q = logits.sub_(normalizer[:, None]).exp_()  # the student's distribution, in the logits' storage
                grad = (q.to(dtype) @ weight).float() - t[:, :-1]
                hidden.grad[start : start + LOGIT_CHUNK] = (grad / count).to(hidden.dtype)
    return total


def model_kl(model, tokens: torch.Tensor, teacher: torch.Tensor, below: torch.Tensor | None = None,
             first: int = 0) -> float:
    """Mean per-token KL(source || model) over windows `tokens` [N, T] whose source final normed hidden states are
    `teacher` [N, T, D]; with `below` [N, T, D], the inputs of the model's layer `first` (`frozen_outputs`), the
    model runs from there."""
    return _terms_kl(model, tokens, teacher_terms(model, teacher), below, first)


def _terms_kl(model, tokens: torch.Tensor, terms: torch.Tensor, below: torch.Tensor | None, first: int) -> float:
    """`model_kl` from the teacher's `teacher_terms` [N, T, D + 1], formed beforehand."""
    total = 0.0
    with torch.no_grad():
        for i, (ids, t) in enumerate(zip(tokens, terms)):
            hidden = final_hidden(model, ids, None if below is None else below[i], first)
            total += _kl_chunks(model, hidden, t, backward=False)
    return total / tokens.numel()


@contextlib.contextmanager
def _layers(model, part: slice, norm: bool = True):
    """`model`'s decoder with only its layers `part` (and no final norm unless `norm`) for the time of the block."""
    inner = model.model
    layers, final = inner.layers, inner.norm
    inner.layers = torch.nn.ModuleList(list(layers)[part])
    if not norm:
        inner.norm = torch.nn.Identity()
    try:
        yield inner
    finally:
        inner.layers, inner.norm = layers, final


def frozen_outputs(model, tokens: torch.Tensor, first: int) -> torch.Tensor | None:
    """The inputs of decoder layer `first` on windows `tokens` [N, T] ([N, T, D]; None for 0): what the layers below
    give, computed once where the model stage trains only the layers from `first` on."""
    if first <= 0:
        return None
    with torch.no_grad(), _layers(model, slice(0, first), norm=False) as bottom:
        return torch.cat([bottom(input_ids=ids[None], use_cache=False).last_hidden_state for ids in tokens])


def final_hidden(model, ids: torch.Tensor, below: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
    """The model's last hidden states after its final norm [T, D] on one window `ids` [T]; where `below` [T', D] (T'
    >= T: the inputs of layer `first`, `frozen_outputs`) is given, through the layers from `first` on only."""
    if below is None:
        return model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    with _layers(model, slice(first, None)) as top:
        return top(inputs_embeds=below[None, : ids.shape[0]], use_cache=False).last_hidden_state[0]


def first_trained(model, top: int | None) -> int:
    """The first decoder layer the model stage trains when it trains the last `top` (None: every layer)."""
    layers = len(model.model.layers)
    if top is None:
        return 0
    if not 1 <= top <= layers:
        raise ValueError(f"the model stage trains the last 1 to {layers} layers, got top={top}")
    return layers - top


def model_parameter_names(model, scope: str = MODEL_SCOPE, top: int | None = None) -> list[str]:
    """What the model stage trains: every attention's weights (`attention`: what the conversion changed) or every
    decoder layer's (`layer`: attention, MLP and norms), of the last `top` decoder layers only where given (the
    backward then stops below them); embeddings, the final norm and the head stay as they are."""
    if scope not in MODEL_SCOPES:
        raise ValueError(f"model stage scope must be one of {MODEL_SCOPES}, got {scope!r}")
    marker = ".self_attn." if scope == "attention" else ".layers."
    first = first_trained(model, top)
    return [name for name, _ in model.named_parameters()
            if marker in name and int(name.split(".layers.", 1)[1].split(".", 1)[0]) >= first]


@torch.no_grad()
def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Each tensor of `targets` takes the values of its peer in `sources`."""
    for t, s in zip(targets, sources):
        t.copy_(s)


def refine_model(model, tokens: torch.Tensor, teacher: torch.Tensor, steps: int, lr: float = MODEL_LR,
                 seq_len: int = SEQ_LEN, seed: int = 0, scope: str = MODEL_SCOPE, precision: str = "float32",
                 top: int | None = None, positions: int | None = None) -> dict:
    """Train `model`'s attention (`scope` layer: its whole decoder layers; float32, in place) end to end so that its
    next-token distributions match the source's: `teacher` [N, T, D] holds the source's final hidden states after its
    final norm on the calibration windows `tokens` [N, T] (its logits are the model's own head applied to them: the head
    is not trained). Adam, a linear warmup then cosine; a step trains on one window's first `seq_len` tokens, drawn
    from all but the last window (held out), at `positions` random positions of them (default MODEL_POSITIONS; 0: all)
    and computes in `precision`. The held-out KL (float32, every position) is measured every steps // MODEL_CHECKS
    steps and after the final one; the best weights seen are what the model keeps: the converted
    weights themselves where no check improved on them. With `top`, only the last `top` decoder layers train: the
    layers below are frozen, their outputs computed once a window (`frozen_outputs`), and a step runs the top ones.

    Returns {"before", "after", "kept", "step", "last", "curve"}: the held-out mean KL before and of the weights
    kept, whether trained weights were kept and after which step (0: none), the KL after the last step, and every
    check as [step, KL]."""
    n, positions = tokens.shape[0], MODEL_POSITIONS if positions is None else positions
    held, train = slice(n - 1, n), slice(0, max(n - 1, 1))
    first = first_trained(model, top) if steps > 0 else 0
    below = frozen_outputs(model, tokens, first)
    bt, bh = (None, None) if below is None else (below[train], below[held])
    held_terms = teacher_terms(model, teacher[held])  # the teacher's head is formed here, once a window
    before = _terms_kl(model, tokens[held], held_terms, bh, first)
    record = {"before": before, "after": before, "kept": False, "step": 0, "last": before, "curve": []}
    if steps <= 0 or before < EXACT:
        return record
    names = set(model_parameter_names(model, scope, top))
    params = [p for name, p in model.named_parameters() if name in names]
    best = [p.detach().clone() for p in params]  # the weights with the lowest held-out KL so far
    frozen = [p for p in model.parameters() if p.requires_grad]
    model.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    optimizer = adam([{"params": params, "lr": lr}])
    warmup, every = max(1, int(MODEL_WARMUP * steps)), max(1, steps // MODEL_CHECKS)

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / (warmup + 1)
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    gen, picks = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)  # windows, positions
    xt = tokens[train]
    terms = functools.cache(lambda row: teacher_terms(model, teacher[row]))  # formed when a step first draws the window
    seq_len = min(seq_len, tokens.shape[1])
    for step in range(1, steps + 1):
        model.train()
        row = int(torch.randint(0, xt.shape[0], (1,), generator=gen))
        ids, target = xt[row, :seq_len], terms(row)[:seq_len]
        with _compute(ids, precision):
            hidden = final_hidden(model, ids, None if bt is None else bt[row], first)
        if 0 < positions < seq_len:
            at = torch.randperm(seq_len, generator=picks)[:positions].sort().values.to(hidden.device)
            hidden, target = hidden[at], target[at]
        leaf = hidden.detach().float().requires_grad_(True)
        loss = _kl_chunks(model, leaf, target, backward=True, precision=precision) / leaf.shape[0]
        optimizer.zero_grad(set_to_none=True)
        hidden.backward(leaf.grad.to(hidden.dtype))
        optimizer.step()
        schedule.step()
        log.info("refine model: step %d/%d KL %.4f", step, steps, loss)
        if step % every and step != steps:
            continue
        model.eval()
        kl = _terms_kl(model, tokens[held], held_terms, bh, first)
        record["curve"].append([step, kl])
        log.info("refine model: held-out KL %.4f after step %d (before %.4f)", kl, step, before)
        if kl < record["after"]:
            record.update(after=kl, kept=True, step=step)
            _copy(best, params)
    record["last"] = record["curve"][-1][1]
    model.eval()
    optimizer.zero_grad(set_to_none=True)
    for p in params:
        p.requires_grad_(False)
    for p in frozen:
        p.requires_grad_(True)
    _copy(params, best)
    return record
