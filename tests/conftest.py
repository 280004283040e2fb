"""No test writes into the user's compile cache: each test's default compile cache is a folder of its own."""
import pytest


@pytest.fixture(autouse=True)
def own_compile_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache-home")))
