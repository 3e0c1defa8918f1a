"""The library's conversion API: `convert(source, out, ConvertOptions(...))` writes a native MLA checkpoint;
`make_plan` computes what a conversion would make (shapes, cache sizes, memory) without doing it. The phases live in
`mla_convert.conversion`."""

from mla_convert.conversion.options import ConvertOptions
from mla_convert.conversion.pipeline import convert, make_plan, resolve_device
from mla_convert.conversion.plan import Plan, max_rank

__all__ = ["ConvertOptions", "Plan", "convert", "make_plan", "max_rank", "resolve_device"]
