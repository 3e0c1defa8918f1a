#!/usr/bin/env python
"""One-shot conversion quality on every domain: perplexity at KV-cache budgets for each method, no fine-tuning.

    nice python scripts/bench_quality.py               # -> benchmarks/quality/README.md, quality.png, quality.jsonl
    nice python scripts/bench_quality.py --budgets 96 --methods mla-convert --calib wiki-valid   # another calibration
    nice python scripts/bench_quality.py --texts wiki-dev --windows 4 \
        --results benchmarks/quality/quality_dev.jsonl  # choices

Protocol (issue 15): the embedded SmolLM2-135M-Instruct (384 cached elements per token per layer), converted at the
given budgets (default 192 and 96: 50% and 25%) with calibration `--calib` (default `self`: text sampled from the
source, the data-free default); perplexity on each text of `--texts`, the first `--windows` non-overlapping
2048-token windows, float32 (`mla-convert eval`), shown relative to the source on the same text:
  wikitext          WikiText-2 raw test
  debian-reference  the Debian Reference manual (package debian-reference-en; scripts/domain_texts.py)
  gnu-standards     the GNU Coding Standards (package gnu-standards; scripts/domain_texts.py)
  wiki-dev          the second half of wiki.valid.tokens (wiki-calibrated probes read the first half)
  devref-dev        the Debian Developer's Reference (package developers-reference; scripts/domain_texts.py)
  fortunes-dev      English epigrams and verse (package fortunes; scripts/domain_texts.py)
The last three are the development split (DEV_TEXTS): choices are made on them only, never on the evaluation texts.
No evaluation text is ever calibrated on. Each conversion and each evaluation runs as its own `mla-convert`
process, timed, with its peak RSS (wait4).

Methods, all run through our pipeline so that only the method differs:
  mha2mla      MHA2MLA's initialization: 2-norm partial RoPE, 4 pairs per kv head (d_r 24), no merging, weight-only
               joint SVD of [K_nope; V].
  transmla     TransMLA's: RoRoPE (RoPE merged across kv heads by a PCA per frequency, the leading component of every
               frequency kept: d_r 64, or half the budget when smaller), BKV-PCA (K and V balanced, PCA of the joint
               K/V outputs on calibration activations).
  mla-convert  this project's default (whatever `mla-convert llama --kv-budget B` does with no method options).
Results are appended to benchmarks/quality/quality.jsonl as they come (a re-run skips what is there; --redo to measure
again).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "quality"  # this benchmark's folder: README.md (the report), results, plot
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
DOMAINS = ROOT / "out" / "domains"  # scripts/domain_texts.py writes them (Debian packages; evaluation only)
DEV = ROOT / "out" / "dev"  # wiki.valid.tokens cut in two: calibration may use the first half, choices the second
# Evaluation texts (never calibrated on) and the development text (choices are made on it, never on these).
TEXTS = {
    "wikitext": DATA / "wiki.test.raw",
    "debian-reference": DOMAINS / "debian-reference.txt",
    "gnu-standards": DOMAINS / "gnu-standards.txt",
    "wiki-dev": DEV / "wiki.valid.second-half.tokens",
    "devref-dev": DEV / "devref.txt",
    "fortunes-dev": DEV / "fortunes.txt",
}
DEV_TEXTS = ("wiki-dev", "devref-dev", "fortunes-dev")  # the development split: three domains, none evaluated on
# Calibration texts by name: "self" is the data-free default (text sampled from the source).
CALIBS = {
    "self": "self",
    "wiki-valid": DATA / "wiki.valid.tokens",
    "wiki-valid-first-half": DEV / "wiki.valid.first-half.tokens",
    "self+wiki-valid-first-half": f"self:0.5,{DEV / 'wiki.valid.first-half.tokens'}:0.5",
}
NOTES = [  # the history of what chose what (issue 15), written with the measurements
    "**What chose what.** `self` calibration is the default because it needs no data set and samples the model's own "
    "distribution (with the chat template for this instruct model); no evaluation text was read to choose it. Its "
    "sampling settings were first chosen by cost: temperature 1.0 (the model's own distribution), 256 new tokens "
    "per sample, 16 samples a batch; sampling 64 x 512 tokens a batch had not finished after 40 minutes on the 2 "
    "shared cores of the first machine, 16 x 256 took about 285 s a batch (about 4,500 tokens; 27 s on 2 cores of the "
    "later Intel Xeon). The temperature was then chosen on `wiki-dev` (1.2 below 37.5% of the cache, 1.0 from there up; below, the paragraph on it), and the "
    "length measured (256 stays). The refinement "
    "(`--refine-steps`, on by default for this model) and its settings were chosen on the development split, "
    "`wiki-dev`, at 25% (probes of series C at the end of this file): the closed form alone 168.2, refined 122.4 "
    "(source 25.7); windows cut mid-sequence 160.1; sequential targets 120.0 (a tie: not the default, it costs a "
    "second stream); with refinement d_r 16 scores 137.9 against 122.4 for the default d_r 32, so the RoPE split "
    "stays; 200 steps instead of 100 scored 113.2 (twice the refinement time), and 100 steps at a learning rate of "
    "1e-3 instead of 3e-4 scored 113.0 at no extra time (3e-3: 123.5; rows `mla-convert-lr3e-4` hold that earlier "
    "default); 200 steps at 1e-3 scored 102.9 (probe C_refine_lr1e3_s200, 1217 s of conversion against 648 s for 100 "
    "steps): the default since (rows `mla-convert-s100` hold the 100-step default). One 2048-token window a step "
    "instead of two of 1024 (`--refine-seq-len 2048`: the windows then reach the positions past 1024 that a 2048-token "
    "evaluation window holds) scored 99.3 at 1.5x the time (1881 s, probe C_refine_lr1e3_s200_w2048): an option then, "
    "the default since it won again on the later defaults (below). Calibration text sampled as one unbroken document per window (`self-doc`, from the BOS token) "
    "scored 119.3 against 113.0 for the chat answers (probe C_selfdoc_lr1e3, same refinement): `self` stays the "
    "default, `self-doc` an option. The closed-form options (steps 1-4 in the README) were first chosen by the earlier probes (series A and B, on "
    "test windows at 50%, before a development split existed), and re-chosen on `wiki-dev` at 25% with 16 windows "
    "(probes C_cf_*, refinement off: the closed form each option shapes, about 3 min a probe; the defaults score "
    "157.9): every default held (RoPE pairs 2-norm 291.9, high 265.3, uniform 388.0; no merge across kv heads 463.0; "
    "objective attention 232.2; K:V balance 0.5 178.8, 2 163.3; dropped pairs unrotated 170.3; values on token inputs "
    "160.8; keys unweighted 225.4; d_r 16 300.0, d_r 48 208.3) except the rank allocation, `energy` 144.6, and two "
    "small gains not taken (one latent round 155.3; half the windows sampled as documents, `self:1,self-doc:1`, "
    "152.1, where `self-doc` alone had lost with refinement). With refinement, `energy` scored 88.9 against 98.4 "
    "for `uniform` (probe C_energy against C_calib16, same conversion time, 1406 s): the default since (rows "
    "`mla-convert-uniform` hold the uniform default; uniform stays for `--target deepseek`, whose export holds one "
    "`kv_lora_rank`, and without calibration text). Energy shares the same total latent dims among the layers by "
    "their calibrated spectra, at most the vLLM MLA latent width the uniform rank needs, so the cache in "
    "transformers and the engine's layout are the uniform allocation's. On top of energy with refinement, one latent "
    "round (`--latent-rounds 1`) scored 86.9 against 88.9 at 25% (probe C_energy_latent1, 1444 s of conversion) but "
    "35.89 against 35.50 at 50% (probes C_energy50_latent1 and C_energy50, both on the later Intel Xeon machine, "
    "990 s and 968 s): it gains at 25% and loses at 50%, so the default keeps no latent round. The number of calibration "
    "windows was chosen last on `wiki-dev`, with the "
    "200-step refinement (probes C_calib16, C_calib32): 8 x 2048 tokens 102.9, 16 98.4, 32 99.8 (1752 s against "
    "1406 s, sampling included): 16 is the default since (rows `mla-convert-c8` hold the 8-window default; the rows "
    "`mla-convert-s100`, `-lr3e-4`, `-norefine` and `transmla` were calibrated on 8 windows). Refinement trained on "
    "the first 1024 tokens of every window but the held-out one (now on the whole window): 16 windows give it twice "
    "the distinct text.",
    "",
    "**Result.** Refinement cut the default's perplexity on every text (rows `mla-convert-norefine`: the closed form "
    "alone, the default before refinement, same calibration tokens; the cuts below were measured with the 100-step "
    "default, rows `mla-convert-s100`): at 25% by 38% (WikiText), 43% (Debian Reference) and 40% (GNU Coding "
    "Standards), at 50% by 9%, 9% and 10%. The learning rate 1e-3 chosen on `wiki-dev` improved the 25% point on every "
    "text against 3e-4 (126.88 -> 115.45, 62.05 -> 58.04, 59.58 -> 55.04) and left the 50% point where it was. The "
    "200 steps chosen next on `wiki-dev` improved every text again (rows `mla-convert-c8` against `mla-convert-s100`): "
    "at 25% by 8.0%, 6.9% and 6.7% (115.45 -> 106.27, 58.04 -> 54.04, 55.04 -> 51.33), at 50% by 1.7%, 1.5% and 2.0% "
    "(34.12 -> 33.53, 19.17 -> 18.89, 24.15 -> 23.67), for twice the refinement time (conversion 1167 s at 25% and "
    "1558 s at 50% in that run, part of it on cores shared with an evaluation). The 16 calibration windows chosen "
    "next improved every text again (rows `mla-convert-uniform` against `mla-convert-c8`): at 25% by 11.6%, 9.5% and 3.2% "
    "(106.27 -> 93.90, 54.04 -> 48.90, 51.33 -> 49.69), at 50% by 3.0%, 4.0% and 2.2% (33.53 -> 32.51, 18.89 -> "
    "18.14, 23.67 -> 23.15); conversion 1297 s at 25% and 1608 s at 50% on quiet cores (the sampled text was already "
    "cached). The energy rank allocation chosen next on `wiki-dev` improved the 25% point on every text again (rows "
    "`mla-convert-nope64` against `mla-convert-uniform`): by 6.2%, 6.0% and 2.4% (93.90 -> 88.04, 48.90 -> 45.96, "
    "49.69 -> 48.52; 3950 s of conversion, on cores shared with two test-suite runs; layers got 16-80 latent dims, 64 "
    "on average); at 50% (rows `mla-convert-w1024` against `mla-convert-uniform`) it is a wash: WikiText -1.1% (32.51 -> 32.15), Debian Reference +1.8% (18.14 -> 18.46), GNU "
    "Coding Standards -1.0% (23.15 -> 22.93); 3215 s of conversion on cores shared with other benchmarks; layers got "
    "48-160 latent dims, 128 on average. The nope query/key narrowed next to head_dim - d_r (`--nope-dims`, docs/method.md section 3; "
    "at 25% 32 dims instead of 64, so query and key are 64 wide, as the source's head) was chosen for speed (issue "
    "13: the attention then costs what the source's does; eval window 0.97x the source's time instead of 1.085x, "
    "benchmarks/prefill/prefill_xeon.md) at a small measured cost: on `wiki-dev` 89.29 against 88.83 (probes "
    "C_energy_nope32 and C_energy_xeon; 8 windows 78.23 against 77.71), on the evaluation texts (rows `mla-convert-w1024` "
    "against `mla-convert-nope64`) +0.9%, +0.8% and +1.2% (88.04 -> 88.79, 45.96 -> 46.35, 48.52 -> 49.09; 752 s "
    "of conversion on quiet cores of the later Intel Xeon machine). At 50% (d_r 64 = head_dim) nothing changes. With "
    "the narrowed default, one 2048-token window a refinement step (`--refine-seq-len 2048`) scored 87.23 against "
    "89.29 on `wiki-dev` at 25% (probe C_nope32_w2048) for 1.41x the conversion time (1060 s against 752 s), and at 50% "
    "34.66 against 35.50 (probes C_energy50_w2048_s200 and C_energy50; 1570 s against 968 s, 200 steps given "
    "explicitly: with these windows the auto refinement's CPU estimate passes its limit at 50% and refines nothing, "
    "probe C_energy50_w2048): the default since (`refine.SEQ_LEN` 2048; the auto refinement's CPU limit was raised to an "
    "hour, so the 50% default, estimated at 38 min, is refined; rows `mla-convert-w1024` hold the two-window "
    "default). On the evaluation texts (rows `mla-convert-attn` against `mla-convert-w1024`) at 25% it is mixed: WikiText "
    "+1.1% (88.79 -> 89.80), Debian Reference -1.4% (46.35 -> 45.72), GNU Coding Standards -3.3% (49.09 -> 47.45), "
    "for 1099 s of conversion against 752 s on quiet cores; at 50% it gains on every text: WikiText -0.2% (32.15 -> 32.10), Debian Reference -1.6% (18.46 -> 18.16), GNU "
    "Coding Standards -1.8% (22.93 -> 22.51), for 1718 s of conversion (the two-window default took 968 s on "
    "quiet cores in probe C_energy50). The issue's targets on the two Debian texts hold at both budgets (50%: 1.32x "
    "and 1.27x against 1.5x; 25%: 3.32x and 2.68x against 5x); WikiText misses at both (1.37x against 1.2x; 3.82x "
    "against 2.5x): the data-free calibration text is chat-like, WikiText is not (WikiText calibration measured 1.24x "
    "and 3.2x under the earlier protocol, without refinement). The default is 55-64% (50%) and 75-81% (25%) below "
    "the TransMLA-style baseline calibrated on the same kind of text (8 windows) on every text.",
    "",
    "**Whole-layer refinement** (`--refine-scope layer`, the default since; docs/method.md): each converted decoder "
    "layer (attention, MLP and norms, the latter at a tenth of the learning rate) is trained to what the source layer "
    "adds to the residual stream, instead of the attention alone to the source attention's outputs. Chosen on "
    "`wiki-dev`: 80.30 against 87.23 at 25% (probes C_layer, C_nope32_w2048), 34.49 against 34.66 at 50% (C_layer50, "
    "C_energy50_w2048_s200). On the evaluation texts (rows `mla-convert` against `mla-convert-attn`; the probes' "
    "folders, kept with KEEP=1 and scored with `--folder`) at 25%: WikiText -10.5% (89.80 -> 80.35), Debian Reference "
    "-6.7% (45.72 -> 42.65), GNU Coding Standards -8.6% (47.45 -> 43.36); at 50%: -1.7% (32.10 -> 31.54), +0.2% "
    "(18.16 -> 18.20), -0.6% (22.51 -> 22.37). Conversion 1704 s at 25% and 2426 s at 50% (against 1099 s and 1718 s): "
    "the auto refinement's CPU limit is 1.5 h of estimate since (the 50% plan estimates 60 min). Targets now: the "
    "Debian texts hold at both budgets; WikiText misses at both (3.42x against 2.5x at 25%, 1.34x against 1.2x at 50%). "
    "As served, the 25% folder scores in vLLM's CPU build what it scores in transformers (`mla-convert eval "
    "out/keep-C_layer --data ../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 --windows 4 --engine E --dtype D`): "
    "80.353 in float32 for both (CPU_MLA), 80.564 against 80.542 in bfloat16 (AMX_MLA). On the main job's 16 test "
    "windows it scores 63.295 (source 20.163; 69.591 with the attention alone refined).",
    "",
    "**The MLP's learning rate** (`--refine-mlp-lr-scale`, 1 the default since): the whole-layer refinement first "
    "trained the MLP and norms at a tenth of the attention's rate (rows `mla-convert-mlp0.1`, formerly `mla-convert`). "
    "Swept on `wiki-dev` at 25%: 80.30 at 0.1, 75.57 at 1, 75.31 at 3 (probes C_layer, C_layer_slow1, C_layer_slow3); "
    "at 50% 34.49 at 0.1, 34.41 at 1 (C_layer50, C_layer50_slow1). On the evaluation texts (rows `mla-convert-t1` at "
    "both budgets, against `mla-convert-mlp0.1`, the probes' folders scored with `--folder`) at 25%: WikiText -3.1% (80.35 -> 77.88), Debian "
    "Reference -4.1% (42.65 -> 40.89), GNU Coding Standards -3.3% (43.36 -> 41.95); at 50%: +0.2% (31.54 -> 31.60), "
    "-0.3% (18.20 -> 18.15), -0.3% (22.37 -> 22.30). Same flops, same conversion time (the probes ran two at a time on "
    "one thread each, so their times are not comparable). Targets: the Debian texts hold at both budgets; WikiText "
    "misses at both (3.32x against 2.5x at 25%, 1.35x against 1.2x at 50%). Along the converted model's stream "
    "instead (`--calib-propagate converted`, each layer trained on the inputs it will see toward what the source "
    "layer does with them) it tied at 25% on `wiki-dev`: 80.51 against 80.30 (probe C_layer_conv, MLP at 0.1). "
    "Fine-tuned with 16,384 self-sampled tokens (row `mla-convert-t1+finetune-self-16k`: `mla-convert finetune --config "
    "recipes/smollm2-135m-self.yaml model=out/probe-C_layer_slow1 max_tokens=16384 eval_every=0 "
    "output=runs/mlp1-96-self-16k`, 79 s of training by the loop's log, held-out sampled text 37.7 -> 29.8): 67.81 / "
    "38.51 / 37.94, 2.89x / 2.79x / 2.14x, closing 19% / 9% / 17% of the gap; where the fine-tune from the "
    "MLP-at-a-tenth default ended (2.88x / 2.92x / 2.21x), or a little lower. As served (`mla-convert eval "
    "out/probe-C_layer_slow1 --data ../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 --windows 4 --engine E "
    "--dtype D`): float32 77.883 in vLLM's CPU build (CPU_MLA), as in transformers (77.88); bfloat16 77.717 in vLLM "
    "(AMX_MLA) against 77.688 in transformers.",
    "",
    "**The sampling temperature of the calibration text** (`--calib-temperature`, 1.2 the default since; fine-tuning "
    "text stays at 1.0): chosen on `wiki-dev` at 25% with the whole-layer refinement: 114.60 at 0.7, 75.57 at 1.0, "
    "66.61 at 1.2 (probes C_t07, C_layer_slow1, C_t12; -11.9%). Text sampled at 1.2 reads as word salad past its "
    "first sentences, at 0.7 as fluent loops; the varied text gives statistics and refinement targets that transfer "
    "better. The answer length stays 256 new tokens: at 0.7, answers of up to 1024 scored 123.41 against 114.60 "
    "(C_t07_len1024; sampling 19 min against 6 min at one thread). Half the windows as sampled documents "
    "(`self:1,self-doc:1`, at 1.0) scored 82.85 against 75.57 (C_mixdoc): not taken. At 50% only the closed form was "
    "checked (refinement off, probes C_cf50_t10 and C_cf50_t12): 40.29 at 1.2 against 40.68 at 1.0; the refined 50% "
    "conversion at 1.2 was measured next: 34.97 against 34.41 at 1.0 on `wiki-dev` (probe C_t12_50), and on the evaluation texts (row `mla-convert-nostage` at 50% against `mla-convert-t1`) WikiText -2.2% (31.60 -> 30.91), Debian Reference 0.0% (18.15 -> 18.15), GNU Coding Standards +2.4% (22.30 -> 22.83): at 50% the temperature looked a wash, and one default served both budgets, until the 50% default was measured at 1.0 (below: 1.0 from 37.5% up). On the "
    "evaluation texts at 25% (row `mla-convert-nostage`, probe C_t12's folder scored with `--folder`, against "
    "`mla-convert-t1`): WikiText -14.0% (77.88 -> 67.00, 2.85x), Debian Reference -5.0% (40.89 -> 38.86), GNU Coding "
    "Standards +4.4% (41.95 -> 43.79): the one text that loses is the most code-like. Targets at 25%: the Debian "
    "texts hold (2.82x and 2.47x against 5x); WikiText still misses (2.85x against 2.5x). "
    "Fine-tuned with 16,384 self-sampled tokens (row `mla-convert-nostage+finetune-self-16k`: `mla-convert finetune --config "
    "recipes/smollm2-135m-self.yaml model=out/probe-C_t12 max_tokens=16384 eval_every=0 output=runs/t12-96-self-16k`, "
    "92 s of training by the loop's log, held-out sampled text 39.5 -> 30.5): 57.02 / 35.89 / 38.12, 2.43x / 2.60x / "
    "2.15x, closing 23% / 12% / 22% of the gap (from the 1.0 model the same fine-tune ended at 2.89x / 2.79x / 2.14x). As served "
    "(`mla-convert eval out/probe-C_t12 --data ../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 --windows 4 "
    "--engine vllm --dtype float32`): 67.004 in vLLM's CPU build (CPU_MLA), as in transformers (67.00).",
    "",
    "**The model stage** (`--refine-model-steps`, 64 steps the default since; its rate first 3e-4, now 1e-4, next paragraph; docs/method.md): "
    "after the layers, every converted attention is trained end to end to the source's next-token distributions (KL "
    "per token) on the same calibration windows, one held out (the stage is kept only if its KL drops). It needs no "
    "text beyond the calibration windows and no second model (the source's final hidden states come from the "
    "calibration stream). Chosen on `wiki-dev` at 25%, applied to probe C_t12's folder with the same cached "
    "calibration tokens (`scripts/explore_quality.py --model-stage NAME out/probe-C_t12 steps=N lr=X`): without it "
    "66.61; 32 steps at 1e-3 diverged (held-out KL 0.2345 -> 0.2869, not kept); at 3e-4 60.35, at 1e-4 60.50; 64 "
    "steps at 3e-4 59.45 (probes C_t12_m32, C_t12_m32_lr3e-4, C_t12_m32_lr1e-4, C_t12_m64). On the evaluation texts "
    "at 25% (row `mla-convert-stage3e-4`, formerly `mla-convert`, out/probe-C_t12_m64 scored with `--folder`, against `mla-convert-nostage`): WikiText "
    "-13.8% (67.00 -> 57.76, 2.46x), Debian Reference -14.0% (38.86 -> 33.41, 2.43x), GNU Coding Standards -13.3% "
    "(43.79 -> 37.96, 2.15x); 32 steps (row `mla-convert-stage32`) 58.88 / 34.11 / 38.93. Targets at 25% now hold on "
    "every text: WikiText 2.46x against 2.5x, the Debian texts 2.43x and 2.15x against 5x. The stage took 1780 s at "
    "one thread on cores shared with two other jobs (the plan estimates 19 min on 2 cores); it holds the whole model "
    "in memory (`--dry-run` estimates a 6.4 GiB peak for this model), which is why auto runs it on a CPU only for models "
    "this small. As served (`mla-convert eval out/probe-C_t12_m64 --data ../shared/data/wikitext-2/wiki.test.raw "
    "--seq-len 2048 --windows 4 --engine vllm --dtype float32`): 57.759 in vLLM's CPU build (CPU_MLA), as in "
    "transformers (57.76), KV cache 69,120 bytes/token as vLLM allocates it. At 50% (probe C_layer50_slow1's folder, "
    "calibrated at 1.0) 32 steps at 3e-4 made the held-out window worse (KL 0.0958 -> 0.1111): not kept, the "
    "conversion unchanged (probe C_layer50_slow1_m32); the default, 64 steps at 3e-4, on the 50% default's layers "
    "(temperature 1.2) was not kept either (KL 0.0754 -> 0.0848; probe C_t12_50_m64, 724 s at two threads), so the "
    "50% default's weights are its layers' (row `mla-convert-nostage` at 50%, formerly `mla-convert`: 30.91 / 18.15 / 22.83, 1.32x / 1.32x / 1.29x; "
    "WikiText still misses its 1.2x). At 1e-4 the stage was kept at 50% and gained 1.9% on `wiki-dev` (34.41 -> "
    "33.77, probe C_layer50_slow1_m32_lr1e-4, temperature 1.0): a rate chosen per budget, or one that suits both, "
    "is the next probe. Fine-tuning at 50% (row `mla-convert-t1+finetune-self-16k`, "
    "the recipe's lr 1e-3, from the folder calibrated at 1.0) made every text worse (31.60 -> 35.30, 18.15 -> 20.34, "
    "22.30 -> 23.56): near the source, that rate overshoots. "
    "Fine-tuned from that 25% default with 16,384 self-sampled tokens (row `mla-convert-stage3e-4+finetune-self-16k`: "
    "`mla-convert finetune --config recipes/smollm2-135m-self.yaml model=out/probe-C_t12_m64 max_tokens=16384 "
    "eval_every=0 output=runs/stage64-96-self-16k`, 261 s of training by the loop's log at one thread on shared "
    "cores, held-out sampled text 36.48 -> 30.35): 56.30 / 35.23 / 38.06, 2.40x / 2.56x / 2.15x: the gap closes "
    "4% on WikiText and opens 9% on Debian Reference and 0.5% on GNU Coding Standards. The model stage has already "
    "done what this short end-to-end distillation did from the earlier defaults (it closed 23% / 12% / 22% from "
    "`mla-convert-nostage`), and the recipe's rate (1e-3) is the one the stage found to overshoot: a fine-tune from "
    "the new default needs its own, lower rate (measured below).",
    "",
    "**The model stage's checks and its rate** (`--refine-model-lr` 1e-4 the default since): the held-out window is "
    "now checked 8 times during the stage and the best weights seen are kept (early stopping; the converted weights if "
    "no check beats them). With the checks, 3e-4 on the 50% default's layers was worse than the converted weights at "
    "every check (held-out KL 0.0754 -> 0.0903, 0.1003, 0.1011 at steps 8, 16, 24; probe C_t12_50_m64c, stopped "
    "there): it overshoots from the start, no early stop rescues it. At 1e-4 (64 steps) the stage is kept at both "
    "budgets: at 50% 34.97 -> 34.15 on `wiki-dev` (held-out KL 0.0754 -> 0.0719, probe C_t12_50_m64c_lr1e-4), at 25% "
    "59.36 against 59.45 for 3e-4 (0.2345 -> 0.2095 against 0.2259, kept after step 48 of 64; probe "
    "C_t12_m64c_lr1e-4): one rate for both budgets, the default since. On the evaluation texts (rows `mla-convert`, "
    "the probes' folders scored with `--folder`): at 50% against the layers alone (`mla-convert-nostage`) WikiText "
    "-2.8% (30.91 -> 30.03, 1.28x), Debian Reference -2.3% (18.15 -> 17.72, 1.29x), GNU Coding Standards -2.2% (22.83 "
    "-> 22.32, 1.26x): WikiText still misses its 1.2x; at 25% against `mla-convert-stage3e-4` +0.8% (57.76 -> 58.22, "
    "2.48x), +0.4% (33.41 -> 33.56, 2.44x), +0.8% (37.96 -> 38.26, 2.16x), within the noise of the `wiki-dev` tie that "
    "chose it, and -13.1% / -13.6% / -12.6% against the layers alone (`mla-convert-nostage`): every 25% target still "
    "holds (WikiText 2.48x against 2.5x). The stage took 1145 s (25%) and 1410 s (50%) at one thread on cores shared "
    "with another job, and 523 s in the main job (`bash scripts/main.sh`, 2 threads alone), which converted the same "
    "model end to end (its stage kept after step 48, held-out KL 0.2345 -> 0.2095, as in the probe; 47.02 on the 16 "
    "test windows against the source's 20.16, and 58.222 on these 4 as served by vLLM's CPU build, float32, CPU_MLA, "
    "the same as the probe's folder in transformers).",
    "",
    "**The rope key at 50%** (`--rope-dims`, default a third of the budget, at most three quarters of head_dim since; "
    "docs/method.md): the default had been a third capped at head_dim, 64 of the 192 at 50%, chosen on the early "
    "2-window closed-form sweep on test windows. Re-measured with today's refinement on `wiki-dev`: the refined layers "
    "with a 48-dim rope key (so 144 latent dims instead of 128) scored 32.90 against 34.97 with 64 (probes "
    "C_t12_50_r48, C_t12_50), and 32.27 against 34.15 with the model stage (C_t12_50_r48_m64c, C_t12_50_m64c_lr1e-4; "
    "held-out KL 0.0666 -> 0.0663, kept). At 25% a third (32) is already below the cap, and beat 16 and 48 there: "
    "nothing changes at 25% or 37.5%. On the evaluation texts (row `mla-convert-t12` at 50% against `mla-convert-r64`, the "
    "probe's folder scored with `--folder`): WikiText -2.6% (30.03 -> 29.25, 1.25x), Debian Reference -2.0% (17.72 -> "
    "17.37, 1.26x), GNU Coding Standards -1.8% (22.32 -> 21.92, 1.24x): WikiText still misses its 1.2x, by less. As "
    "served: `mla-convert eval out/probe-C_t12_50_r48_m64c --data ../shared/data/wikitext-2/wiki.test.raw --seq-len "
    "2048 --windows 4 --engine vllm --dtype float32` gives 29.254 in vLLM's CPU build (CPU_MLA; the rope key padded to "
    "the engine's 64), the same as transformers, with the KV cache at 69,120 bytes/token as vLLM allocates it. The "
    "stage training every decoder layer whole (`--refine-model-scope layer`, an option) was measured on the same "
    "layers: a tie at 25% (59.24 against 59.36, probe C_t12_m64c_layer) and nothing kept at 50% (no check beat the "
    "converted weights, C_t12_50_r48_m64c_layer): the attention stays what the stage trains.",
    "",
    "**More windows at 50%** (the issue's table read WikiText on 16 windows): the default converted again by "
    "`python scripts/bench_quality.py --methods mla-convert,transmla --budgets 192 --windows 16` (4,992 s of "
    "conversion, model stage included, on 2 quiet cores; out/bench-quality/mlaconvert-192-self; at temperature 1.2, "
    "row `mla-convert-t12` since the temperature became 1.0 at 50%, below) scores 24.58 / 15.42 "
    "/ 16.40 on 16 windows against the source's 20.16 / 12.31 / 13.49: 1.22x / 1.25x / 1.22x. WikiText still misses "
    "its 1.2x (24.19) by 1.6%, less than on the first 4 windows (29.22 for this folder, 1.24x, by `mla-convert eval "
    "out/bench-quality/mlaconvert-192-self --data ../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 --windows 4`; the probe's folder, "
    "converted at one thread, 29.25), and every other text holds its 1.5x. The TransMLA-style baseline on the same 16 windows (its closed form alone: the "
    "script now passes it `--refine-model-steps 0`, as the model stage became a default after its earlier rows; 136 s of "
    "conversion, calibrated on the 16 default windows at 1.2; row `transmla-t12`) scores 74.00 / 44.48 / 45.19 (3.67x / 3.61x / 3.35x): the "
    "default is 67% / 65% / 64% below it. As served: `mla-convert eval out/bench-quality/mlaconvert-192-self --data "
    "../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 --windows 16 --engine vllm --dtype float32` gives 24.576 "
    "in vLLM's CPU build (CPU_MLA, 220 s), as in transformers (24.576). The 25% point was then not measured on 16 windows (it is since: the targets below).",
    "",
    "**32 calibration windows** (`--calib-samples 32`; the default from 37.5% of the cache up since, below): the 16 "
    "default windows and 16 "
    "more of the same cached self text. The refinement's 200 one-window steps then see 31 training windows instead "
    "of 15 (6 passes over them instead of 13). On `wiki-dev` at 25% 55.96 against 59.36 (probes C_t12_c32 and "
    "C_t12_m64c_lr1e-4, model stage included; 7,343 s at one thread beside the 50% probe, against 3,763 s for the "
    "16-window layers under the same conditions, probe C_t12_L, plus 1,145 s for their stage, run separately: about "
    "1.5x). On the evaluation texts (row `mla-convert-c32`, the probe's folder scored with `--folder`), 4 windows: "
    "55.21 / 31.98 / 37.10 (2.35x / 2.32x / 2.10x) against 58.22 / 33.56 / 38.26 for the default (-5.2% / -4.7% / "
    "-3.0%); 16 windows: 44.46 / 27.85 / 27.79 (2.21x / 2.26x / 2.06x). At 50% on `wiki-dev` 31.46 against 32.27 "
    "(probes C_t12_50_r48_c32 and C_t12_50_r48_m64c, -2.5%; 9,014 s at one thread, against 4,651 s + 1,464 s for the "
    "16-window layers and stage, C_t12_50_r48 and C_t12_50_r48_m64c: about 1.5x), but on the 16 evaluation windows "
    "only 24.49 / 15.33 / 16.34 against 24.58 / 15.42 / 16.40 (-0.4% / -0.6% / -0.4%): WikiText stays above its 1.2x "
    "(1.21x; 24.19 needed); as served, `mla-convert eval out/probe-C_t12_50_r48_c32 --data "
    "../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 --windows 16 --engine vllm --dtype float32` gives 24.487 "
    "in vLLM's CPU build (CPU_MLA), as in transformers. Not then the default: the main job's time with it was not "
    "measured. Could the model stage train harder at 50% on the 31 training windows? The 32-window 50% layers "
    "converted again without it (probe "
    "C_t12_50_r48_c32_L: 32.155 on `wiki-dev`, 4,032 s at two threads alone; the default stage takes them to 31.46) "
    "then took two stronger stages, and neither was kept: at lr 3e-4 every held-out check was worse than the converted "
    "weights (KL 0.0659 -> 0.0858 at the first check, 0.0778 at the last), and with the whole decoder layers trained "
    "(scope layer, 1e-4) too (0.0659 -> 0.0733, 0.0667 at the last; probes C_t12_50_r48_c32_m64c_lr3e-4 and "
    "C_t12_50_r48_c32_m64c_layer). The stage's default (attention, 1e-4, 64 steps) stays.",
    "",
    "**The temperature at 50%** (1.0 the default there since): the 50% default converted again with its text sampled "
    "at 1.0 (probe C_t10_50_r48, `calib_temperature=1.0`, every other option the default: 16 windows, rope key 48, "
    "whole-layer refinement, model stage; 5,375 s at two threads alone, sampling the 1.0 text included) scores 32.07 "
    "on `wiki-dev` against 32.27 at 1.2 (C_t12_50_r48_m64c), -0.6%; with the earlier 64-dim rope key 1.0 had led by "
    "1.6% (34.41 against 34.97, C_layer50_slow1 and C_t12_50). The model stage gains more on the cooler text (held-out "
    "KL 0.0832 -> 0.0800 against 0.0666 -> 0.0663). Both `wiki-dev` measurements favour 1.0 at 50%, as 1.2 won at 25% "
    "by 11.9%, so the default temperature follows the cache kept: 1.2 below 37.5% of the source's, 1.0 from there up "
    "(`selftext.calib_temperature`; between the two budgets not measured). The 25% point, the main job, is unchanged. "
    "On the 16 evaluation windows (row `mla-convert` at 50%, the probe's folder scored with `--folder`; the 1.2 "
    "conversion is row `mla-convert-t12`): 24.70 / 15.33 / 16.04 against 24.58 / 15.42 / 16.40, +0.5% / -0.6% / "
    "-2.2%: 1.22x / 1.25x / 1.19x. WikiText moves the wrong way by as much as the development split moved the right "
    "way (it misses its 1.2x, 24.19, by 2.1% instead of 1.6%); the other two texts gain, as the earlier 4-window "
    "comparison had shown (there 1.2 gained 2.2% on WikiText and lost 2.4% on GNU Coding Standards). The choice "
    "stays the development split's. The TransMLA-style baseline, converted again at the new default temperature "
    "(`--refine-model-steps 0`, closed form, 16 windows at 1.0; row `transmla`, the 1.2 one `transmla-t12`), "
    "scores 71.19 / 40.33 / 39.54 (3.53x / 3.28x / 2.93x): the default is 65% / 62% / 59% below it. On the first 4 "
    "windows every text gains: 29.18 / 17.18 / 21.30 against 29.25 / 17.37 / 21.92 (-0.2% / -1.1% / -2.8%; the "
    "baseline 89.13 / 45.90 / 49.97, its 16-window folder scored with `--folder`). As served: `mla-convert eval "
    "out/probe-C_t10_50_r48 --data ../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 --windows 16 --engine vllm "
    "--dtype float32` gives 24.699 in vLLM's CPU build (CPU_MLA, 242 s by `time`), as in transformers.",
    "",
    "**The fine-tune's rate for the new default** (`recipes/smollm2-135m-self.yaml`, lr 3e-4 since, was 1e-3): chosen "
    "on `wiki-dev` from the 3e-4-stage default (59.45 before fine-tuning), 16,384 self-sampled tokens: 61.91 at 1e-3, "
    "55.88 at 3e-4, 55.76 at 1e-4 (a tie; 3e-4 ends lower on the loop's held-out sampled text, 28.84 against 30.06); "
    "65,536 tokens at 3e-4 53.86 (probes FT_*). From the new default (59.36 on `wiki-dev`; 54.92 after the recipe) on "
    "the evaluation texts (row `mla-convert-p24+finetune-self-16k`, formerly `mla-convert+finetune-self-16k`: `mla-convert finetune --config "
    "recipes/smollm2-135m-self.yaml model=out/probe-C_t12_m64c_lr1e-4 max_tokens=16384 eval_every=0 "
    "output=runs/stage1e-4-96-self-16k`, held-out sampled text 37.10 -> 28.87): 53.12 / 31.63 / 35.74, 2.26x / 2.30x "
    "/ 2.02x, closing 14.7% / 9.8% / 12.2% of the gap on WikiText / Debian Reference / GNU Coding Standards, where "
    "the recipe's former rate had opened it on two texts. With 65,536 tokens (row `mla-convert-p24+finetune-self-64k`, "
    "`max_tokens=65536 output=runs/stage1e-4-96-self-64k`, 331 s of training by the loop's log on 2 quiet cores, "
    "held-out sampled text 37.10 -> 26.15): 50.78 / 30.23 / 34.38, 2.16x / 2.19x / 1.94x, closing 21.4% / 16.8% / "
    "18.9%.",
    "",
    "**Fine-tuning the 25% default, no data set** (row `mla-convert+finetune-self-16k`, 16 windows): the main job's "
    "own folder (the 96 requests; converted again on 2026-11-27 by `bash scripts/main.sh out/smollm2-135m-mla-25-p96`, "
    "5,864 s on 2 AMD EPYC cores, 47.459 on WikiText as in the run before) fine-tuned by `mla-convert finetune "
    "--config recipes/smollm2-135m-self.yaml model=out/smollm2-135m-mla-25-p96 max_tokens=16384 eval_every=0 "
    "output=runs/p96-self-16k` (LM + distillation from the source on 16,384 tokens the source sampled itself; 196 s "
    "of training by the loop's log, its held-out sampled text 73.65 -> 60.19) scores 42.75 / 27.15 / 26.35 against "
    "47.46 / 31.37 / 29.37 before: 2.12x / 2.21x / 1.95x the source, closing 17.3% / 22.1% / 19.0% of the gap on "
    "WikiText / Debian Reference / GNU Coding Standards. The 65,536-token run was not repeated on this default (from "
    "the 24-request one it closed 21% / 17% / 19% on 4 windows: paragraph \"The fine-tune's rate for the new default\").",
    "",
    "**The prompt pool** (96 built-in requests for the self text, the default since; were 24): the 16 "
    "calibration windows answered each of the 24 requests about 5 times, at the same tokens. A pool of 96 "
    "requests of the same kinds (the 24 and 72 more; `selftext.PROMPTS`, first measured from "
    "benchmarks/quality/probe_prompts_96.json with `explore_quality.py ... "
    "selftext.PROMPTS=@benchmarks/quality/probe_prompts_96.json`) answers each about once. On `wiki-dev` at 50% 31.60"
    " against 32.07 (probe C_t10_50_r48_p96, -1.5%; the stage's held-out KL on the sampled text about the "
    "same, 0.0824 -> 0.0804 against 0.0832 -> 0.0800); at 25% 57.45 against 59.36 (-3.2%; probe C_p96_main: "
    "the main job's own conversion with the 96 requests, scored with `--score`; its stage kept after step 64,"
    " held-out KL 0.2669 -> 0.2361). The rule, set before the 25% score was read: adopt unless it is more "
    "than 1% worse there. Adopted. On the evaluation texts the choice does not hold up as well (rows `mla-"
    "convert` against `mla-convert-p24`, the 24-request default; at 50% `mla-convert-c16`, the 16-window default "
    "since the 32 windows there): at 50% on 16 windows 24.44 / 15.55 / 16.18 "
    "against 24.70 / 15.33 / 16.04 (-1.1% / +1.4% / +0.9%; 4 windows -2.1% / +0.9% / +1.3%); at 25% on 4 "
    "windows 58.98 / 36.29 / 39.11 against 58.22 / 33.56 / 38.26 (+1.3% / +8.1% / +2.2%), and on the 16 "
    "WikiText windows of the main job 47.46 against 47.02 (+0.9%; Debian Reference 31.37 and GNU Coding "
    "Standards 29.37 on 16 windows, not measured for the 24-request default). The two splits disagree by "
    "about as much as either moves: `wiki-dev` is 2 windows of one domain, and a new prompt list also redraws"
    " every sample. The choice stays the development split's, as for the temperature at 50%; a development "
    "split that covers more than WikiText (held-out text of other domains, never the evaluation texts) is the"
    " next thing this protocol needs. Targets: WikiText at 50% on 16 windows 1.21x, still above its 1.2x "
    "(24.19) by 1.0%; at 25% on 16 windows 2.35x (holds), on 4 windows 2.51x (misses by 0.4%, where the "
    "24-request default held at 2.48x). As served: `mla-convert eval out/smollm2-135m-mla-25-p96 --data "
    "../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 --windows 16 --engine vllm --dtype float32` gives"
    " 47.459 in vLLM's CPU build (CPU_MLA, 200 s by `time`), as in transformers. The main job took 4,812 s "
    "(80 min) with the new requests on 2 cores of an AMD EPYC (the earlier probes: an Intel Xeon), "
    "sampling included, about a quarter of it on cores shared with an "
    "evaluation; its layers took 73-86 s of refinement each where the cores were not shared.",
    "",
    "**The development split of three domains** (series D, at the end of this file; choices are made on it "
    "since): `wiki-dev` alone had chosen the 96 requests, and the evaluation texts then moved both ways. Two "
    "held-out documents of other domains now sit beside it, from Debian packages and never evaluated on "
    "(`python scripts/domain_texts.py --dev-out out/dev`): the Debian Developer's Reference (`devref-dev`, "
    "package developers-reference) and English epigrams and verse (`fortunes-dev`, package fortunes, one entry of "
    "each file in turn); 4 windows of each, and a choice is made on the geometric mean of the three ratios to "
    "the source (`dev ratio`; source 24.21 / 16.10 / 28.73). Re-scored on it (`W=4 python "
    "scripts/explore_quality.py --score NAME FOLDER`), the 50% folders tie: the 96 requests 1.1918 (29.21 / "
    "19.45 / 33.36), the 24 requests 1.1922 (29.45 / 19.34 / 33.31), 32 calibration windows (24 requests, "
    "temperature 1.2) 1.1941 (28.98 / 19.80 / 33.22). Each lever that gained on `wiki-dev` gave it back on "
    "`devref-dev`, as the evaluation texts had found (16 windows, 96 against 24 requests: -1.1% / +1.4% / "
    "+0.9%): the prompt list and the window count trade one domain for another, and none of them moves the "
    "50% point as a whole. The 96 requests stay the default (a tie; no reason to switch back).",
    "",
    "**32 calibration windows at 50%** (`--calib-samples`: 32 from 37.5% of the cache up the default since, 16 "
    "below; `convert.default_calib_samples`): the 50% default converted again with the 96 requests at temperature "
    "1.0 and 32 windows of its own text (probe C_t10_50_r48_p96_c32, 7,997 s of conversion on 2 cores of an AMD "
    "EPYC by the probe's clock; the plan estimates 57 + 23 min of refinement and model stage). The rule, set before "
    "its score was read: adopt if its dev ratio is at least 0.5% below the 16 windows' 1.1918. It lowered every "
    "development text: 28.82 / 19.05 / 32.80 against 29.21 / 19.45 / 33.36 (-1.3% / -2.1% / -1.7%), dev ratio "
    "1.1716 (-1.7%). Adopted at 50%. Unlike the levers before it (the prompt pool, the temperature, 32 windows at "
    "temperature 1.2 with the 24 requests), it held on the evaluation texts too (rows `mla-convert-s200` against "
    "`mla-convert-c16`): on 16 windows 24.21 / 15.12 / 15.79 against 24.44 / 15.55 / 16.18 (-1.0% / -2.8% / "
    "-2.4%), on 4 windows 28.41 / 16.82 / 21.19 against 28.58 / 17.34 / 21.58 (-0.6% / -3.0% / -1.8%). WikiText "
    "at 50% on 16 windows is now 1.2005x the source (20.16): 24.206 against the 24.196 the target allows, above it "
    "by 0.04%; the Debian texts 1.23x and 1.17x. As served: `mla-convert eval out/probe-C_t10_50_r48_p96_c32 "
    "--data ../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 --windows 16 --engine vllm --dtype float32` "
    "gives 24.206 in vLLM's CPU build (CPU_MLA), as in transformers. At 25% the default stays 16 windows: "
    "the 25% targets hold with them, 32 windows there have not been measured on the three-domain split with the "
    "current defaults (with the 24 requests they gained 5.7% on `wiki-dev`, paragraph \"32 calibration "
    "windows\"; with older defaults they lost, 99.8 against 98.4), and they would make the main job about 1.5x "
    "longer (80 min on 2 cores). Between the two measured budgets, the nearer one's choice, as for the "
    "temperature.",
    "",
    "**300 refinement steps at 50%** (`--refine-steps` auto: 300 from 37.5% of the cache up the default since, 200 "
    "below; `refine.default_steps`): the 50% default converted again with 300 steps a layer instead of 200 (probe "
    "C_t10_50_r48_p96_c32_s300, 32 windows, 96 requests, temperature 1.0; 9,053 s by the probe's clock for the "
    "resumed run, 26 of 30 layers at about 4.3 min each plus a 30-min model stage on 2 AMD EPYC cores; the plan "
    "estimates 86 + 23 min). The rule, set before its score was read: adopt if its dev ratio is at least 0.5% "
    "below the default's 1.1716 (at most 1.1657). It lowered every development text: 28.57 / 18.83 / 32.62 "
    "against 28.82 / 19.05 / 32.80 (-0.9% / -1.1% / -0.6%), dev ratio 1.1615. Adopted at 50%. On the 16 evaluation "
    "windows (rows `mla-convert` against `mla-convert-s200`, the probe's folder scored with `--folder`): 24.02 / "
    "14.89 / 15.63 against 24.21 / 15.12 / 15.79 (-0.8% / -1.5% / -1.0%): 1.19x / 1.21x / 1.16x, every issue-15 "
    "target at 50% holds. As served: `mla-convert eval out/probe-C_t10_50_r48_p96_c32_s300 --data "
    "../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 --windows 16 --engine vllm --dtype float32` gives 24.025 "
    "in vLLM's CPU build (CPU_MLA, 434 s by `time`), as in transformers (24.02). On the first 4 windows (the same "
    "folder, `--windows 4`): 28.14 / 16.59 / 20.93 against 28.41 / 16.82 / 21.19 (-1.0% / -1.4% / -1.2%), 1.20x / "
    "1.20x / 1.18x the source, 68% / 64% / 58% below the baseline. At 25% the default stays 200 steps (the 25% "
    "targets hold; the main job's time). The TransMLA-style baseline at 25% on the same 16 windows (`python "
    "scripts/bench_quality.py --methods transmla --budgets 96 --windows 16 --no-source --parallel 2`: its closed "
    "form, 16 self windows at 1.2, 625 s of conversion sampling included) scores 299.83 / 253.88 / 181.18 (14.9x / "
    "20.6x / 13.4x): the 25% default (the main job's folder) is 84% / 88% / 84% below it.",
    "",
    "**As served.** The attention-refined default at 25% (rows `mla-convert-attn`, converted again by the main job, `bash scripts/main.sh`, "
    "into out/smollm2-135m-mla-25) scores in vLLM's CPU build what it scores in transformers: `mla-convert eval "
    "out/smollm2-135m-mla-25 --data ../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 --windows 4 --engine E "
    "--dtype D` gives 89.799 in float32 for both engines (vLLM's CPU_MLA backend) and 89.951 against 89.973 in "
    "bfloat16 (vLLM's AMX_MLA backend on this Intel Xeon; docs/serving.md). The energy default at 25% with the full-width nope key (rows `mla-convert-nope64`; per-layer "
    "latent dims 16-80, each padded to vLLM's width by the plugin) scored 88.040 in vLLM's CPU build (CPU_MLA), as in transformers (88.04): `mla-convert eval "
    "out/bench-quality/mlaconvert-96-self --engine vllm --data ../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 "
    "--windows 4`; at 50% (48-160) it scores 32.146 there, as in transformers (32.15): the same command on "
    "out/bench-quality/mlaconvert-192-self. "
    "The refined 25% uniform default (now at out/bench-quality/mlaconvertuniform-96-self) scored the same in vLLM's "
    "CPU build as in transformers on the same "
    "windows: `mla-convert eval out/bench-quality/mlaconvert-96-self --engine vllm --data "
    "../shared/data/wikitext-2/wiki.test.raw --seq-len 2048 --windows 4` gives 93.899 (attention backend CPU_MLA; "
    "transformers 93.90; the 8-window default: 106.271 and 106.27; the 100-step default: 115.450 and 115.45; at "
    "3e-4: 126.885 and 126.88): calibration and refinement change weights only, never the layout an engine reads.",
    "",
    "**Fine-tuning at 25%, no data set, from the whole-layer default with the MLP at a tenth of the rate** (rows "
    "`mla-convert-mlp0.1+finetune-self-16k` / "
    "`-64k`): `mla-convert finetune --config recipes/smollm2-135m-self.yaml model=out/keep-C_layer max_tokens=N "
    "eval_every=0 output=runs/layer-96-self-{16k,64k}`, recorded with `--folder`. 16,384 tokens (93 s of training by "
    "the loop's log): 67.53 / 40.27 / 39.12, 2.88x / 2.92x / 2.21x, closing 23% / 8% / 17% of the gap (the loop's "
    "held-out sampled text 38.7 -> 30.5). 65,536 tokens (318 s): 63.21 / 39.52 / 39.67, 2.69x / 2.87x / 2.24x, closing "
    "30% / 11% / 14% (-> 26.5). The fine-tuned models end where those from the attention-refined default end (within "
    "3% on every text): the whole-layer refinement gains one-shot what a short fine-tuning recovers anyway.",
    "",
    "**Fine-tuning at 25%, no data set, from the attention-refined default** (rows `mla-convert-attn+finetune-self-16k` / `-64k`): "
    "`mla-convert finetune --config recipes/smollm2-135m-self.yaml model=out/bench-quality/mlaconvert-96-self "
    "max_tokens=16384 eval_every=0 output=runs/w2048-96-self-16k` (LM + distillation from the source on 16,384 tokens "
    "the source sampled itself, the recipe's length; 104 s of training by the loop's log, Intel Xeon), recorded with "
    "`--folder`, closes 31% (WikiText-2, 89.80 -> 69.47), 17% (Debian Reference, 45.72 -> 40.33) and 27% (GNU Coding "
    "Standards, 47.45 -> 39.35) of the gap to the source: 2.96x / 2.93x / 2.22x (the loop's held-out sampled text "
    "41.5 -> 31.1). The issue's longest run, 65,536 tokens (`max_tokens=65536 output=runs/w2048-96-self-64k`, 371 s of "
    "training), closes 40% (-> 63.34), 18% (-> 39.94) and 26% (-> 39.57): 2.70x / 2.90x / 2.24x (held-out sampled "
    "text 41.5 -> 26.8). Against the same runs from the two-window default (below) it ends -0.6%, -4.0% and -2.9% "
    "after 16,384 tokens and +1.1%, +0.7% and -1.3% after 65,536.",
    "",
    "**Fine-tuning at 25%, no data set, from the narrowed default refined on two 1024-token windows a step** (rows "
    "`mla-convert-w1024+finetune-self-16k` / `-64k`): "
    "`mla-convert finetune --config recipes/smollm2-135m-self.yaml model=out/bench-quality/mlaconvert-96-self "
    "max_tokens=16384 eval_every=0 output=runs/nope32-96-self-16k` (LM + distillation from the source on 16,384 "
    "tokens the source sampled itself, the recipe's length; 104 s of training by the loop's log, Intel Xeon), "
    "recorded with `--folder`, closes 29% (WikiText-2, 88.79 -> 69.88), 13% (Debian Reference, 46.35 -> 42.03) and "
    "27% (GNU Coding Standards, 49.09 -> 40.51) of the gap to the source: 2.98x / 3.05x / 2.29x (the loop's held-out "
    "sampled text 32.3 -> 25.0). The issue's longest run, 65,536 tokens (`max_tokens=65536 "
    "output=runs/nope32-96-self-64k`), closes 40% (-> 62.68), 21% (-> 39.67) and 29% (-> 40.10): 2.67x / 2.88x / "
    "2.27x (held-out sampled text 42.6 -> 26.9). Against the same runs from the full-width nope key (below) the "
    "narrowed default ends 3.2%, 4.6% and 0.0% higher after 16,384 tokens and 0.0%, 0.5% and -0.2% after 65,536: "
    "the longer fine-tuning recovers what the narrower query maps lose.",
    "",
    "**Fine-tuning at 25%, no data set, from the energy default with the full-width nope key** (rows "
    "`mla-convert-nope64+finetune-self-16k`): `mla-convert "
    "finetune --config recipes/smollm2-135m-self.yaml model=out/bench-quality/mlaconvert-96-self max_tokens=16384 "
    "eval_every=0 output=runs/energy-96-self-16k` (LM + distillation from the source on 16,384 tokens the source "
    "sampled itself, the recipe's length; 171 s of training by the loop's log on quiet cores), recorded with "
    "`--folder`, closes 31% (WikiText-2, 88.04 -> 67.74), 18% (Debian Reference, 45.96 -> 40.18) and 26% (GNU Coding "
    "Standards, 48.52 -> 40.49) of the gap to the source: 2.88x / 2.92x / 2.29x (the loop's held-out sampled text "
    "42.4 -> 31.5). The issue's longest run, 65,536 tokens (rows `mla-convert-nope64+finetune-self-64k`, `max_tokens=65536 "
    "output=runs/energy-96-self-64k`, 575 s of training), closes 39% (88.04 -> 62.68), 20% (45.96 -> 39.49) and 27% "
    "(48.52 -> 40.19): 2.67x / 2.87x / 2.27x the source (held-out sampled text 42.4 -> 26.7). The same two runs from "
    "the uniform default (rows `mla-convert-uniform+finetune-self-16k` / `-64k`, outputs runs/c16-96-self-16k / -64k; "
    "157 s and 585 s of training) closed 27% / 15% / 25% (93.90 -> 75.10, 48.90 -> 43.58, 49.69 -> 41.73) and 38% / "
    "23% / 26% (-> 67.18, 40.65, 41.38): from the energy default each run ends lower on every text.",
    "",
    "**Fine-tuning from the 8-window default** (rows `mla-convert-c8+finetune-self-4k`): `mla-convert finetune "
    "--config recipes/smollm2-135m-self.yaml model=out/bench-quality/mlaconvert-96-self max_tokens=4096 "
    "eval_every=0 output=runs/refined200-96-self-4k` (LM + distillation from the source on 4,096 tokens the source "
    "sampled itself; 44 s of training by the loop's log on quiet cores), recorded with `--folder`. From the "
    "200-step, 8-window default (then at out/bench-quality/mlaconvert-96-self) it closes 15% (WikiText-2, 106.27 -> "
    "94.12), 7% (Debian Reference, 54.04 -> 51.18) and 22% (GNU Coding Standards, 51.33 -> 43.89) of the gap "
    "to the source (the loop's held-out sampled text 40.6 -> 35.0). The "
    "recipe's own length, 16,384 tokens (rows `mla-convert-c8+finetune-self-16k`, `max_tokens=16384 "
    "output=runs/refined200-96-self-16k`, 155 s of training), closes 32% (106.27 -> 79.73), 17% (54.04 -> 47.29) and "
    "27% (51.33 -> 42.29): 3.39x / 3.43x / 2.39x the source (held-out sampled text 37.3 -> 27.5; its held-out "
    "windows are the last of a longer stream, hence another start). The same "
    "run from the 100-step default (then at out/bench-quality/mlaconvert-96-self, output runs/refined1e3-96-self-4k, "
    "188 s on shared cores) closed 14% / 6% / 23% (115.45 -> 102.31, 58.04 -> 55.42, 55.04 -> 46.38), from the "
    "default refined at 3e-4 16% / 8% / 26% (126.88 -> 110.59, 62.05 -> 58.24, 59.58 -> 48.61), and from the closed "
    "form alone 34% / 42% / 47% (187.71 -> 132.70, 101.80 -> 64.71, 92.12 -> 56.95), each ending higher.",
    "",
]
WINDOWS_NOTE = [
    "Windows: 4 x 2048 tokens per text (not the 16 of the earlier protocol) because every evaluation shared 2 cores "
    "with other jobs; ratios are to the source on the same windows. The 50% default and its baseline are also "
    "measured on 16 windows (the table of that name; paragraph \"More windows at 50%\" in the history below).",
    "",
]

SHOWN = {str(DATA): "../shared/data/wikitext-2", str(DEV): "out/dev"}  # how paths appear in the report
SOURCE_CACHE = 384  # SmolLM2-135M: 2 x 3 kv heads x 64 per token per layer
PROBE_SOURCE_PPL = {"A": 18.84, "B": 18.84, "C": 25.725}  # the source on each series' 2 windows (test; C: wiki-dev)
PROBE_SERIES = {
    "A": "the earlier code (real-PCA merge, token inputs); unlisted: 2-norm, unrotated, objective kv, no balance, "
         "d_r 32, 32 x 512 calibration, unless `defaults` says.",
    "B": "this code; unlisted: attention strategy with the attention-weighted complex merge, expected rotation, "
         "objective kv, balance 1, d_r a third of the budget, 8 x 2048 calibration, token inputs for keys and values, "
         "uniform ranks, no latent rounds (the defaults before the last probes chose the attended inputs).",
    "C": "the development split (`W=2 python scripts/explore_quality.py NAME key=value ...`: the embedded model, "
         "`self` calibration, the first 2 windows of `wiki-dev`), 25%; unlisted: the defaults of this code. What "
         "chose the refinement (`--refine-steps`) and its settings. The first four rows ran through an in-process "
         "script of the same protocol before explore_quality.py was moved onto it.",
    "D": "the development split of three domains (`W=4 python scripts/explore_quality.py NAME key=value ...`, or "
         "`--score NAME FOLDER` for a folder converted before): the first 4 windows of `wiki-dev`, `devref-dev` and "
         "`fortunes-dev` each; `dev ratio` is the geometric mean of the three ratios to the source (row `source`), "
         "the score a choice is made on since; unlisted options: the defaults of this code.",
}


# What the baselines (their papers' closed forms) do not have: this project's per-layer ranks, latent rounds,
# refinement of the layers and model stage, spelled out so that a change of mla-convert's defaults never reaches them.
PLAIN = ["--value-inputs", "token", "--key-inputs", "token", "--latent-rounds", "0", "--rank-allocation", "uniform",
         "--refine-steps", "0", "--refine-model-steps", "0"]


def method_options(method: str, budget: int) -> list[str]:
    """CLI options of `mla-convert llama` for a method at a budget (elements per token per layer)."""
    if method == "mha2mla":
        d_r = 24
        return ["--rope-dims", str(d_r), "--rope-strategy", "2-norm", "--no-rope-merge", "--method", "weight",
                "--objective", "kv", "--dropped-rope", "unrotated", *PLAIN, "--rank", str(budget - d_r)]  # fmt: skip
    if method == "transmla":
        d_r = min(64, budget // 2)
        return ["--rope-dims", str(d_r), "--rope-strategy", "high", "--rope-merge", "--method", "activation",
                "--objective", "kv", "--kv-balance", "1", "--dropped-rope", "unrotated", *PLAIN,
                "--rank", str(budget - d_r)]  # fmt: skip
    if method == "mla-convert":
        return ["--kv-budget", str(budget)]
    if method == "mla-convert-mlp0.1":  # the MLP at a tenth of the refinement's learning rate (the default before 1)
        return ["--kv-budget", str(budget), "--refine-mlp-lr-scale", "0.1"]
    if method == "mla-convert-attn":  # refinement trains the attention alone (the default before the whole layer)
        return ["--kv-budget", str(budget), "--refine-scope", "attention"]
    if method == "mla-convert-norefine":  # the default's closed form alone (the default before refinement existed)
        return ["--kv-budget", str(budget), "--refine-steps", "0"]
    if method == "mla-convert-s100":  # the default's first number of refinement steps (the default before 200)
        return ["--kv-budget", str(budget), "--refine-steps", "100", "--refine-scope", "attention"]
    if method == "mla-convert-uniform":  # every layer the same latent dims (the default before energy)
        return ["--kv-budget", str(budget), "--rank-allocation", "uniform", "--refine-scope", "attention"]
    if method == "mla-convert-c8":  # the default's first calibration length, 8 x 2048 (the default before 16)
        return ["--kv-budget", str(budget), "--calib-samples", "8", "--refine-scope", "attention"]
    if method == "mla-convert-nope64":  # nope query/key at SmolLM2's full head_dim 64 (the default before d_h - d_r)
        return ["--kv-budget", str(budget), "--nope-dims", "64", "--refine-scope", "attention"]
    if method == "mla-convert-w1024":  # two 1024-token refinement windows a step (the default before one of 2048)
        return ["--kv-budget", str(budget), "--refine-seq-len", "1024", "--refine-scope", "attention"]
    if method == "mla-convert-lr3e-4":  # the default's first refinement learning rate (the default before 1e-3)
        return ["--kv-budget", str(budget), "--refine-lr", "3e-4", "--refine-scope", "attention"]
    if method.startswith("custom:"):  # custom:OPTIONS (space separated), for ablations
        return method[len("custom:") :].split() + (["--kv-budget", str(budget)] if "--rank" not in method else [])
    raise SystemExit(f"unknown method {method}")


def timed(cmd: list[str], log: Path) -> tuple[int, float, int]:
    """Run a command; (exit status, wall seconds, peak RSS bytes of that process)."""
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), time.perf_counter() - start, usage.ru_maxrss * 1024


def prepare_texts() -> None:
    """The domain texts (evaluation and development, from their Debian packages) and the two halves of
    wiki.valid.tokens, when missing."""
    if not all(TEXTS[n].is_file() for n in ("debian-reference", "gnu-standards", "devref-dev", "fortunes-dev")):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "domain_texts.py"), "--out", str(DOMAINS),
                        "--dev-out", str(DEV)], check=True)  # fmt: skip
    if not (DEV / "wiki.valid.second-half.tokens").is_file():
        DEV.mkdir(parents=True, exist_ok=True)
        lines = (DATA / "wiki.valid.tokens").read_text(encoding="utf-8").splitlines(keepends=True)
        half = len(lines) // 2
        (DEV / "wiki.valid.first-half.tokens").write_text("".join(lines[:half]), encoding="utf-8")
        (DEV / "wiki.valid.second-half.tokens").write_text("".join(lines[half:]), encoding="utf-8")


def shown(text: str) -> str:
    for path, name in SHOWN.items():
        text = text.replace(path, name)
    return text


def evaluate_texts(folder: str | None, args, work: Path, tag: str, have: dict | None = None) -> dict:
    """{text name: eval result} for every text of --texts (those in `have` are kept, not measured again), with up to
    --parallel evaluation processes at once."""
    from concurrent.futures import ThreadPoolExecutor

    out = dict(have or {})
    todo = [name for name in args.texts if name not in out]
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        for name, result in zip(todo, pool.map(lambda n: evaluate(folder, args, work, f"{tag}.{n}", TEXTS[n]), todo)):
            out[name] = result
            print(f"  {tag} on {name}: {result['perplexity']:.2f}", flush=True)
    return {name: out[name] for name in args.texts if name in out} | out


def evaluate(folder: str | None, args, work: Path, tag: str, text: Path = DATA / "wiki.test.raw") -> dict:
    out_json = work / f"{tag}.eval.json"
    cmd = [args.mla, "eval"] + ([folder] if folder else []) + [
        "--data", str(text), "--seq-len", "2048", "--windows", str(args.windows), "--json",
        str(out_json), "--overwrite", "-q"]  # fmt: skip
    code, wall, rss = timed(cmd, work / f"{tag}.eval.log")
    if code:
        raise SystemExit(f"eval of {tag} failed: see {work / (tag + '.eval.log')}")
    result = json.loads(out_json.read_text())
    return {"perplexity": result["perplexity"], "kv_bytes_per_token": result["kv_cache_bytes_per_token"],
            "eval_s": round(wall, 1), "eval_rss_mb": round(rss / 2**20)}  # fmt: skip


def load_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def write_report(args) -> None:
    """benchmarks/quality/README.md: the current results first (the targets, the every-domain tables of the
    self-calibrated defaults and baselines), then the history: what chose each default, the development-split probes,
    the earlier WikiText-only protocol's tables and probes, and the plot."""
    bench = BENCH
    everything = load_results(bench / "quality.jsonl")
    rows = latest([r for r in everything if "texts" in r])
    dev = latest([r for r in load_results(bench / "quality_dev.jsonl") if "texts" in r])
    lines = [
        "# One-shot conversion quality (no fine-tuning)",
        "",
        "SmolLM2-135M-Instruct (embedded default, float32), converted by `mla-convert llama` at each KV-cache budget "
        "and evaluated on WikiText-2 raw test and on two texts of other domains that ship in Debian packages "
        "(`python scripts/domain_texts.py`: the Debian Reference manual, package debian-reference-en, and the GNU "
        "Coding Standards, package gnu-standards; plain text, their first 2048-token windows). Each perplexity is "
        "shown with its ratio to the source on the same text. Written by `python scripts/bench_quality.py` "
        "(`--calib`, `--texts`, `--windows` per table).",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs while it ran); every method "
        "through the same pipeline, one process per conversion and per evaluation. The baselines (mha2mla, "
        "transmla) are written by us from the papers (see the script's docstring), calibrated on the same text as "
        "the row they are compared with.",
        "",
        "**Splits.** Calibration: `self` (text sampled from the source, the data-free default) or WikiText-2 "
        "validation. Development split for choices: the second half of `wiki.valid.tokens` (`wiki-dev`), which no "
        "calibration reads (wiki-calibrated probes use the first half); since the probes of series D (at the end of "
        "this file) with two documents of other domains from Debian packages beside it, the Debian Developer's "
        "Reference (`devref-dev`, package developers-reference) and English epigrams and verse (`fortunes-dev`, "
        "package fortunes), 4 windows of each, a choice made on the geometric mean of the three ratios to the "
        "source (`dev ratio`). Evaluation only: WikiText-2 test, debian-reference, gnu-standards; no choice is made "
        "on them.",
        "",
        *WINDOWS_NOTE,
        *acceptance(rows),
    ]
    lines += domain_report(rows, "Every domain", "Calibration and method per row; `vs transmla`: per text, against "
                           "the TransMLA-style baseline at the same budget and calibration.")
    lines += ["# History: what chose the defaults", "",
              "Each default's choice in short, with its pointer here: docs/decisions.md. The measurements, in the "
              "order they were made:", "", *NOTES]
    lines += domain_report(dev, "Development split (the choices)", "Probes on `wiki-dev` (the second half of "
                           "wiki.valid.tokens), never on evaluation text.")
    rows = [r for r in everything if "texts" not in r]
    lines += ["# Earlier protocol: WikiText-2 only, calibrated on wiki.valid.tokens", "",
              "Before data-free calibration: calibration on WikiText-2 validation (`wiki.valid.tokens`), perplexity on "
              "WikiText-2 raw test, the first 2048-token windows. The probes below chose the earlier defaults on the "
              "first test windows (kept for the record; the development split above replaces them).", ""]  # fmt: skip
    counts = sorted({r["windows"] for r in rows}, reverse=True)
    for windows in counts:
        lines += table([r for r in rows if r["windows"] == windows], windows)
    probes = BENCH / "quality_probes.jsonl"
    if probes.exists():  # the probes that chose the defaults (scripts/explore_quality.py)
        lines += ["## Probes that chose the defaults (2 windows, series D 4; not the protocol)", "",
                  "In-process conversions of the embedded model, 2 windows. Series A and B (the earlier defaults, at "
                  "50%) scored the first 2 test windows, before a development split existed; series C scores the "
                  "development split. Options are ConvertOptions fields; unlisted ones are the defaults of the "
                  "probe's series:", ""]  # fmt: skip
        probe_rows = [json.loads(line) for line in probes.read_text().splitlines() if line.strip()]
        for series, text in PROBE_SERIES.items():
            if series == "D":
                lines += dev_probe_table([r for r in probe_rows if r.get("series") == series], text)
                continue
            lines += [f"**Series {series}**: {text} The source scores {PROBE_SOURCE_PPL[series]}.", "",
                      "| probe | perplexity (2 windows unless noted) | options |", "|---|---|---|"]  # fmt: skip
            for p in (r for r in probe_rows if r.get("series", "A") == series):
                opts = ", ".join(f"{k}={v}" for k, v in p.items() if k not in ("name", "ppl", "W", "convert_s", "series"))
                count = f" ({p['W']} windows)" if p.get("W", 2) != 2 else ""
                ppl = "stopped" if p["ppl"] is None else f"{p['ppl']:.1f}"  # a probe stopped before its score
                lines.append(f"| {p['name']} | {ppl}{count} | {opts} |")
            lines.append("")
    lines += ["![perplexity vs budget](quality.png)", ""]
    (BENCH / "README.md").write_text("\n".join(lines))
    if counts:
        chosen = [r for r in rows if r["windows"] == (16 if 16 in counts else counts[0])]
        plot(chosen, next((r for r in chosen if r["method"] == "source"), None))


