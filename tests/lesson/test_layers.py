"""The two layers and their one direction: the top level is the card's, each lesson script runs from a folder of
the card's files alone, the lesson never reaches engines/, and no import goes round in a circle. Imports inside
functions count: a lesson module may not import the folder even lazily."""
import ast
import os
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT

SCRIPTS = ["model.py", "sampling.py", "cached.py", "prefill_clone.py", "sample_grid.py", "bench.py"]  # the card's six
CARD = {"README.md", "requirements.txt", "Dockerfile", "tokenizer.json", *SCRIPTS, "tests", "bpe.py", "holmes.pt",
        "docs", "engines", "series", ".ci", ".gitignore", ".dockerignore", "pytest.ini", "LICENSE"}
# what a lesson module may import: the card's files, the standard library, torch, regex and numpy
ALLOWED = {name[:-3] for name in SCRIPTS} | {"bpe", "torch", "regex", "numpy", *sys.stdlib_module_names}
RUNS = {  # each script's self-check or a short default run, from the standalone folder
    "model.py": [], "sampling.py": [], "cached.py": ["--tokens", "40"], "prefill_clone.py": ["-n", "2", "--tokens", "5"],
    "sample_grid.py": ["--tokens", "5"], "bench.py": ["--quick"],
}
LESSON_TESTS = sorted(os.path.join(folder, name) for folder in ("lesson", "series")  # the series' tests: the lesson too
                      for name in os.listdir(os.path.join(ROOT, "tests", folder)) if name.endswith(".py"))


def imported(path):
    """Every module `path` imports, inside functions too, as top-level names."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_top_level_holds_the_cards_files_and_nothing_else():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert {path.split("/")[0] for path in tracked} <= CARD


@pytest.mark.parametrize("module", [*SCRIPTS, "bpe.py"])
def test_a_lesson_module_imports_only_the_cards_files_torch_regex_and_numpy(module):
    assert imported(os.path.join(ROOT, module)) <= ALLOWED


@pytest.fixture(scope="module")
def card_folder(tmp_path_factory):
    """An empty folder holding only the six scripts, bpe.py, tokenizer.json and holmes.pt."""
    folder = tmp_path_factory.mktemp("card")
    for name in [*SCRIPTS, "bpe.py", "tokenizer.json", "holmes.pt"]:
        shutil.copy(os.path.join(ROOT, name), folder)
    return folder


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_runs_from_a_folder_of_the_cards_files_alone(card_folder, script):
    run = subprocess.run([sys.executable, script, *RUNS[script]], cwd=card_folder, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ""}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_no_engine_module_imports_one_that_imports_it_back():
    modules = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "engines")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__main__")
                modules[dotted] = path
    edges = {}
    for name, path in modules.items():
        edges[name] = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engines"):
                # `from engines.x import y` reaches the module engines.x.y where there is one, else engines.x
                edges[name] |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                                for a in node.names} & modules.keys()

    def reached(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen
    assert not [name for name in edges if name in reached(name)]


@pytest.mark.parametrize("test_file", LESSON_TESTS)
def test_the_lessons_tests_import_nothing_beyond_it(test_file):
    series = {"series"} if test_file.startswith("series") else set()  # train.py's own tests import it
    assert imported(os.path.join(ROOT, "tests", test_file)) <= ALLOWED | {"pytest", "helpers"} | series


@pytest.mark.parametrize("shared", ["conftest.py", "helpers.py"])
def test_what_the_lessons_tests_load_imports_nothing_beyond_the_lesson(shared):
    assert imported(os.path.join(ROOT, "tests", shared)) <= ALLOWED | {"pytest", "helpers", "series"}
