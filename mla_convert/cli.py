"""The `mla-convert` command line. Option parsing and friendly errors only; the work lives in the library rooms.

torch and transformers are imported inside the commands so that `--help` is fast.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from mla_convert.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Convert GQA/MHA Llama, Mistral and Qwen2 models to Multi-head Latent Attention (MLA), evaluate, "
    "fine-tune, export and publish them.",
)


def _setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet else (logging.INFO if verbose <= 1 else logging.DEBUG)
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr, force=True)
    if verbose < 2:
        for noisy in ("transformers", "huggingface_hub", "datasets", "accelerate", "urllib3", "filelock"):
            logging.getLogger(noisy).setLevel(logging.ERROR)


def friendly(fn):
    """Turn a UserError (and a missing-file or interrupt) into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130)

    return wrapper


VerboseOpt = typer.Option(0, "--verbose", "-v", count=True, help="More log output (-v progress, -vv debug).")
QuietOpt = typer.Option(False, "--quiet", "-q", help="Only warnings and errors.")


def main() -> None:  # console-script entry point alternative
    app()


if __name__ == "__main__":
    main()
