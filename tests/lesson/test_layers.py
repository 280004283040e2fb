"""The two layers and their one direction: the lesson at the top level never reaches engines/, and no import
goes round in a circle. Imports inside functions count: a lesson module may not import the folder even lazily."""
import ast
import os
import subprocess
import sys

import pytest

from helpers import ROOT

LESSON = ["model", "bpe", "cached", "sampling", "prefill_clone"]  # the post's modules
EDGE = ["cli", "checks", "errors", "files", "timing"]  # what every script shares: leaves, beneath the lesson
SCRIPTS_ON_TOP = ["sample_grid", "bench"]  # the lesson's scripts: the folder only where a flag asks for it
BEYOND = ("engines", "transformers", "tokenizers", "gguf", "ctranslate2", "llama_cpp", "fastapi", "starlette",
          "uvicorn", "openai", "torch._inductor")
LESSON_TESTS = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "tests", "lesson")) if name.endswith(".py"))


def repo_modules():
    """{module name: path} of every Python file of the repo outside tests/."""
    found = {name[:-3]: os.path.join(ROOT, name) for name in os.listdir(ROOT) if name.endswith(".py")}
    folder = os.path.join(ROOT, "engines")
    found |= {f"engines.{name[:-3]}": os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".py")}
    return found


def imported(path, top_level_only=False):
    """Every module `path` imports (inside functions too, unless top_level_only), as dotted names."""
    tree = ast.parse(open(path).read())
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # from engines import peers
    return names


def graph(top_level_only=False):
    modules = repo_modules()
    return {name: {m for m in imported(path, top_level_only) if m in modules} for name, path in modules.items()}


def reached(start, edges):
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_goes_round_in_a_circle():
    edges = graph()
    circles = [name for name in edges if name in reached(name, edges)]
    assert not circles, f"modules that import themselves through others: {circles}"


@pytest.mark.parametrize("module", LESSON)
def test_a_lesson_module_reaches_nothing_beyond_the_lesson(module):
    edges, modules = graph(), repo_modules()
    reach = reached(module, edges) | {module}
    assert not any(m.startswith("engines") for m in reach), sorted(reach)
    outside = {m for name in reach for m in imported(modules[name]) if m.startswith(BEYOND)}
    assert not outside, f"{module} reaches {sorted(outside)}"


@pytest.mark.parametrize("module", EDGE)
def test_the_edge_imports_nothing_of_the_lesson(module):
    assert reached(module, graph()) <= set(EDGE)


@pytest.mark.parametrize("script", SCRIPTS_ON_TOP)
def test_a_lesson_script_loads_the_folder_only_inside_the_branch_a_flag_takes(script):
    edges = graph(top_level_only=True)
    assert not any(m.startswith("engines") for m in reached(script, edges) | edges[script])


def test_importing_the_lesson_loads_nothing_of_engines_and_model_py_no_cli():
    # model.py and sampling.py need no command line; speed is applied from outside: the lesson never imports it
    code = ("import sys, model, sampling; print('cli' in sys.modules); "
            "import bench, cached, prefill_clone, sample_grid, bpe, train; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('engines', 'transformers', 'torch._inductor')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "[]"]


@pytest.mark.parametrize("test_file", LESSON_TESTS)
def test_the_lessons_tests_import_nothing_beyond_it(test_file):
    names = imported(os.path.join(ROOT, "tests", "lesson", f"{test_file}.py"))
    assert not [m for m in names if m.startswith(BEYOND)], test_file


@pytest.mark.parametrize("conftest", ["conftest.py", "helpers.py"])
def test_what_the_lessons_tests_load_imports_nothing_of_the_folder(conftest):
    names = imported(os.path.join(ROOT, "tests", conftest))
    assert not [m for m in names if m.startswith(BEYOND)], conftest
