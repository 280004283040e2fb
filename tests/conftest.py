"""The fixtures every test file may use: the suite runs in the repository's folder, the shipped files stay
as they were, the shipped model, and one finished small training run to copy. Nothing of engines/, and nothing compiles."""
import os

import pytest

import cached
from helpers import ROOT, SHIPPED, TINY, in_process, sha256


@pytest.fixture(scope="module")
def shipped():
    """holmes.pt as cached.load gives it (a CachedGPT in eval mode), loaded once a test file: the tests read it."""
    return cached.load(os.path.join(ROOT, "holmes.pt"))


@pytest.fixture
def shipped_unchanged():
    """Fails the test if it changed any shipped file (holmes.pt, series/holmes.csv, tokenizer.json) by a byte."""
    before = {name: sha256(os.path.join(ROOT, name)) for name in SHIPPED}
    yield
    assert {name: sha256(os.path.join(ROOT, name)) for name in SHIPPED} == before


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 1-step run to copy: corpus.txt, data/ (its ids), run.pt, run.csv."""
    return in_process(tmp_path_factory.mktemp("finished"), "--out", "run", *TINY)


@pytest.fixture(autouse=True, scope="session")
def in_the_repo():
    """The suite runs in the repository's folder, where the README runs the scripts (holmes.pt,
    tokenizer.json), whatever folder pytest was started from."""
    started_in = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(started_in)
