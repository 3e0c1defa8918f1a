"""Rendering a tokenizer's chat template with bounds: a template comes from a checkpoint, so it is rendered in
transformers' Jinja sandbox, within a time limit and an output size limit, and any failure (a sandbox refusal, a
syntax error, a loop that does not end) is one `UserError` line naming the fix."""

from __future__ import annotations

import contextlib
import signal
import threading

from mla_convert.errors import UserError

SECONDS = 10.0  # a real chat template renders in milliseconds
MAX_TOKENS = 1_000_000  # tokens a rendered prompt may hold


class _TooSlow(BaseException):  # not an Exception: the template's own error handling cannot swallow it
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise _TooSlow in this thread after `seconds` (only on the main thread, where signals arrive; elsewhere
    unbounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _TooSlow()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def apply_chat_template(tokenizer, messages: list[dict], where: str, **kwargs):
    """`tokenizer.apply_chat_template(messages, **kwargs)`, bounded in time and size; `where` names the model in an
    error line."""
    from jinja2.exceptions import SecurityError, TemplateError

    try:
        with _time_limit(SECONDS):
            out = tokenizer.apply_chat_template(messages, **kwargs)
    except _TooSlow:
        raise UserError(f"the chat template of {where} did not finish rendering in {SECONDS:g} s (a loop that does "
                        "not end?): fix chat_template in its tokenizer files, or drop --chat") from None
    except SecurityError as e:
        raise UserError(f"the chat template of {where} tried something the sandbox forbids ({str(e)[:120]}): it is "
                        "not rendered; fix or remove chat_template in its tokenizer files") from None
    except (TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
        raise UserError(f"the chat template of {where} cannot be rendered ({type(e).__name__}: {str(e)[:120]}): fix "
                        "chat_template in its tokenizer files") from None
    except MemoryError:
        raise UserError(f"the chat template of {where} renders to more text than fits in memory: fix chat_template "
                        "in its tokenizer files") from None
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    length = ids.shape[-1] if hasattr(ids, "shape") else len(ids)
    if length > MAX_TOKENS:
        raise UserError(f"the chat template of {where} renders a prompt of {length} tokens (at most {MAX_TOKENS}): "
                        "fix chat_template in its tokenizer files")
    return out
