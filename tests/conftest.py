"""What several test files share: the shipped files' guard, running a script's main in-process as a
real run shows it, train.py's small runs, Part 3's checkpoint format written without model.py, texts
that a tokenizer or an exported model must round-trip; one small model's decode step compiled once for
the tests that compile; and where every test runs: in the repository's folder, with a compile cache of
the suite's own."""
import contextlib
import functools
import hashlib
import io
import multiprocessing
import os
import shutil
import signal
import sys
from types import SimpleNamespace

import pytest
import torch

from engines import compile_ways, decode_step, fast_engine, serving
import train as train_module
from cli import run_cli
from model import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = ("holmes.pt", "holmes.csv", "tokenizer.json")

TEXT = (
    "It is a capital mistake to theorize before one has data. Insensibly one begins "
    "to twist facts to suit theories, instead of theories to suit facts. "
    "You see, but you do not observe. The distinction is clear. I'll, we've, they're 42 times!\n\n"
) * 3


def needs(module):
    """The serving package `module` (requirements-serve.txt), imported; outside CI a test that needs one that
    is not installed skips, naming the file; in CI (CI=true) it fails."""
    import importlib
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed: pip install -r requirements-serve.txt")


@pytest.fixture
def inductor_cxx():
    """Names the C++ compiler inductor builds with, for one test, through torch's own config patching:
    pytest's monkeypatch of torch's config leaves it broken for every later test on torch 2.14."""
    with contextlib.ExitStack() as stack:
        yield lambda name: stack.enter_context(torch._inductor.config.patch({"cpp.cxx": (None, name)}))


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def shipped_unchanged():
    """Fails the test if it changed any shipped file (holmes.pt, holmes.csv, tokenizer.json) by a byte."""
    before = {name: sha256(os.path.join(ROOT, name)) for name in SHIPPED}
    yield
    assert {name: sha256(os.path.join(ROOT, name)) for name in SHIPPED} == before


def exit_status(main, argv, monkeypatch):
    """(exit status, the message a real run would print last on stderr) of a script run in-process through run_cli."""
    monkeypatch.setattr(sys, "argv", [str(a) for a in argv])
    handler = signal.getsignal(signal.SIGTERM)  # run_cli installs its own; the test process keeps pytest's
    try:
        run_cli(main)
        return 0, ""
    except SystemExit as e:  # sys.exit(message) prints the message and exits 1 in a real process
        return (1, f"{e.code}\n") if isinstance(e.code, str) else (e.code or 0, "")
    finally:
        signal.signal(signal.SIGTERM, handler)


def run_main(main, argv, monkeypatch, capsys):
    """A script run in-process through run_cli: (exit status, stdout, stderr as a real run shows them)."""
    status, message = exit_status(main, argv, monkeypatch)
    out, err = capsys.readouterr()
    return status, out, err + message


def run_main_once(main, argv):
    """run_main for a module's fixture, which has no monkeypatch or capsys of its own."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status, message = exit_status(main, argv, patch)
    return status, out.getvalue(), err.getvalue() + message


def assert_refused(run, message):
    status, out, err = run
    assert status == 1 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def special_input(tmp_path, kind):
    """A path that is not a readable regular file of sensible size."""
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)  # opening it would block until a writer comes
    elif kind == "folder":
        path.mkdir()
    elif kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")  # reading it would never end
    elif kind == "too-big":
        path.write_bytes(b"x" * 2000)
    return "/dev/zero" if kind == "dev-zero" else path


INPUTS = [
    ("dev-zero", "/dev/zero is not a regular file"), ("link-to-dev-zero", "link-to-dev-zero is not a regular file"),
    ("fifo", "fifo is not a regular file (a pipe or a device?)"), ("folder", "folder is a folder; give a file"),
    ("missing", "missing not found"), ("too-big", "too-big is 0 MiB, more than the 0 MiB"),
]


TOKENIZER = os.path.join(ROOT, "tokenizer.json")
CORPUS = "The game is afoot, Watson! Come, the hansom waits. " * 400
TINY = ["--steps", "1", "--eval-batches", "1"]
RUN_FILES = ("run.pt", "run.csv", "run.resume.pt")


def small_and_fast(monkeypatch):
    """A 2-layer, 64-wide model on batches of two 64-token windows: a step takes milliseconds where
    Part 3's takes seconds on a shared CPU. The recipe and every file are otherwise the same."""
    monkeypatch.setattr(train_module, "Config", functools.partial(Config, d_model=64, n_heads=2, n_layers=2,
                                                                  context=64))
    monkeypatch.setattr(train_module, "BATCH", 2)


