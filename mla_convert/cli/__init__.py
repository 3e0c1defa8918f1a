"""The `mla-convert` command line (console entry point `mla_convert.cli:app`). Option parsing and friendly errors
only; the work lives in the library rooms.

- base: the typer app, one-line usage errors, logging, `friendly`
- convert: `convert` and the per-family commands, their options made from mla_convert/schema.py
- run: `eval` and `generate`
- publish: `export`, `finetune` and `push`

torch and transformers are imported inside the commands so that `--help` is fast.
"""

from mla_convert.cli import convert, run, publish  # noqa: F401, I001  (each registers its commands on `app`, in the order --help lists them)
from mla_convert.cli.base import app, friendly

__all__ = ["app", "friendly", "main"]


def main() -> None:  # console-script entry point alternative
    app()
