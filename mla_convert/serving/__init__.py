"""Serving native MLA checkpoints in engines, through the engines' own MLA attention.

`vllm_plugin.register` is the `vllm.general_plugins` entry point (installed with `pip install 'mla-convert[vllm]'`
into vLLM's environment): it teaches vLLM the `mla` model type, so `vllm serve OUT` runs a native checkpoint with its
per-layer RoPE pairs, biases and latent ranks exactly, with vLLM's paged latent cache and MLA kernels.

`layout` holds what is engine-independent and testable without an engine: which cache layout an engine's MLA
kernels take, and how native tensors are padded into it.
"""
