"""Rank allocation across layers: one global latent budget shared by the layers' spectra."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import mla_convert  # noqa: F401
from mla_convert.lowrank import allocate_ranks
from mla_convert.modeling.compat import output_cache
from mla_convert.modeling.configuration_mla import layer_ranks


def test_allocation_follows_relative_spectra():
    flat = torch.ones(32)  # every dim removes the same share of this layer's error
    steep = 0.5 ** torch.arange(32.0)  # a few dims carry this layer
    ranks = allocate_ranks([flat, steep, flat * 100], total=52, unit=4, floor=4)
    assert sum(ranks) == 52 and all(r % 4 == 0 and r >= 4 for r in ranks)
    assert ranks[1] == 4  # the steep layer needs only its floor
    assert ranks[0] == ranks[2] == 24  # scale does not matter: relative error does
    assert allocate_ranks([flat, steep], total=64, unit=1, floor=1, cap=32) == [32, 32]  # the caps bind
    with pytest.raises(ValueError):
        allocate_ranks([flat, steep], total=66, unit=1, floor=1)  # more than the spectra hold


def test_energy_allocation_stays_within_the_served_latent_width():
    """Layers get no more latent dims than the smallest vLLM MLA width holding the uniform rank (256 for 240): the
    served cache layout is the one the uniform allocation gets."""
    from types import SimpleNamespace

    from mla_convert.conversion.plan import allocate

    flat, steep = torch.ones(576), 0.5 ** torch.arange(576.0)
    assert allocate(SimpleNamespace(kv_lora_rank=[240, 240], layers=2), [flat, steep], cap=576) == [256, 224]
    assert allocate(SimpleNamespace(kv_lora_rank=[64, 64], layers=2), [flat, steep], cap=576) == [112, 16]
    assert allocate(SimpleNamespace(kv_lora_rank=[480, 480], layers=2), [flat, steep], cap=576) == [512, 448]
    # below 4 dims a layer (--rank 3) there are no kernel-friendly units: single dims, at least one a layer (the
    # steep layer's first dims remove more error than any of the flat one's)
    assert allocate(SimpleNamespace(kv_lora_rank=[3, 3], layers=2), [flat, steep], cap=576) == [1, 5]


@pytest.fixture(scope="module")
def steep_first_layer(tmp_path_factory):
    """A tiny llama whose layer 0 keys and values are nearly rank 2: a few latent dims carry that layer."""
    from tiny import tiny_source

    folder = tiny_source("llama-gqa", tmp_path_factory.mktemp("steep") / "src", seed=3)
    model = AutoModelForCausalLM.from_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for proj in (model.model.layers[0].self_attn.k_proj, model.model.layers[0].self_attn.v_proj):
            rows, cols = proj.weight.shape
            low = torch.randn(rows, 2, generator=gen) @ torch.randn(2, cols, generator=gen) * 0.1
            proj.weight.copy_(low + 1e-3 * torch.randn(rows, cols, generator=gen))
    model.save_pretrained(folder)
    return folder


def test_energy_allocation_converts_at_the_same_cache(steep_first_layer, convert_tiny):
    uniform = convert_tiny(steep_first_layer, rank=8, rope_dims=4, rank_allocation="uniform")
    shared = convert_tiny(steep_first_layer, rank=8, rope_dims=4, rank_allocation="energy")
    default = convert_tiny(steep_first_layer, rank=8, rope_dims=4)  # energy by default (source calibration)
    # along the converted stream too: the spectra come from the source's stream before any layer is converted
    sequential = convert_tiny(steep_first_layer, rank=8, rope_dims=4, calib_propagate="converted", refine_steps=0)
    cfg_u, cfg_s, cfg_d, cfg_q = (json.loads((f / "config.json").read_text())
                                  for f in (uniform, shared, default, sequential))
    assert layer_ranks(cfg_u) == [8, 8]
    assert layer_ranks(cfg_d) == layer_ranks(cfg_s) == layer_ranks(cfg_q)
    assert json.loads((sequential / "provenance.json").read_text())["options"]["rank_allocation"] == "energy"
    ranks = layer_ranks(cfg_s)
    assert sum(ranks) == 16 and ranks[0] < 8 < ranks[1]
    record = json.loads((shared / "provenance.json").read_text())
    assert record["plan"]["ranks"] == ranks
    assert record["options"]["rank_allocation"] == "energy"
    model = AutoModelForCausalLM.from_pretrained(shared).eval()
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    for layer, rank in enumerate(ranks):
        assert output_cache(out).layers[layer].keys.shape[-1] == rank  # the latent cache has the layer's rank


def test_split_factorization_records_per_token_values(sources, convert_tiny):
    """The attended-value refit needs the joint latent: with --factorization split, provenance says what ran."""
    out = convert_tiny(sources["llama-gqa"], rank=8, rope_dims=4, factorization="split")
    record = json.loads((out / "provenance.json").read_text())
    assert record["options"]["value_inputs"] == "token"
    assert "attended inputs" not in record["method"]


@pytest.mark.parametrize("what", ["pipeline.KEEP_STATISTICS_BYTES", "plan.KEEP_HIDDEN_BYTES"])
def test_statistics_kept_from_the_statistics_pass_convert_identically(steep_first_layer, convert_tiny, monkeypatch,
                                                                       what):
    """The conversion pass reuses the statistics and the hidden states the energy allocation's pass took on the same
    source stream: the output is the one that taking them again gives, tensor for tensor (refinement included)."""
    from safetensors.torch import load_file

    from mla_convert.conversion import pipeline, plan

    from mla_convert.conversion.statistics import LayerRunner

    advances = []
    forward = LayerRunner.advance
    monkeypatch.setattr(LayerRunner, "advance", lambda self, layer: advances.append(1) or forward(self, layer))
    options = dict(rank=8, rope_dims=4, rank_allocation="energy", refine_steps=3, refine_model_steps=2)
    kept = convert_tiny(steep_first_layer, **options)
    runs = len(advances)
    module, name = what.split(".")
    monkeypatch.setattr({"pipeline": pipeline, "plan": plan}[module], name, 0)
    taken_again = convert_tiny(steep_first_layer, **options)
    layers = json.loads((kept / "config.json").read_text())["num_hidden_layers"]
    # the statistics pass runs every source layer; the conversion pass again only where it was not kept
    assert (runs, len(advances) - runs) == ((layers, 2 * layers) if module == "plan" else (layers, layers))
    a, b = (load_file(str(next(f.glob("*.safetensors")))) for f in (kept, taken_again))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert json.loads((kept / "config.json").read_text()) == json.loads((taken_again / "config.json").read_text())
