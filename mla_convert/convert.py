"""The library's conversion API, in two steps: `prepare(source, ConvertOptions(...))` decides everything (the family,
the options as they will run, the plan: shapes, cache sizes, memory, time) without doing it, and `run(prepared, out)`
writes the native MLA checkpoint; `convert(source, out, options)` does both. `make_plan` computes the plan alone. The
phases live in `mla_convert.conversion`."""

from mla_convert.conversion.options import ConvertOptions
from mla_convert.conversion.pipeline import Prepared, convert, make_plan, prepare, resolve_device, run
from mla_convert.conversion.plan import Plan, max_rank
from mla_convert.conversion.target import deepseek_convert_options

__all__ = ["ConvertOptions", "Plan", "Prepared", "convert", "deepseek_convert_options", "make_plan", "max_rank",
           "prepare", "resolve_device", "run"]