def train(tmp_path, *args, monkeypatch, capsys):
    """train.py in-process in tmp_path, on its corpus.txt (CORPUS unless there is one) and the shipped
    tokenizer, writing run.*; a small model and no progress line."""
    monkeypatch.chdir(tmp_path)
    small_and_fast(monkeypatch)
    monkeypatch.setattr(train_module, "show_progress", lambda *args, **kwargs: None)
    if not (tmp_path / "corpus.txt").exists():
        (tmp_path / "corpus.txt").write_text(CORPUS)
    argv = ["train.py", "--corpus", "corpus.txt", "--tokenizer", TOKENIZER, "--out", "run", *args]
    return run_main(train_module.main, argv, monkeypatch, capsys)


def in_process(path, *args):
    """train.main in `path` with a small model, for module fixtures (no monkeypatch fixture there)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(path)
        small_and_fast(mp)
        mp.setattr("sys.argv", ["train.py", "--corpus", "corpus.txt", "--tokenizer", TOKENIZER, *args])
        (path / "corpus.txt").write_text(CORPUS)
        train_module.main()
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 1-step run to copy: corpus.txt, data/ (its ids), run.pt, run.csv."""
    return in_process(tmp_path_factory.mktemp("finished"), "--out", "run", *TINY)


def copy_run(source, tmp_path, files=("corpus.txt", "data", *RUN_FILES)):
    for name in files:
        if os.path.isdir(source / name):
            shutil.copytree(source / name, tmp_path / name)
        else:
            shutil.copy(source / name, tmp_path / name)


PART3_CONFIG = {"vocab_size": 4096, "d_model": 256, "n_heads": 4, "n_layers": 6, "context": 256, "dropout": 0.1}


def part3_state_dict(cfg, seed=0):
    """Random weights under Part 3's key names, built without model.py."""
    g = torch.Generator().manual_seed(seed)
    d, V = cfg["d_model"], cfg["vocab_size"]

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    sd = {"emb.weight": w(V, d)}
    for i in range(cfg["n_layers"]):
        p = f"blocks.{i}."
        sd.update({
            p + "norm1.weight": 1 + w(d), p + "norm1.bias": w(d),
            p + "attn.qkv.weight": w(3 * d, d), p + "attn.out.weight": w(d, d),
            p + "norm2.weight": 1 + w(d), p + "norm2.bias": w(d),
            p + "mlp.0.weight": w(4 * d, d), p + "mlp.0.bias": w(4 * d),
            p + "mlp.2.weight": w(d, 4 * d), p + "mlp.2.bias": w(d),
        })
    sd["norm.weight"], sd["norm.bias"] = 1 + w(d), w(d)
    sd["head.weight"] = sd["emb.weight"]
    return sd


# The small model most tests run: two 64-wide blocks and a 32-token window, so a step takes milliseconds
# and a test can run far past the window; its vocabulary holds PROMPT's ids.
SMALL = Config(vocab_size=512, d_model=64, n_heads=4, n_layers=2, context=32)
PROMPT = [5, 17, 300, 42, 9]


def small(cfg=SMALL, seed=0):
    """A CachedGPT of cfg, seeded, in eval mode."""
    from cached import CachedGPT
    torch.manual_seed(seed)
    return CachedGPT(cfg).eval()


