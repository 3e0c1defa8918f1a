"""The repository itself: no machine paths in what it ships (code, docs, recipes, benchmark records)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".py", ".md", ".json", ".jsonl", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg"}
# Absolute paths of one machine: a home or work folder, the temporary folder. Built from parts so that this file does
# not match itself.
MACHINE_PATH = re.compile("|".join(re.escape(p) for p in ("/" + "work/", "/" + "tmp/", "/" + "root/", "/" + "home/")))
ALLOWED = {"tests/test_hub.py": 1}  # a made-up Hub cache path under a home folder, the input of a test


def shipped_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot list the shipped files")
    return [name for name in out.splitlines() if Path(name).suffix in TEXT_SUFFIXES and (ROOT / name).is_file()]


def test_no_machine_paths():
    found = {}
    for name in shipped_files():
        hits = MACHINE_PATH.findall((ROOT / name).read_text(encoding="utf-8", errors="replace"))
        if len(hits) > ALLOWED.get(name, 0):
            found[name] = len(hits)
    assert not found, f"machine paths in {found}: use paths relative to the repository or the data folder"
