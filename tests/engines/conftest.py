"""The engines' fixtures: a compile cache of the suite's own, the plain compile way only, and the steps
compiled once, ahead, in a process of their own, for the tests that run compiled steps (run last).

engines/ needs engines/requirements.txt: without it this folder's tests skip as one, naming the file, so a
reader who installed only requirements.txt runs the lesson's tests alone; in CI (CI=true) they fail instead."""
import contextlib
import importlib.util
import multiprocessing
import os
from types import SimpleNamespace

import pytest
import torch

EXTRAS = ("transformers", "gguf", "ctranslate2", "llama_cpp", "starlette", "uvicorn", "openai")  # engines/requirements.txt
missing = [name for name in EXTRAS if importlib.util.find_spec(name) is None]
if missing:
    reason = f"{', '.join(missing)} not installed: pip install -r engines/requirements.txt"
    if os.environ.get("CI") == "true":
        raise ImportError(f"CI=true and the engines' tests cannot run: {reason}")
    pytest.skip(f"the engines' tests: {reason}", allow_module_level=True)

from engines.fast import compile_ways  # noqa: E402 (after the skip)
from engines.edge.checkpoint import load_pair  # noqa: E402
from helpers import ROOT  # noqa: E402
from support import compile_ahead, compiled_engines, compiled_model, plain_ways  # noqa: E402


@pytest.fixture
def inductor_cxx():
    """Names the C++ compiler inductor builds with, for one test, through torch's own config patching:
    pytest's monkeypatch of torch's config leaves it broken for every later test on torch 2.14."""
    with contextlib.ExitStack() as stack:
        yield lambda name: stack.enter_context(torch._inductor.config.patch({"cpp.cxx": (None, name)}))


@pytest.fixture(autouse=True, scope="session")
def own_compile_cache(tmp_path_factory):
    """No test writes into the user's compile cache: the suite's default compile cache is a folder of its
    own. One for the whole suite, so a step compiled for one test's weights and batch is loaded by the
    next that asks for the same (a package is keyed by all that makes it valid)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache-home")))
        yield


@pytest.fixture(autouse=True, scope="session")
def one_plain_compile_way():
    """The Engine compiles its decode step each of compile_ways.COMPILE_WAYS and keeps the fastest; with the
    autotuner that costs minutes a batch on a small CPU. The suite compiles the plain way only, and
    the others once, in compile_ahead, for test_compile_cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compile_ways, "COMPILE_WAYS", plain_ways(compile_ways.COMPILE_WAYS))
        yield


@pytest.fixture(scope="module")
def pair():
    """holmes.pt and tokenizer.json as the engines load them (load_pair), once a test file."""
    return load_pair(os.path.join(ROOT, "holmes.pt"), os.path.join(ROOT, "tokenizer.json"))


def uses(item, fixture):
    return fixture in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    """The tests that run compiled steps run last, so the steps compile beside the tests before them;
    those that need every way's step after the others, which run while the last of them compile."""
    items.sort(key=lambda item: (uses(item, "compiled"), uses(item, "every_way_compiled")))  # a stable sort


@pytest.fixture(autouse=True, scope="session")
def compiling(request, tmp_path_factory):
    """compile_ahead, in two processes of their own started with the session, when any test will run a compiled
    step (compiling is mostly one core's work, and many tests leave a core idle): (home, folder, processes,
    plain_kept)."""
    home = tmp_path_factory.mktemp("compiled")
    spawn = multiprocessing.get_context("spawn")
    folder, processes, plain_kept = home / "tiny-gpt", [], spawn.Event()
    if any(uses(item, "compiled") for item in request.session.items):
        processes = [spawn.Process(target=compile_ahead, args=args) for args in ((str(folder), plain_kept), (str(folder),))]
        for process in processes:
            process.start()
    yield home, folder, processes, plain_kept
    for process in processes:
        if process.is_alive():  # only a run stopped early (-x) gets here before it ends
            process.terminate()
            process.join()


@pytest.fixture(scope="session")
def compiled(compiling, one_plain_compile_way):
    """compiled_model()'s steps of COMPILED_KNOBS for COMPILED_ROWS rows, in float32 and int8 Engines loaded from
    the compile cache `folder` (the default one when XDG_CACHE_HOME is `home`), where compile_ahead keeps
    every step the tests run compiled; a step it did not keep (it failed) is compiled here."""
    home, folder, processes, plain_kept = compiling
    # no processes where no collected test asked for this fixture by name (getfixturevalue)
    while processes and processes[0].is_alive() and not plain_kept.wait(1):
        pass
    model = compiled_model()
    engines = compiled_engines(model, folder)
    return SimpleNamespace(model=model, home=home, folder=folder, f32=engines[torch.float32], int8=engines[torch.int8])


@pytest.fixture(scope="session")
def every_way_compiled(compiled, compiling):
    """`compiled`, once compile_ahead has kept every step it compiles (the autotuned ways, dot products)."""
    for process in compiling[2]:
        process.join()
    return compiled
