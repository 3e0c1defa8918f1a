"""Fine-tuning with accelerate: next-token cross-entropy, distillation from the source model, or a mix of the two.

Launch (any number of processes; one process works without the launcher):

    accelerate launch -m mla_convert.finetune --config recipes/smollm2-135m.yaml [key=value ...]
    mla-convert finetune --config recipes/smollm2-135m.yaml [key=value ...] [--num-processes N]

The loss per token is `(1 - kd_weight) * CE(student, next token) + kd_weight * T^2 * KL(teacher_T || student_T)`,
where the teacher (the source model) runs alongside the student on the same batch. Why alongside and not from
precomputed top-k logits: one pass over the data needs exactly one teacher forward per sequence either way, so
precomputing saves no compute, costs storage (k logits + indices per token) and truncates the teacher's
distribution (the teacher's share of a step: benchmarks/finetune/README.md).

Output folder layout:

    OUT/metrics.jsonl        one JSON object per line: {"event": "train"|"eval", "step", ...}
    OUT/loss.png             loss and held-out perplexity against steps (written at the end)
    OUT/step_N/              a loadable model folder + trainer/ (optimizer, scheduler, RNG) + trainer_state.json
    OUT/final/               the complete fine-tuned checkpoint (config, safetensors, tokenizer, provenance, card)

A `step_N` folder counts only once its `trainer_state.json` exists (written last), so a run killed while saving
resumes from the checkpoint before. Resuming (`resume: true`, the default) restarts from the latest complete
`step_N` with the same data order: batches are a pure function of (seed, step, micro-step, rank), so a resumed run
gives the losses of an uninterrupted one.
"""

# The code lives in mla_convert/training/ (recipe, data, models, losses, checkpoints, metrics, loop); this module is the
# entry point (`accelerate launch -m mla_convert.finetune`, `mla-convert finetune`) and keeps the names it always had.
from __future__ import annotations

import argparse
import logging
import os
import sys

from mla_convert.training.recipe import (  # noqa: F401
    STATE_FILE, TRAINER_DIR, METRICS_FILE, PLOT_FILE, FINAL_DIR, CRASH_ENV, TRAINABLE, SCHEDULES, PRECISIONS,
    DATA_ORDER_FIELDS, FinetuneConfig, INSTALLED_RECIPES, shipped_recipes_dir, resolve_recipe_path,
    resolve_accelerate_config, read_recipe, parse_overrides, load_config,
)
from mla_convert.training.data import (  # noqa: F401
    DataOrder, FreshSequences, self_training_tokens, fresh_self_text, prepare_data,
)
from mla_convert.training.models import (  # noqa: F401
    load_student, teacher_spec, load_teacher, select_trainable, lr_lambda,
)
from mla_convert.training.losses import (  # noqa: F401
    lm_loss, kd_loss,
)
from mla_convert.training.checkpoints import (  # noqa: F401
    complete_checkpoints, OPTIMIZER_FILE, TRAINER_JSON, optimizer_to_files, optimizer_from_files,
    save_trainer_state, load_trainer_state, check_output,
)
from mla_convert.training.metrics import (  # noqa: F401
    Metrics, plot,
)
from mla_convert.training.loop import (  # noqa: F401
    run,
)


def main(argv: list[str] | None = None) -> None:
    """`python -m mla_convert.finetune --config RECIPE [key=value ...]` (usually under `accelerate launch`)."""
    parser = argparse.ArgumentParser(prog="mla_convert.finetune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", "-c", required=True, help="recipe YAML file or shipped recipe name")
    parser.add_argument("-v", "--verbose", action="count", default=1)
    parser.add_argument("-q", "--quiet", action="store_true")
    parser.add_argument("overrides", nargs="*", help="finetune settings as key=value")
    args = parser.parse_args(argv)
    level = logging.WARNING if args.quiet else (logging.INFO if args.verbose <= 1 else logging.DEBUG)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=level, format=f"[rank {rank}] %(message)s" if os.environ.get("WORLD_SIZE", "1") != "1"
                        else "%(message)s", stream=sys.stderr, force=True)
    for noisy in ("transformers", "accelerate", "datasets", "huggingface_hub", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if rank != "0":
        logging.getLogger().setLevel(logging.WARNING)
    try:
        final = run(load_config(args.config, args.overrides))
    except Exception as e:  # a user error, a full disk or a read-only place, running out of memory: one line
        from mla_convert.errors import one_line

        line = one_line(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    if rank == "0":
        print(f"wrote {final}")


if __name__ == "__main__":
    main()
