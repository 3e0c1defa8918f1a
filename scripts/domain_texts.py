#!/usr/bin/env python
"""Evaluation texts of other domains than WikiText, from Debian packages: plain text, never calibrated on.

    python scripts/domain_texts.py [--out out/domains] [--debs DIR]

  debian-reference  the Debian Reference manual (package debian-reference-en): system administration prose with
                    shell commands, file paths and tables.
  gnu-standards     the GNU Coding Standards (package gnu-standards): software-engineering prose with C snippets.

Each package ships a plain-text rendering of its manual (gzip); the script takes it from the .deb (found in --debs,
else fetched with `apt-get download` into that folder), drops the table of contents before the first chapter's
body, and writes OUT/NAME.txt (UTF-8). The texts are evaluation text only (scripts/bench_quality.py): nothing here is
a calibration or development split, so no choice is ever made on them.
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (package, plain-text member inside the .deb, line that starts the body: its last occurrence, after the TOC)
TEXTS = {
    "debian-reference": ("debian-reference-en", "usr/share/debian-reference/debian-reference.en.txt.gz",
                         "Chapter 1. GNU/Linux tutorials"),
    "gnu-standards": ("gnu-standards", "usr/share/doc/gnu-standards/standards.text.gz",
                      "1 About the GNU Coding Standards"),
}  # fmt: skip


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


def extract(name: str, debs: Path, out: Path) -> Path:
    package, member, start = TEXTS[name]
    deb = find_deb(package, debs)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True)
        text = gzip.decompress((Path(tmp) / member).read_bytes()).decode("utf-8")
    path = out / f"{name}.txt"
    path.write_text(body(text, start), encoding="utf-8")
    print(f"{path}: {path.stat().st_size} bytes from {deb.name}")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "domains")
    ap.add_argument("--debs", type=Path, default=Path("/tmp"), help="folder with (or to download) the .deb files")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in TEXTS:
        extract(name, args.debs, args.out)


if __name__ == "__main__":
    main()
