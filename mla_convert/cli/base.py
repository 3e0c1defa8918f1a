"""What every `mla-convert` command shares: the typer app, one-line usage errors, logging, and `friendly` (a
UserError, an environment error or running out of memory as one `error:` line and exit status 2)."""

from __future__ import annotations

import functools
import logging
import sys

import typer



class _OneLineErrors(typer.core.TyperGroup):
    """Usage errors (a missing argument, a value of the wrong type, an unknown command or option) as one
    `error:` line naming the command's --help, exit status 2, like every other user error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:  # typer 0.2x parses with its own copy of click: catch that copy's exceptions
            from typer._click import exceptions as click
        except ImportError:
            from click import exceptions as click

        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.NoArgsIsHelpError as e:  # bare `mla-convert`: the help, as before
            e.show()
            sys.exit(e.exit_code)
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "mla-convert"
            typer.echo(f"error: {e.format_message()} (see `{where} --help`)", err=True)
            sys.exit(2)
        except click.ClickException as e:
            typer.echo(f"error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Convert GQA/MHA Llama, Mistral and Qwen2 models to Multi-head Latent Attention (MLA), evaluate, "
    "fine-tune, export and publish them.",
)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time (a test runner swaps it), not the stream seen at set-up."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet else (logging.INFO if verbose <= 1 else logging.DEBUG)
    logging.basicConfig(level=level, format="%(message)s", handlers=[_StderrHandler()], force=True)
    if verbose < 2:
        noisy_loggers = ("transformers", "huggingface_hub", "datasets", "accelerate", "urllib3", "filelock", "httpx",
                         "httpx2")  # httpx(2): huggingface_hub's HTTP client logs every request at INFO
        for noisy in noisy_loggers:
            logging.getLogger(noisy).setLevel(logging.ERROR)


def friendly(fn):
    """Turn a UserError, an operating-system error (full disk, read-only place) or running out of memory into one
    `error:` line and exit status 2; an interrupt into `interrupted` and 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130)
        except typer.Exit:
            raise
        except Exception as e:  # a full disk, a read-only or busy place, torch's allocators: one line, else a bug
            from mla_convert.errors import one_line

            line = one_line(e)
            if line is None:
                raise  # a bug: it keeps its traceback
            typer.echo(f"error: {line}", err=True)
            raise typer.Exit(2)

    return wrapper


VerboseOpt = typer.Option(0, "--verbose", "-v", count=True, help="More log output (-v progress, -vv debug).")
QuietOpt = typer.Option(False, "--quiet", "-q", help="Only warnings and errors.")