def dev_probe_table(rows: list[dict], text: str) -> list[str]:
    """Series D: each probe's perplexity on every development text, its dev ratio and its options."""
    lines = [f"**Series D**: {text}", "", "| probe | " + " | ".join(DEV_TEXTS) + " | dev ratio | options |",
             "|---|" + "---|" * len(DEV_TEXTS) + "---|---|"]  # fmt: skip
    for p in rows:
        opts = ", ".join(f"{k}={v}" for k, v in p.items()
                         if k not in ("name", "ppl", "W", "series", "dev", "dev_ratio"))  # fmt: skip
        cells = [f"{p['dev'][t]:.2f}" for t in DEV_TEXTS]
        count = f" ({p['W']} windows)" if p["W"] != 4 else ""  # ratios compare only at the same count
        lines.append(f"| {p['name']}{count} | " + " | ".join(cells) + f" | {p['dev_ratio']:.4f} | {opts} |")
    return lines + [""]


def table(rows: list[dict], windows: int) -> list[str]:
    source = next((r for r in rows if r["method"] == "source"), None)
    lines = [f"## {windows} x 2048-token windows", ""]
    if source:
        lines += [f"Source model: perplexity **{source['perplexity']:.2f}**, {SOURCE_CACHE} cached elements per token "
                  f"per layer ({source['kv_bytes_per_token']} bytes per token, float32).", ""]  # fmt: skip
    lines += ["| budget (elements/token/layer) | % of source | method | d_c | d_r | perplexity | vs best baseline | "
              "convert s | convert peak RSS MB | command |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    budgets = sorted({r["budget"] for r in rows if r["method"] != "source"}, reverse=True)
    for budget in budgets:
        at = [r for r in rows if r.get("budget") == budget]
        base = [r["perplexity"] for r in at if r["method"] in ("mha2mla", "transmla")]
        best = min(base) if base else None
        for r in sorted(at, key=lambda r: r["perplexity"]):
            rel = f"{100 * (r['perplexity'] / best - 1):+.0f}%" if best and r["method"] not in ("mha2mla", "transmla") else ""
            lines.append(
                f"| {budget} | {100 * budget / SOURCE_CACHE:g} | {r['method']} | {latent(r)} | {r['d_r']} | "
                f"{r['perplexity']:.2f} | {rel} | {r['convert_s']:.0f} | {r['convert_rss_mb']} | `{r['command']}` |"
            )
    return lines + [""]


def latent(row: dict) -> str:
    """d_c: the layers' rank, or their mean and range when a rank allocation shared the dims unevenly."""
    low, high = row.get("d_c_range", [row["d_c"], row["d_c"]])
    return f"{row['d_c']:g}" if low == high else f"{row['d_c']:g} ({low}-{high})"


def plot(rows: list[dict], source: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in sorted({r["method"] for r in rows if r["method"] != "source"}):
        pts = sorted((r["budget"], r["perplexity"]) for r in rows if r["method"] == method)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    if source:
        ax.axhline(source["perplexity"], color="black", linestyle="--", label=f"source ({source['perplexity']:.1f})")
    ax.set_yscale("log")
    ax.set_xlabel("KV cache per token per layer (elements; source 384)")
    ax.set_ylabel("WikiText-2 test perplexity (log)")
    ax.set_title("SmolLM2-135M, one-shot MLA conversion")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(BENCH / "quality.png", dpi=120)


def latest(rows: list[dict]) -> list[dict]:
    """One row per (method, budget, windows, calibration): the last one written."""
    out = {}
    for r in rows:
        out[(r["method"], r.get("budget"), r.get("windows"), r.get("calib"))] = r
    return list(out.values())


# issue 15's targets for the default conversion: (ratio to the source on WikiText, on each other text) per budget
TARGETS = {192: (1.2, 1.5), 96: (2.5, 5.0)}
BASELINE_MARGIN = 0.30  # and at least 30% below the TransMLA-style baseline at the same budget


def acceptance(rows: list[dict]) -> list[str]:
    """Which of the targets hold for the default (`mla-convert`, data-free `self` calibration), per budget and text."""
    lines = []
    for windows in sorted({r["windows"] for r in rows}, reverse=True):
        source = next((r for r in rows if r["method"] == "source" and r["windows"] == windows), None)
        for budget, (wiki, other) in TARGETS.items():
            row = next((r for r in rows if r["method"] == "mla-convert" and r["budget"] == budget
                        and r["calib"] == "self" and r["windows"] == windows), None)  # fmt: skip
            base = next((r for r in rows if r["method"] == "transmla" and r["budget"] == budget
                         and r["calib"] == "self" and r["windows"] == windows), None)  # fmt: skip
            if source is None or row is None:
                continue
            cells = []
            for t, v in row["texts"].items():
                ratio = v["perplexity"] / source["texts"][t]["perplexity"]
                target = wiki if t == "wikitext" else other
                digits = 2 if (round(ratio, 2) <= target) == (ratio <= target) else 4  # as many as the verdict needs
                cell = f"{t} {ratio:.{digits}f}x (target {target}x: {'holds' if ratio <= target else 'misses'}"
                if base and t in base["texts"]:
                    below = 1 - v["perplexity"] / base["texts"][t]["perplexity"]
                    cell += f"; {100 * below:.0f}% below transmla: {'holds' if below >= BASELINE_MARGIN else 'misses'}"
                cells.append(cell + ")")
            lines.append(f"- {100 * budget / SOURCE_CACHE:g}% ({budget}), {windows} windows: " + "; ".join(cells) + ".")
    return (["**Targets (issue 15) for the default, data-free conversion**, from the table below:", "", *lines, ""]
            if lines else [])


def domain_report(rows: list[dict], title: str, note: str) -> list[str]:
    """Tables of rows measured on several texts: perplexity and its ratio to the source on the same text, and the
    change against the TransMLA-style baseline at the same budget and calibration."""
    lines = []
    for windows in sorted({r["windows"] for r in rows}, reverse=True):
        at_w = [r for r in rows if r["windows"] == windows]
        source = next((r for r in at_w if r["method"] == "source"), None)
        if source is None:
            continue
        texts = [t for t in TEXTS if t in source["texts"]]
        lines += [f"## {title}: {windows} x 2048-token windows", "", note, "",
                  "Source perplexity: " + ", ".join(f"{t} **{source['texts'][t]['perplexity']:.2f}**" for t in texts)
                  + ".", "",
                  "| budget | % | method | calibration | d_c | d_r | " + " | ".join(texts) + " | vs transmla | command |",
                  "|---|---|---|---|---|---|" + "---|" * len(texts) + "---|---|"]  # fmt: skip
        models = [r for r in at_w if r["method"] != "source"]
        for budget in sorted({r["budget"] for r in models}, reverse=True):
            for r in sorted((r for r in models if r["budget"] == budget), key=lambda r: (r["calib"], r["method"])):
                base = next((b for b in models if b["method"] == "transmla" and b["budget"] == budget
                             and b["calib"] == r["calib"]), None)  # fmt: skip
                cells, versus = [], []
                for t in texts:
                    if t not in r["texts"]:
                        cells.append("")
                        continue
                    ppl = r["texts"][t]["perplexity"]
                    cells.append(f"{ppl:.2f} ({ppl / source['texts'][t]['perplexity']:.2f}x)")
                    if base and r is not base and t in base["texts"]:
                        versus.append(f"{100 * (ppl / base['texts'][t]['perplexity'] - 1):+.0f}%")
                lines.append(f"| {budget} | {100 * budget / SOURCE_CACHE:g} | {r['method']} | {r['calib']} | "
                             f"{latent(r)} | {r['d_r']} | " + " | ".join(cells) + f" | {' / '.join(versus)} | "
                             f"`{r['command']}` |")  # fmt: skip
        lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="192,96", help="elements per token per layer, comma separated")
    ap.add_argument("--methods", default="transmla,mla-convert", help="comma separated (see above)")
    ap.add_argument("--texts", default="wikitext,debian-reference,gnu-standards",
                    help=f"evaluation texts, comma separated: {', '.join(TEXTS)} (wiki-dev: the development split)")
    ap.add_argument("--calib", default="self", help=f"calibration text: {', '.join(CALIBS)}")
    ap.add_argument("--windows", type=int, default=8, help="2048-token windows per text")
    ap.add_argument("--results", type=Path, default=BENCH / "quality.jsonl",
                    help="results file (benchmarks/quality/quality_dev.jsonl for choices made on the development "
                    "split)")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite README.md and quality.png from the results files")
    ap.add_argument("--redo", action="store_true", help="measure again what the results file already holds")
    ap.add_argument("--no-source", action="store_true", help="do not measure the source (another run does)")
    ap.add_argument("--reuse", action="store_true", help="evaluate a complete converted folder already under "
                    "out/bench-quality (same method, budget and calibration) instead of converting again")
    ap.add_argument("--parallel", type=int, default=1, help="evaluation processes at once (one per text)")
    ap.add_argument("--folder", type=Path, help="evaluate this model folder (e.g. a fine-tuned run's final/) as the "
                    "row of --methods NAME at --budgets B instead of converting")
    ap.add_argument("--keep", action="store_true", help="keep every converted folder (under out/bench-quality; the "
                    "default method's are always kept)")
    args = ap.parse_args()
    args.command = "python scripts/bench_quality.py " + " ".join(sys.argv[1:])
    args.mla = str(Path(sys.executable).with_name("mla-convert"))
    args.texts = args.texts.split(",")
    if unknown := [t for t in args.texts if t not in TEXTS] + ([args.calib] if args.calib not in CALIBS else []):
        raise SystemExit(f"unknown text or calibration {unknown[0]}: choose from {', '.join([*TEXTS, *CALIBS])}")
    BENCH.mkdir(parents=True, exist_ok=True)
    work = ROOT / "out" / "bench-quality"
    work.mkdir(parents=True, exist_ok=True)

    def record(row: dict) -> None:
        with args.results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        write_report(args)

    if args.report_only:
        return write_report(args)
    prepare_texts()
    rows = [] if args.redo else latest([r for r in load_results(args.results) if "texts" in r])
    done = {(r["method"], r.get("budget"), r["windows"], r.get("calib")): r for r in rows}
    source = done.get(("source", None, args.windows, None))
    if not args.no_source and (source is None or not all(t in source["texts"] for t in args.texts)):  # once
        texts = evaluate_texts(None, args, work, "source", source["texts"] if source else None)
        record({"method": "source", "budget": None, "windows": args.windows, "calib": None, "texts": texts})
    calib = str(CALIBS[args.calib])
    for budget in [int(b) for b in args.budgets.split(",")]:
        for method in filter(None, args.methods.split(",")):
            have = done.get((method, budget, args.windows, args.calib))
            if have and all(t in have["texts"] for t in args.texts):
                continue
            name = f"{method.replace(':', '_').replace(' ', '_').replace('-', '')[:60]}-{budget}-{args.calib}"
            out = args.folder or work / name
            options = [] if args.folder else method_options(method, budget)
            wall, rss = 0.0, 0
            reuse = args.reuse and (out / "provenance.json").is_file()
            if not (have and out.is_dir()) and not args.folder and not reuse:  # a row lacking a text: from its folder
                cmd = [args.mla, "llama", "--calib-data", calib, "-o", str(out), "--overwrite", "--dtype", "float32",
                       "-q", *options]  # fmt: skip
                code, wall, rss = timed(cmd, work / f"{name}.convert.log")
                if code:
                    print(f"{method} at {budget}: conversion failed, see {work / (name + '.convert.log')}")
                    continue
                have = None
            prov = json.loads((out / "provenance.json").read_text())
            while "plan" not in prov and prov.get("parent"):  # a fine-tuned folder: the conversion is further up
                prov = prov["parent"]
            texts = evaluate_texts(str(out), args, work, name, have["texts"] if have else None)
            ranks = prov["plan"]["ranks"]
            row = have or {"method": method, "budget": budget, "windows": args.windows, "calib": args.calib,
                           "d_c": sum(ranks) / len(ranks), "d_c_range": [min(ranks), max(ranks)],
                           "d_r": prov["plan"]["rope_dims"], "convert_s": round(wall, 1),
                           "convert_rss_mb": round(rss / 2**20), "options": prov["options"],
                           "command": shown(" ".join(["mla-convert llama", *options, "--calib-data", calib]))
                           if not args.folder else f"{method} ({args.folder.name})"}  # fmt: skip
            row["texts"] = texts
            record(row)
            print(f"{method} at {budget} ({args.calib}): " + ", ".join(f"{t} {v['perplexity']:.2f}" for t, v in texts.items()),
                  flush=True)  # fmt: skip
            if not args.keep and method != "mla-convert" and not args.folder:  # the default's serve bench_convert.py
                subprocess.run(["rm", "-rf", str(out)])


if __name__ == "__main__":
    main()
