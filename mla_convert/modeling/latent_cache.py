"""The native model's KV cache held in a block cache type for real: each layer's cached rows [latent, rope key] as
ggml's block bytes (`kvquant.pack`), read back on every step, for a model whose config names `latent_cache_type`."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from mla_convert import kvquant


class TypedLatentLayer(DynamicLayer):
    """One layer's cached rows [latent, rope key] held as the cache type `kind` stores them (`kvquant.pack`: ggml's
    block bytes, the latent zero-padded to whole blocks; a float type's own bytes): `keys` uint8 [B, 1, S, row bytes],
    `values` empty [B, 1, S, 0], so the cache's byte count is the type's. `update` returns the whole history read back
    (dequantized on read), in the model's dtype: the values `round_trip_latent` gives, bit for bit."""

    def __init__(self, kind: str, d_c: int, d_r: int):
        super().__init__()
        self.kind, self.d_c, self.d_r = kind, d_c, d_r
        self.pad = kvquant.latent_padding(d_c, d_r, kind)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype
        self.keys, self.values = self.keys.to(torch.uint8), self.values.to(torch.uint8)

    def update(self, latent: torch.Tensor, k_rope: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(latent, k_rope)
        parts = (latent, latent.new_zeros(*latent.shape[:-1], self.pad), k_rope) if self.pad else (latent, k_rope)
        packed = kvquant.pack(torch.cat(parts, dim=-1), self.kind)
        self.keys = torch.cat([self.keys, packed], dim=-2)
        self.values = torch.cat([self.values, packed[..., :0]], dim=-2)
        row = kvquant.unpack(self.keys, self.kind).to(self.dtype)
        return row[..., : self.d_c], row[..., self.d_c + self.pad :]


def cache_layer(cache: Cache | None, index: int):
    layers = getattr(cache, "layers", None) or []
    return layers[index] if index < len(layers) else None


def rows_as_cached(latent: torch.Tensor, k_rope: torch.Tensor, config, cache: Cache | None, index: int):
    """Layer `index`'s new rows as the model's cache type gives them back (`latent_cache_type`; none: unchanged): a
    layer holding that type reads them so itself (`TypedLatentLayer.update`), every other path rounds them here."""
    kind = getattr(config, "latent_cache_type", None)
    if not kind or getattr(cache_layer(cache, index), "kind", None) == kind:
        return latent, k_rope
    return kvquant.round_trip_latent(latent, k_rope, kind)


def held_type(config) -> str | None:
    """The cache type a model's dynamic cache holds its rows in (`latent_cache_type`), None where it holds floats: no
    type or f32, or sliding-window layers (their cache drops rows; they read the rows as the type gives them back)."""
    kind = getattr(config, "latent_cache_type", None)
    sliding = any(t != "full_attention" for t in getattr(config, "layer_types", None) or [])
    return None if kind == "f32" or sliding else kind


def hold_latent_typed(cache: Cache | None, config) -> None:
    """A new (empty) dynamic cache of a model whose latent is served in a cache type holds its layers' rows in that
    type for real (`TypedLatentLayer`, see `held_type`); a static cache keeps the model's dtype and reads the rows as
    the type gives them back (the same values, the float bytes). An empty cache typed for another type (the config
    changed since) is retyped."""
    kind = held_type(config)
    if not isinstance(cache, DynamicCache) or cache.get_seq_length() != 0:
        return
    if kind is not None and not cache.layers and cache.layer_class_to_replicate is DynamicLayer:
        cache.layers.extend(DynamicLayer() for _ in range(config.num_hidden_layers))
    for i, layer in enumerate(cache.layers):
        if layer.is_initialized or type(layer) not in (DynamicLayer, TypedLatentLayer):
            continue
        if getattr(layer, "kind", None) != kind:
            ranks = config.kv_lora_ranks[i], config.qk_rope_head_dim
            cache.layers[i] = TypedLatentLayer(kind, *ranks) if kind is not None else DynamicLayer()
