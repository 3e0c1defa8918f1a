"""The texts of other domains (benchmarks/common/domain_texts.py), run as its command on stand-in Debian packages
built here with dpkg-deb: the table of contents is dropped, epigrams are mixed, and the development texts come from
other packages than the evaluation texts."""

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
FORTUNE_FILES = ("art", "education", "food", "goedel", "humorists", "law", "love", "medicine", "paradoxum", "people",
                 "pets", "platitudes", "politics", "science", "songs-poems", "sports", "wisdom", "work")  # fmt: skip


def manual(first: str, second: str) -> bytes:
    """A manual's plain text: the table of contents names both chapters before the body does."""
    return gzip.compress(f"Title\n* {first}\n* {second}\n\n{first}\n*****\nThe body.\n\n{second}\nMore.\n".encode())


def deb(debs: Path, package: str, files: dict[str, bytes]) -> None:
    tree = debs / f"tree-{package}"
    shutil.rmtree(tree, ignore_errors=True)
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(f"Package: {package}\nVersion: 1.0\nArchitecture: all\n"
                                             "Maintainer: test <t@example.org>\nDescription: stand-in\n")  # fmt: skip
    for member, data in files.items():
        (tree / member).parent.mkdir(parents=True, exist_ok=True)
        (tree / member).write_bytes(data)
    subprocess.run(["dpkg-deb", "-b", str(tree), str(debs / f"{package}_1.0_all.deb")], check=True,
                   capture_output=True)  # fmt: skip


@pytest.fixture
def debs(tmp_path):
    folder = tmp_path / "debs"
    folder.mkdir()
    deb(folder, "debian-reference-en", {"usr/share/debian-reference/debian-reference.en.txt.gz":
                                        manual("Chapter 1. GNU/Linux tutorials", "Chapter 2. Packages")})
    deb(folder, "gnu-standards", {"usr/share/doc/gnu-standards/standards.text.gz":
                                  manual("1 About the GNU Coding Standards", "2 Keeping Free Software Free")})
    deb(folder, "developers-reference", {"usr/share/developers-reference/developers-reference.txt.gz":
                                         manual("1.\u00a0Scope of This Document", "2. Applying")})
    fortunes = {f"usr/share/games/fortunes/{name}": b"" for name in FORTUNE_FILES}
    fortunes["usr/share/games/fortunes/art"] = b"a1 line one\n\tline two\n%\na2\n%\na3\n%\n"
    fortunes["usr/share/games/fortunes/food"] = b"b1\n%\n"
    deb(folder, "fortunes", fortunes)
    return folder


def run(debs: Path, tmp_path: Path):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "common" / "domain_texts.py"), "--debs",
                           str(debs), "--out", str(tmp_path / "eval"), "--dev-out", str(tmp_path / "dev")],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip


def test_body_starts_at_the_last_title(debs, tmp_path):
    proc = run(debs, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (tmp_path / "eval" / "gnu-standards.txt").read_text()
    assert text == "1 About the GNU Coding Standards\n*****\nThe body.\n\n2 Keeping Free Software Free\nMore.\n"
    assert (tmp_path / "dev" / "devref.txt").read_text().startswith("1.\u00a0Scope of This Document\n*****")


def test_a_missing_title_stops_with_the_fix(debs, tmp_path):
    (debs / "gnu-standards_1.0_all.deb").unlink()
    deb(debs, "gnu-standards", {"usr/share/doc/gnu-standards/standards.text.gz": manual("Foreword", "Intro")})
    proc = run(debs, tmp_path)
    assert proc.returncode == 1 and "update TEXTS" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_epigrams_take_one_entry_of_each_file_in_turn(debs, tmp_path):
    assert run(debs, tmp_path).returncode == 0
    assert (tmp_path / "dev" / "fortunes.txt").read_text() == "a1 line one\n\tline two\n\nb1\n\na2\n\na3\n"


def test_development_and_evaluation_texts_are_other_documents(debs, tmp_path):
    proc = run(debs, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    made = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    packages = {Path(path).parent.name: set() for path in made}
    for path, what in made.items():
        packages[Path(path).parent.name].add(what.rsplit(" ", 1)[-1])
    assert packages["eval"] == {"debian-reference-en", "gnu-standards"}
    assert packages["dev"] == {"developers-reference", "fortunes"}
