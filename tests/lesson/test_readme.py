"""The map of the post (docs/map.md) cannot drift: every file:line link names what it points at, and that line holds it.

The rule: each link is written `[file.py:N](TARGET#LN) (`name`)`, file.py the path from the repository's root
and TARGET the same file as a link from the page's own folder (`cached.py` in README.md, `../cached.py` in
docs/). A name that is a Python name says the line defines it (`def name`, `class name`, or `name = ...`); a
dotted `Class.method` also says the nearest class above the line is that class. Any other backticked text is
code the line holds verbatim. The same rule holds for any such link in README.md or another page of docs/.
"""
import glob
import os
import posixpath
import re

import pytest

from helpers import ROOT

MAP = "docs/map.md"
LINK = re.compile(r"\[([\w/.-]+\.py):(\d+)\]\(([\w/.-]+\.py)#L(\d+)\)( \(`([^`]+)`\))?")
NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def pages():
    """README.md and every page of docs/, as paths from the repository's root."""
    found = sorted(os.path.relpath(p, ROOT).replace(os.sep, "/") for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md"] + found


def text_of(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
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


def problem(found, page="README.md", read=lines_of):
    """What is wrong with one link (a links() entry) on `page`, or None; read(path) gives a file's lines."""
    path, number, target, target_number, _, name = found
    link = f"[{path}:{number}]({target}#L{target_number})"
    expected = posixpath.relpath(path, posixpath.dirname(page) or ".")
    if (expected, number) != (target, target_number):
        return f"{page}: {link}: its text and its target differ (from {page}, {path} line {number} is {expected}#L{number})"
    if name is None:
        return f"{page}: {link}: no (`name`) after it says what the line holds"
    lines = read(path)
    if lines is None:
        return f"{page}: {link} (`{name}`): there is no {path}"
    n = int(number)
    if not 1 <= n <= len(lines):
        return f"{page}: {link} (`{name}`): {path} has {len(lines)} lines"
    line = lines[n - 1]
    if NAME.fullmatch(name):
        *owner, last = name.split(".")
        if defines(line, last) and (not owner or enclosing_class(lines, n - 1) == owner[-1]):
            return None
        where = [i + 1 for i, other in enumerate(lines)
                 if defines(other, last) and (not owner or enclosing_class(lines, i) == owner[-1])]
        return f"{page}: {link} (`{name}`): line {n} does not define {name}; it is {line.strip()!r}{seen_at(where)}"
    if name in line:
        return None
    where = [i + 1 for i, other in enumerate(lines) if name in other]
    return f"{page}: {link} (`{name}`): line {n} does not hold that code; it is {line.strip()!r}{seen_at(where)}"


def seen_at(where):
    """Where the name or code is found instead, to make a drifted link easy to fix."""
    return f" (found at line {', '.join(map(str, where))})" if where else " (found nowhere in the file)"


def read_or_none(path):
    return lines_of(path) if os.path.isfile(os.path.join(ROOT, path)) else None


def test_the_map_has_its_links():
    assert len(links(text_of(MAP))) >= 20, f"{MAP}'s links were not found: has the link form changed?"


@pytest.mark.parametrize("page", pages())
def test_every_link_points_at_the_line_holding_the_name_it_gives(page):
    text = text_of(page)
    found = links(text)
    assert len(found) == text.count(".py#L"), f"{page}: a .py#L link is not in the form [file.py:N](file.py#LN)"
    problems = [p for p in (problem(f, page, read_or_none) for f in found) if p]
    assert not problems, "\n".join(problems)


FAKE = {"cached.py": ["import torch", "", "class LayerCache:", "    kept = None", "",
                      "    def update(self, k, v, start):", "        return k", "", "",
                      "class TrimAfter(LayerCache):", "    def update(self, k, v, start):", "        return v"],
        "model.py": ["def rope_at(x, start):", "    angles = torch.arange(start, start + T)[:, None] * freqs"],
        "engines/fast/engine.py": ["class FastEngine(Engine):", "    def prepare(self, batch):"]}


@pytest.mark.parametrize("entry, page, wrong", [
    ("[cached.py:3](cached.py#L3) (`LayerCache`)", "README.md", None),
    ("[cached.py:4](cached.py#L4) (`LayerCache.kept`)", "README.md", None),
    ("[cached.py:6](cached.py#L6) (`LayerCache.update`)", "README.md", None),
    ("[cached.py:11](cached.py#L11) (`TrimAfter.update`)", "README.md", None),
    ("[cached.py:11](cached.py#L11) (`LayerCache.update`)", "README.md", "line 11 does not define LayerCache.update"),
    ("[cached.py:11](cached.py#L11) (`LayerCache.update`)", "README.md", "(found at line 6)"),
    ("[cached.py:3](cached.py#L3) (`Missing`)", "README.md", "(found nowhere in the file)"),
    ("[cached.py:2](cached.py#L2) (`LayerCache`)", "README.md", "line 2 does not define LayerCache; it is ''"),
    ("[cached.py:3](cached.py#L3)", "README.md", "no (`name`) after it"),
    ("[cached.py:3](cached.py#L4) (`LayerCache`)", "README.md", "its text and its target differ"),
    ("[cached.py:99](cached.py#L99) (`LayerCache`)", "README.md", "cached.py has 12 lines"),
    ("[model.py:2](model.py#L2) (`angles = torch.arange(start`)", "README.md", None),
    ("[model.py:1](model.py#L1) (`angles = torch.arange(start`)", "README.md", "line 1 does not hold that code"),
    # from docs/, a link goes up a folder; the text keeps the path from the root
    ("[cached.py:3](../cached.py#L3) (`LayerCache`)", "docs/map.md", None),
    ("[cached.py:11](../cached.py#L11) (`LayerCache.update`)", "docs/map.md", "line 11 does not define LayerCache.update"),
    ("[cached.py:3](cached.py#L3) (`LayerCache`)", "docs/map.md", "is ../cached.py#L3"),
    ("[cached.py:3](../cached.py#L3) (`LayerCache`)", "README.md", "is cached.py#L3"),
    ("[engines/fast/engine.py:1](../engines/fast/engine.py#L1) (`FastEngine`)", "docs/map.md", None),
    ("[engines/fast/engine.py:2](../engines/fast/engine.py#L2) (`FastEngine.prepare`)", "docs/map.md", None),
    ("[engines/fast/engine.py:2](../engines/fast/engine.py#L2) (`FastEngine`)", "docs/map.md", "does not define FastEngine"),
    ("[kernels.py:1](../kernels.py#L1) (`FastEngine`)", "docs/map.md", "there is no kernels.py"),
])
def test_the_rule_catches_a_link_that_drifted(entry, page, wrong):
    (found,) = links(entry)
    result = problem(found, page, read=FAKE.get)
    assert (result is None) if wrong is None else (wrong in result), result
