"""README.md's map of the post cannot drift: every file:line link names what it points at, and that line holds it.

The rule: each link is written `[file.py:N](file.py#LN) (`name`)`. A name that is a Python name says the
line defines it (`def name`, `class name`, or `name = ...`); a dotted `Class.method` also says the nearest
class above the line is that class. Any other backticked text is code the line holds verbatim.
"""
import os
import re

import pytest

from conftest import ROOT

LINK = re.compile(r"\[([\w/.-]+\.py):(\d+)\]\(([\w/.-]+\.py)#L(\d+)\)( \(`([^`]+)`\))?")
NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def links(text):
    return [m.groups() for m in LINK.finditer(text)]


def lines_of(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read().splitlines()


def defines(line, name):
    name = re.escape(name)
    return re.match(rf"\s*(?:(?:(?:async\s+)?def|class)\s+{name}\b|{name}\s*(?::[^=]*)?=(?!=))", line) is not None


def enclosing_class(lines, i):
    """The name of the class whose body holds line i (0-based), or None."""
    indent = len(lines[i]) - len(lines[i].lstrip())
    for line in reversed(lines[:i]):
        stripped = line.lstrip()
        if stripped and len(line) - len(stripped) < indent:
            found = re.match(r"class\s+(\w+)", stripped)
            if found:
                return found.group(1)
            indent = len(line) - len(stripped)
    return None


def problem(found, read=lines_of):
    """What is wrong with one link (a links() entry), or None; read(path) gives a file's lines."""
    path, number, target, target_number, _, name = found
    link = f"[{path}:{number}]({target}#L{target_number})"
    if (path, number) != (target, target_number):
        return f"{link}: its text and its target differ"
    if name is None:
        return f"{link}: no (`name`) after it says what the line holds"
    lines = read(path)
    n = int(number)
    if not 1 <= n <= len(lines):
        return f"{link} (`{name}`): {path} has {len(lines)} lines"
    line = lines[n - 1]
    if NAME.fullmatch(name):
        *owner, last = name.split(".")
        if defines(line, last) and (not owner or enclosing_class(lines, n - 1) == owner[-1]):
            return None
        return f"{link} (`{name}`): line {n} does not define {name}; it is {line.strip()!r}"
    if name in line:
        return None
    return f"{link} (`{name}`): line {n} does not hold that code; it is {line.strip()!r}"


def test_every_map_link_points_at_the_line_holding_the_name_it_gives():
    text = readme()
    found = links(text)
    assert len(found) >= 20, "the map's links were not found: has the link form changed?"
    assert len(found) == text.count(".py#L"), "a .py#L link is not in the form [file.py:N](file.py#LN)"
    problems = [p for p in map(problem, found) if p]
    assert not problems, "\n".join(problems)


FAKE = {"cached.py": ["import torch", "", "class LayerCache:", "    kept = None", "",
                      "    def update(self, k, v, start):", "        return k", "", "",
                      "class TrimAfter(LayerCache):", "    def update(self, k, v, start):", "        return v"],
        "model.py": ["def rope_at(x, start):", "    angles = torch.arange(start, start + T)[:, None] * freqs"]}


@pytest.mark.parametrize("entry, wrong", [
    ("[cached.py:3](cached.py#L3) (`LayerCache`)", None),
    ("[cached.py:4](cached.py#L4) (`LayerCache.kept`)", None),
    ("[cached.py:6](cached.py#L6) (`LayerCache.update`)", None),
    ("[cached.py:11](cached.py#L11) (`TrimAfter.update`)", None),
    ("[cached.py:11](cached.py#L11) (`LayerCache.update`)", "line 11 does not define LayerCache.update"),
    ("[cached.py:2](cached.py#L2) (`LayerCache`)", "line 2 does not define LayerCache; it is ''"),
    ("[cached.py:3](cached.py#L3)", "no (`name`) after it"),
    ("[cached.py:3](cached.py#L4) (`LayerCache`)", "its text and its target differ"),
    ("[cached.py:99](cached.py#L99) (`LayerCache`)", "cached.py has 12 lines"),
    ("[model.py:2](model.py#L2) (`angles = torch.arange(start`)", None),
    ("[model.py:1](model.py#L1) (`angles = torch.arange(start`)", "line 1 does not hold that code"),
])
def test_the_rule_catches_a_link_that_drifted(entry, wrong):
    (found,) = links(entry)
    result = problem(found, read=FAKE.get)
    assert (result is None) if wrong is None else (wrong in result), result
