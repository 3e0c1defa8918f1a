"""The texts of other domains (benchmarks/common/domain_texts.py): the table of contents is dropped, epigrams are mixed."""

import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def domain_texts():
    return load_script("domain_texts")


def test_body_starts_at_the_last_title(domain_texts):
    text = "Title\n* 1. Scope\n* 2. Next\n\n1. Scope\n*****\nThe body.\n"
    assert domain_texts.body(text, "1. Scope") == "1. Scope\n*****\nThe body.\n"
    with pytest.raises(SystemExit, match="update TEXTS"):
        domain_texts.body(text, "3. Missing")


def test_epigrams_take_one_entry_of_each_file_in_turn(domain_texts):
    a = "a1 line one\n\tline two\n%\na2\n%\na3\n%\n"
    b = "b1\n%\n"
    assert domain_texts.epigrams([a, b]) == "a1 line one\n\tline two\n\nb1\n\na2\n\na3\n"


def test_development_and_evaluation_texts_are_other_documents(domain_texts):
    packages = {p for p, *_ in domain_texts.TEXTS.values()}
    assert not packages & ({p for p, *_ in domain_texts.DEV_TEXTS.values()} | {domain_texts.FORTUNES[0]})
