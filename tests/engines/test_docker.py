"""The Docker path serves: the image's serve stage installs engines/requirements.txt, .dockerignore lets in every
file serving and the GPU check need, and the README gives the `docker run --gpus all` lines (no Docker needed)."""
import fnmatch
import os
import re
import subprocess

from helpers import ROOT


def read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def stages(dockerfile):
    """{stage name: its instructions' lines}, each FROM ... AS NAME opening one."""
    found, name = {}, None
    for line in dockerfile.splitlines():
        if match := re.match(r"FROM \S+ AS (\w+)$", line):
            name = match.group(1)
            found[name] = [line]
        elif name and line and not line.startswith("#"):
            found[name].append(line)
    return found


def let_in(path, rules):
    """Whether .dockerignore's rules (an allow-list: `*`, then `!pattern` lines) send `path` to the image."""
    kept = True
    for rule in rules:
        negated, pattern = rule.startswith("!"), rule.lstrip("!")
        if fnmatch.fnmatch(path, pattern) and (pattern.count("/") == path.count("/") or pattern == "*"):
            kept = negated
    return kept


def test_the_serve_stage_installs_requirements_serve_and_runs_the_gpu_check():
    found = stages(read("Dockerfile"))
    assert list(found) == ["base", "serve", "lesson"]  # the lesson last: a plain `docker build` makes it
    serve = "\n".join(found["serve"])
    assert "FROM base AS serve" in serve and "-r engines/requirements.txt" in serve and "COPY . ." in serve
    assert 'CMD ["bash", "engines/fast/gpu_check.sh"]' in serve and "EXPOSE 8000" in serve
    base = "\n".join(found["base"])
    # each requirements file copied to the path pip is given (one COPY of both to ./ would put one over the other)
    assert "-r requirements.txt" in base and "COPY requirements.txt ./" in base
    assert "COPY engines/requirements.txt engines/" in base


def test_dockerignore_lets_in_every_tracked_file_but_the_repos_own_leftovers():
    rules = [line for line in read(".dockerignore").splitlines() if line and not line.startswith("#")]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    needed = [p for p in tracked if p.endswith((".py", ".sh", ".html")) or p in ("holmes.pt", "tokenizer.json")]
    assert "engines/serving/engine.py" in needed and "engines/fast/gpu_check.sh" in needed and "engines/serving/chat.html" in needed
    assert [p for p in needed if not let_in(p, rules)] == []
    assert not let_in("corpus.txt", rules) and not let_in(".venv/bin/python", rules)


def test_readme_gives_the_docker_lines_and_serving_beyond_loopback_asks_for_a_key():
    readme = read("README.md")
    for line in ("docker build -t tiny-gpt .", "docker run --rm --gpus all tiny-gpt python prefill_clone.py --device cuda",
                 "docker build --target serve -t tiny-gpt-serve .", "docker run --rm --gpus all -p 8000:8000 -e TINY_GPT_API_KEY tiny-gpt-serve",
                 "python -m engines.serve --host 0.0.0.0 --device cuda --dtype bfloat16"):
        assert line in readme, line
