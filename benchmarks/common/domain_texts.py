#!/usr/bin/env python
"""Texts of other domains than WikiText, from Debian packages: plain text, never calibrated on.

    python benchmarks/common/domain_texts.py [--out out/domains] [--dev-out out/dev] [--debs DIR]

Evaluation texts (--out; benchmarks/quality/run.py measures on them, no choice is ever made on them):
  debian-reference  the Debian Reference manual (package debian-reference-en): system administration prose with
                    shell commands, file paths and tables.
  gnu-standards     the GNU Coding Standards (package gnu-standards): software-engineering prose with C snippets.
Development texts (--dev-out; choices are made on them, with the second half of wiki.valid.tokens; other documents
than the evaluation texts, so a choice made here is measured there on text it never saw):
  devref            the Debian Developer's Reference (package developers-reference): packaging procedures, policy
                    prose, commands and field names.
  fortunes          English epigrams, quotations and verse (package fortunes), taken in turn from the files of
                    FORTUNE_FILES so that the first windows already mix them.

A manual's package ships a plain-text rendering of it (gzip); the script takes it from the .deb (found in --debs,
else fetched with `apt-get download` into that folder), drops the table of contents before the first chapter's
body, and writes OUT/NAME.txt (UTF-8).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import re
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# name -> (package, plain-text member inside the .deb, line that starts the body: its last occurrence, after the TOC)
TEXTS = {
    "debian-reference": ("debian-reference-en", "usr/share/debian-reference/debian-reference.en.txt.gz",
                         "Chapter 1. GNU/Linux tutorials"),
    "gnu-standards": ("gnu-standards", "usr/share/doc/gnu-standards/standards.text.gz",
                      "1 About the GNU Coding Standards"),
}  # fmt: skip
DEV_TEXTS = {
    "devref": ("developers-reference", "usr/share/developers-reference/developers-reference.txt.gz",
               "1. Scope of This Document"),
}  # fmt: skip
FORTUNES = ("fortunes", "usr/share/games/fortunes")
# Quotations and verse; the files of jokes about groups of people, the ASCII art and the non-English one are left out.
FORTUNE_FILES = ("art", "education", "food", "goedel", "humorists", "law", "love", "medicine", "paradoxum", "people",
                 "pets", "platitudes", "politics", "science", "songs-poems", "sports", "wisdom", "work")  # fmt: skip


def find_deb(package: str, debs: Path) -> Path:
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        subprocess.run(["apt-get", "download", package], cwd=debs, check=True)
        found = sorted(debs.glob(f"{package}_*.deb"))
    return found[-1]


def body(text: str, start: str) -> str:
    """The text from the last line equal to `start` (a table of contents repeats chapter titles before the body)."""
    lines = text.splitlines()
    hits = [i for i, line in enumerate(lines) if " ".join(line.split()) == start]  # no-break spaces too
    if not hits:
        raise SystemExit(f"no line {start!r} in the text: the package's layout changed, update TEXTS")
    return "\n".join(lines[hits[-1] :]).strip() + "\n"


def unpacked(package: str, debs: Path, tmp: str) -> Path:
    """The folder `package`'s .deb is unpacked into (under `tmp`)."""
    subprocess.run(["dpkg-deb", "-x", str(find_deb(package, debs)), tmp], check=True)
    return Path(tmp)


def write(path: Path, text: str, package: str) -> Path:
    path.write_text(text, encoding="utf-8")
    print(f"{path}: {path.stat().st_size} bytes from package {package}")
    return path


def extract(name: str, debs: Path, out: Path, texts: dict = TEXTS) -> Path:
    package, member, start = texts[name]
    with tempfile.TemporaryDirectory() as tmp:
        text = gzip.decompress((unpacked(package, debs, tmp) / member).read_bytes()).decode("utf-8")
    return write(out / f"{name}.txt", body(text, start), package)


def epigrams(files: list[str]) -> str:
    """The entries of fortune files (each ends at a line '%'), one from each file in turn, blank-line separated."""
    entries = [[e.strip("\n") for e in re.split(r"^%$", text, flags=re.M) if e.strip()] for text in files]
    return "\n\n".join(e for group in itertools.zip_longest(*entries) for e in group if e is not None) + "\n"


def fortunes(debs: Path, out: Path) -> Path:
    package, folder = FORTUNES
    with tempfile.TemporaryDirectory() as tmp:
        root = unpacked(package, debs, tmp) / folder
        files = [root.joinpath(n).read_text(encoding="utf-8", errors="replace") for n in FORTUNE_FILES]
    return write(out / "fortunes.txt", epigrams(files), package)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "domains")
    ap.add_argument("--dev-out", type=Path, default=ROOT / "out" / "dev")
    ap.add_argument("--debs", type=Path, default=Path("/tmp"), help="folder with (or to download) the .deb files")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in TEXTS:
        extract(name, args.debs, args.out)
    args.dev_out.mkdir(parents=True, exist_ok=True)
    for name in DEV_TEXTS:
        extract(name, args.debs, args.dev_out, DEV_TEXTS)
    fortunes(args.debs, args.dev_out)


if __name__ == "__main__":
    main()
