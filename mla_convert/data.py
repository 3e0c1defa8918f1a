"""Text for training, calibration and evaluation: loading, tokenizing, packing, and keeping train and eval apart.

A text spec is either a local file (`.txt`, `.raw`, `.tokens`, ...: read whole; `.jsonl`: the "text" field of each
line) or a `datasets` name as `name[:config[:split]]` (e.g. `wikitext:wikitext-2-raw-v1:validation`; the split
defaults to "validation", documents are joined with blank lines).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

import torch

from mla_convert.errors import UserError

log = logging.getLogger(__name__)

# Lines shorter than this are not used to detect overlap: headings ("= = History = =") and blank lines repeat across
# any two texts. 64 characters errs towards missing short overlaps rather than flagging unrelated texts.
MIN_OVERLAP_LINE_CHARS = 64

# Lines per tokenizer call when fine-tuning data is tokenized (see `tokenize`).
TRAIN_CHUNK_LINES = 2000


def written_as_path(spec: str) -> bool:
    """Whether a text spec is written as a file path (a suffix, or a start of `.`, `/` or `~`) rather than as a
    `datasets` name such as `wikitext` or `org/name`."""
    return bool(Path(spec).suffix) or spec.startswith((".", "/", "~"))


def check_text_spec(spec: str) -> None:
    """Fail fast, reading nothing, on a text spec that names a local folder or a local file that does not exist."""
    path = Path(spec).expanduser()
    if path.is_dir():
        raise UserError(f"text {spec} is a folder: pass a text file (.txt/.raw/.tokens/.jsonl) or a datasets name")
    if is_pipe(path):  # process substitution, <(cat file): read once, kept for the run
        return
    if path.exists() and not path.is_file():
        raise UserError(f"text {spec} is not a regular file (a device?): pass a text file or <(command)")
    if not path.is_file() and written_as_path(spec):
        raise UserError(f"text file {spec} does not exist: check the path (relative paths start at the current folder)")


def is_pipe(path: Path) -> bool:
    import stat

    try:
        return stat.S_ISFIFO(path.stat().st_mode)
    except OSError:
        return False


_PIPED: dict[str, bytes] = {}  # the text read from each pipe (it can be read only once), by its path

# A pipe is read with bounds, since nothing says how much it holds or when it ends: at most PIPE_MAX_BYTES (a text
# larger than that belongs in a file, whose size is known), and a pipe silent for PIPE_IDLE_SECONDS (no program writes
# to it, or the one that does stalled) is refused instead of waited on forever.
PIPE_MAX_BYTES = 1 << 30
PIPE_IDLE_SECONDS = 120.0


def _read_pipe(path: Path) -> bytes:
    import os
    import select

    def refuse(why: str) -> UserError:
        return UserError(f"{path} is a pipe that {why}: write the text to a file and pass that")

    # non-blocking open: a FIFO nobody writes to would otherwise block the open itself
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        parts, size, opened = [], 0, False
        while True:
            events = poller.poll(PIPE_IDLE_SECONDS * 1000)
            if not events:
                raise refuse(f"gave nothing for {PIPE_IDLE_SECONDS:g} s (no program writes to it?)")
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                continue
            if chunk:
                opened = True
                size += len(chunk)
                if size > PIPE_MAX_BYTES:
                    raise refuse(f"gives more than {PIPE_MAX_BYTES / 2**20:g} MiB")
                parts.append(chunk)
            elif opened or events[0][1] & select.POLLHUP:  # end of file: the writer closed it
                return b"".join(parts)
            else:  # no writer yet: an empty read before any writer opened it is not the end
                import time

                time.sleep(0.05)
    finally:
        os.close(fd)


def _binary(head: bytes) -> bool:
    """Whether the first bytes of a text look like binary data (weights, an archive) rather than UTF-8 text."""
    return b"\0" in head or head.decode("utf-8", errors="replace").count("\ufffd") > 0.01 * len(head)


def _read_bytes(path: Path) -> bytes:
    if not is_pipe(path):
        with open(path, "rb") as f:
            head = f.read(65536)
            if _binary(head):  # refused before the rest is read: a 16 GB weights file passed as text costs nothing
                raise UserError(f"{path} is not UTF-8 text (binary data?): pass a plain text or .jsonl file")
            return head + f.read()
    key = str(path)
    if key not in _PIPED:
        _PIPED[key] = _read_pipe(path)
    return _PIPED[key]


def looks_like_test_split(spec: str) -> bool:
    """Whether a text spec names a test split: a file name with the word "test" (wiki.test.raw) or a datasets
    name[:config[:split]] whose split is test."""
    name = Path(spec).name.lower()
    return bool(re.search(r"(^|[^a-z])test([^a-z]|$)", name)) or spec.lower().endswith(":test")


def load_text(spec: str) -> str:
    """The text named by `spec` (a local file or `datasets` name[:config[:split]]), as one string."""
    check_text_spec(spec)
    path = Path(spec).expanduser()
    if path.is_file() or is_pipe(path):
        try:
            raw = _read_bytes(path)
        except OSError as e:
            raise UserError(f"cannot read {path} ({e.strerror or type(e).__name__}): check the file and its "
                            "permissions, or pass another text") from None
        if path.suffix == ".jsonl":
            try:
                lines = raw.decode("utf-8").splitlines()
            except UnicodeDecodeError:
                raise UserError(f"{path} is not UTF-8 text: a .jsonl file holds one UTF-8 JSON object a line") from None
            docs = []
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)["text"]
                    if not isinstance(doc, str):
                        raise TypeError
                    docs.append(doc)
                except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
                    raise UserError(f"{path}:{n} is not a JSON object with a \"text\" field: fix that line") from None
            return "\n\n".join(docs)
        # a binary file (weights, an archive) read as text would calibrate on noise: refuse it (a file's head was
        # checked before the rest was read; a pipe's is checked here)
        if _binary(raw[:65536]):
            raise UserError(f"{path} is not UTF-8 text (binary data?): pass a plain text or .jsonl file")
        text = raw.decode("utf-8", errors="replace")
        if raw and not text.strip():
            raise UserError(f"{path} holds only whitespace ({len(raw)} bytes): pass a text with words in it")
        return text
    parts = spec.split(":")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "validation"
    try:
        import datasets

        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline, unknown name, gated: all a user fix
        raise UserError(f"cannot load dataset {spec} ({type(e).__name__}): pass a local text or jsonl file instead") from None
    if "text" not in ds.column_names:
        raise UserError(f"dataset {spec} has no 'text' column (columns: {ds.column_names}): pass a local text file")
    return "\n\n".join(ds["text"])


# Characters per tokenizer call at most: a tokenizer's working memory grows with the text of one call, so every text
# is tokenized in pieces of at most this many characters (the measurements: docs/decisions.md#bounds-on-what-is-read).
TOKENIZE_CHUNK_CHARS = 1 << 20

# where a piece may end (see `_pieces`): after a newline that a line's first character follows; else before the
# whitespace in front of a word. Greedy, so the match ends at the last such place in the piece.
_AFTER_NEWLINE = re.compile(r"(?s).*\n(?=[^\r\n])")
_BEFORE_SPACE = re.compile(r"(?s).*\S(?=\s)")


def _pieces(text: str, max_chars: int, max_lines: int | None):
    """`text` cut into consecutive pieces of at most `max_chars` characters (and `max_lines` lines, given), each
    ending after a newline where one falls in the piece, else before a space, else (a text without whitespace)
    anywhere. A cut there leaves the tokens of byte-level BPE tokenizers as one call gives them."""
    start, n = 0, len(text)
    while start < n:
        end = min(start + max_chars, n)
        if max_lines is not None:  # the end of the piece's first max_lines lines, where it comes first
            pos = start
            for _ in range(max_lines):
                pos = text.find("\n", pos, end)
                if pos < 0:
                    break
                pos += 1
            else:
                end = pos
        if end < n and (max_lines is None or end == start + max_chars):
            found = _AFTER_NEWLINE.match(text, start, end) or _BEFORE_SPACE.match(text, start, end)
            if found is not None and found.end() > start:
                end = found.end()
        yield text[start:end]
        start = end


def tokenize(tokenizer, text: str, chunk_lines: int | None = None) -> torch.Tensor:
    """Token ids of `text` [N] (no special tokens): the one tokenizing step of calibration, training and evaluation.

    The text is tokenized in pieces of at most TOKENIZE_CHUNK_CHARS characters (whole lines where the text has lines,
    see `_pieces`), so no text, not even one long line, becomes one giant tokenizer call; a text shorter than that is
    one call. A number `chunk_lines` also ends a piece after that many lines (fine-tuning uses TRAIN_CHUNK_LINES)."""
    parts = [torch.tensor(tokenizer(piece, add_special_tokens=False)["input_ids"], dtype=torch.int32)
             for piece in _pieces(text, TOKENIZE_CHUNK_CHARS, chunk_lines)]
    return torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long)


def pack(token_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a token stream [N] into consecutive sequences [N // seq_len, seq_len]; the remainder is dropped."""
    n = token_ids.numel() // seq_len
    if n == 0:
        raise UserError(f"the text has {token_ids.numel()} tokens, fewer than one sequence of {seq_len}: "
                        "use more text or a smaller seq_len")
    return token_ids[: n * seq_len].view(n, seq_len)


def _line_hashes(text: str) -> set[bytes]:
    out = set()
    for line in text.splitlines():
        line = " ".join(line.split())
        if len(line) >= MIN_OVERLAP_LINE_CHARS:
            out.add(hashlib.blake2b(line.encode(), digest_size=16).digest())
    return out


def overlapping_lines(train_text: str, eval_text: str) -> int:
    """How many distinct long lines (>= MIN_OVERLAP_LINE_CHARS, whitespace-normalised) the two texts share."""
    return len(_line_hashes(train_text) & _line_hashes(eval_text))


def check_disjoint(train_text: str, eval_text: str, train_spec: str = "train", eval_spec: str = "eval") -> None:
    """Raise a UserError when the training text shares any long line with the evaluation text."""
    shared = overlapping_lines(train_text, eval_text)
    if shared:
        raise UserError(f"{train_spec} shares {shared} lines with the evaluation text {eval_spec}: "
                        "train and calibrate on text that is not evaluated")