def prompts(batch, length, vocab, seed=1):
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def keys_attended(monkeypatch):
    """Record how many keys each SDPA call may attend to (masked-out keys not counted)."""
    import model as model_py
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counting(q, k, v, attn_mask=None, **kwargs):
        seen.append(k.shape[-2] if attn_mask is None else int(attn_mask[0].sum()))
        return original(q, k, v, attn_mask=attn_mask, **kwargs)
    monkeypatch.setattr(model_py.F, "scaled_dot_product_attention", counting)
    return seen


ODD_TEXTS = [
    "To Sherlock Holmes she is always the woman. \"You have been in Afghanistan, I perceive,\" said he.\n\n    Café, naïve, 1895!",
    "Crème brûlée à la façon de Zoë, señor Müller",
    "東京で会いましょう。北京欢迎你。서울",
    "Thumbs 👍🏽 family 👨‍👩‍👧‍👦 flags 🇬🇧 heart ❤️",
    "e\u0301 combining a\u0308\u0304 marks and Z\u0351\u0364lgo",
    "  two  spaces,   three,\n\n\nnewlines\t\ttabs \r\n end   ",
    "I'll, you've, she's, they're, we'd, I'm, can't, DON'T, o'clock",
    "Numbers 1895, 3.14159, 221B Baker Street; $5 & 10% off!?",
]


@pytest.fixture(autouse=True, scope="session")
def in_the_repo():
    """The suite runs in the repository's folder, where the README runs the scripts (holmes.pt,
    tokenizer.json), whatever folder pytest was started from."""
    started_in = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(started_in)


@pytest.fixture(autouse=True, scope="session")
def own_compile_cache(tmp_path_factory):
    """No test writes into the user's compile cache: the suite's default compile cache is a folder of its
    own. One for the whole suite, so a step compiled for one test's weights and batch is loaded by the
    next that asks for the same (a package is keyed by all that makes it valid)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache-home")))
        yield


AS_SET = compile_ways.COMPILE_WAYS  # read on import, before one_plain_compile_way


def plain_ways(ways):
    """compile_ways.COMPILE_WAYS with inductor's plain way only, on every device."""
    return {device: {"plain": {}} for device in ways}


@pytest.fixture(autouse=True, scope="session")
def one_plain_compile_way():
    """The Engine compiles its decode step each of compile_ways.COMPILE_WAYS and keeps the fastest; with the
    autotuner that costs minutes a batch on a small CPU. The suite compiles the plain way only, and
    the others once, in compile_ahead, for test_compile_cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compile_ways, "COMPILE_WAYS", plain_ways(compile_ways.COMPILE_WAYS))
        yield


# The model whose decode step the suite compiles: small, so a compile takes seconds, with the shipped
# tokenizer's vocabulary, so the serving engines run it too. Compiling is the suite's costliest work,
# so every step the tests run compiled is compiled once, ahead, and loaded by the tests after.
COMPILED = Config(d_model=64, n_heads=4, n_layers=2, context=32)
COMPILED_ROWS = 3  # more than one: each row at its own position in the cache
GREEDY_AND_SAMPLED = ({"temperature": 0}, {"temperature": 1.0})  # the compiled Engines' tests' knobs
PICK_ROWS = (1, 16)


def compiled_model():
    from cached import CachedGPT
    torch.manual_seed(0)
    model = CachedGPT(COMPILED).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10)  # untrained scores are too flat for sampled tokens to say much
    return model


def compile_ahead(folder, plain_kept):
    """compiled_model()'s steps compiled into folder, as the tests run them: for COMPILED_ROWS rows float32
    and int8 the plain way, greedy and sampled (then plain_kept is set: what the `compiled` fixture loads),
    for PICK_ROWS greedy and with every knob, ServingEngine's steps over fewer rows, float32 the autotuned
    ways, and for one row float32 the dot-products way (what `every_way_compiled` waits for)."""
    os.nice(19)  # on the cores the tests leave idle: a test's torch threads stall when they must share one
    compile_ways.COMPILE_WAYS = plain_ways(AS_SET)  # as one_plain_compile_way sets them in the suite
    model = compiled_model()
    for dtype in (torch.float32, torch.int8):
        engine = fast_engine.FastEngine(model, dtype=dtype, compile=True, compile_cache=folder)
        for knobs in GREEDY_AND_SAMPLED:  # the step with each pick the tests ask of it
            engine.prepare(COMPILED_ROWS, [knobs])
    plain_kept.set()
    f32 = fast_engine.FastEngine(model, compile=True, compile_cache=folder)
    for rows in PICK_ROWS:  # tests/test_graph_pick.py's: greedy, and every knob
        for knobs in ({"temperature": 0}, {"top_k": 2, "top_p": 0.5, "penalty": 1.1}):
            f32.prepare(rows, [knobs])
    serving.ServingEngine(model, None, max_rows=COMPILED_ROWS, compile=True, compile_cache=folder)  # its fewer rows
    with torch.inference_mode():
        for batch, way in ((1, compile_ways.DOT_PRODUCTS), (COMPILED_ROWS, "autotuned"),
                           (COMPILED_ROWS, compile_ways.ATTENTION_AS_MATH)):
            cache = decode_step.GraphCache.for_model(model, batch, COMPILED.context)
            decode_step.DecodeStep(model, cache, compile=True, ways={way: AS_SET["cpu"][way]}, compile_cache=folder)


def uses(item, fixture):
    return fixture in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    """The tests that run compiled steps run last, so the steps compile beside the tests before them;
    those that need every way's step after the others, which run while the last of them compile."""
    items.sort(key=lambda item: (uses(item, "compiled"), uses(item, "every_way_compiled")))  # a stable sort


@pytest.fixture(autouse=True, scope="session")
def compiling(request, tmp_path_factory):
    """compile_ahead, in a process of its own started with the session, when any test will run a compiled
    step (compiling is mostly one core's work, and many tests leave the other idle): (home, folder, process,
    plain_kept)."""
    home = tmp_path_factory.mktemp("compiled")
    spawn = multiprocessing.get_context("spawn")
    folder, process, plain_kept = home / "tiny-gpt", None, spawn.Event()
    if any(uses(item, "compiled") for item in request.session.items):
        process = spawn.Process(target=compile_ahead, args=(str(folder), plain_kept))
        process.start()
    yield home, folder, process, plain_kept
    if process is not None and process.is_alive():  # only a run stopped early (-x) gets here before it ends
        process.terminate()
        process.join()


@pytest.fixture(scope="session")
def compiled(compiling, one_plain_compile_way):
    """compiled_model()'s step for COMPILED_ROWS rows in float32 and in int8, in Engines that loaded them from
    the compile cache `folder` (the default one when XDG_CACHE_HOME is `home`), where compile_ahead keeps
    every step the tests run compiled; a step it did not keep (it failed) is compiled here."""
    from engines.fast_engine import FastEngine
    home, folder, process, plain_kept = compiling
    # process is None where no collected test asked for this fixture by name (getfixturevalue)
    while process is not None and process.is_alive() and not plain_kept.wait(1):
        pass
    model = compiled_model()
    f32 = FastEngine(model, compile=True, compile_cache=folder)
    int8 = FastEngine(model, dtype=torch.int8, compile=True, compile_cache=folder)
    for engine in (f32, int8):
        for knobs in GREEDY_AND_SAMPLED:
            engine.prepare(COMPILED_ROWS, [knobs])
    return SimpleNamespace(model=model, home=home, folder=folder, f32=f32, int8=int8)


@pytest.fixture(scope="session")
def every_way_compiled(compiled, compiling):
    """`compiled`, once compile_ahead has kept every step it compiles (the autotuned ways, dot products)."""
    process = compiling[2]
    if process is not None:
        process.join()
    return compiled
