"""The engines' table 6: the same weights through the serving engines, beside the Engine's forms.

    python -m engines.bench --tables 6

transformers' GPT-NeoX, CTranslate2 (float32 and int8) and llama.cpp (f32 and
q8_0), each installed by engines/requirements.txt; llama.cpp and CTranslate2
each in a fresh process of its own every round (engines/export/peers.py).
"""
import importlib.util
import os
import tempfile

import torch

from engines.bench.figures import bandwidth_cells, bytes_per_step, put_bandwidth
from bpe import BPE
from cached import first_difference
from engines.export import peers
from engines.bench.speed import CHECKPOINT, drift_model, drift_prompt
from engines.fast.engine import FastEngine
from engines.edge.timing import measure


# table 6's serving engines: the modules each needs, and the requirements file that installs them
# (CTranslate2 int8: its own int8 compute on the float32 conversion; llama.cpp q8_0: a q8_0 GGUF)
PEERS = {"transformers": (("transformers",), "engines/requirements.txt"),
         "ctranslate2": (("ctranslate2",), "engines/requirements.txt"),
         "ctranslate2_int8": (("ctranslate2",), "engines/requirements.txt"),
         "llama_cpp": (("gguf", "llama_cpp"), "engines/requirements.txt"),
         "llama_cpp_q8_0": (("gguf", "llama_cpp"), "engines/requirements.txt")}


GGUF_KINDS = {"llama_cpp": "f32", "llama_cpp_q8_0": "q8_0"}


CT2_COMPUTE = {"ctranslate2": "float32", "ctranslate2_int8": "int8"}


# what a serving engine's step reads, where it is not the float32 Engine's: the 8-bit engines' weights as the
# int8 Engine's (a byte a weight, a scale a row; q8_0 has one a 32-value block, 6% more), and llama.cpp's
# keys and values in f16, its default cache
PEER_READS = {"ctranslate2_int8": "engine_int8", "llama_cpp_q8_0": "engine_int8"}


PEER_CACHE_DTYPES = {"llama_cpp": torch.float16, "llama_cpp_q8_0": torch.float16}


def missing_peers(device):
    """{peer: why it cannot run here}, for each serving engine of table 6 that cannot."""
    missing = {}
    for name, (modules, requirements) in PEERS.items():
        if not all(importlib.util.find_spec(m) for m in modules):
            missing[name] = f"not installed (pip install -r {requirements})"
        elif name != "transformers" and "transformers" in missing:  # the model reaches them through engines/export/hf_folder.py
            missing[name] = "needs transformers to export the model (pip install -r engines/requirements.txt)"
        elif name != "transformers" and device.type != "cpu":
            missing[name] = "run on the CPU only here"
    return missing


def peer_runs(model, engines, missing, prompt, n, folder):
    """{name: run(batch)} for the Engine's forms given and each serving engine installed, on model's weights
    (the serving engines' files written under folder): a run generates batch greedy rows of n tokens from
    prompt and returns (the rows' new ids, the seconds it timed itself in a process of its own, or None)."""
    from engines.export import hf_folder  # after missing_peers: it needs transformers
    device, threads = model.emb.weight.device, torch.get_num_threads()
    runs = {name: lambda b, e=engine: (e.generate_batch(prompt, b, max_tokens=n, temperature=0)[0], None)
            for name, engine in engines.items()}
    if "transformers" in missing:
        return runs
    bpe = BPE.load("tokenizer.json")
    hf_folder.logging.disable_progress_bar()  # transformers' bars for writing and loading would break the table's rows
    # and so would its reminder that prompt + n tokens pass the context: 6b compares those tokens
    hf_folder.logging.set_verbosity_error()
    hf_folder.write_folder(model, bpe, os.path.join(folder, "hf"))
    hf, tokenizer = hf_folder.load_folder(os.path.join(folder, "hf"))
    hf = hf.to(device)
    runs["transformers"] = lambda b: (hf.generate(torch.tensor([prompt] * b, device=device), max_new_tokens=n,
                                                  min_new_tokens=n, do_sample=False,
                                                  pad_token_id=0)[:, len(prompt):].tolist(), None)
    tokens = tokenizer.convert_ids_to_tokens(prompt)
    for name, compute in CT2_COMPUTE.items():
        if name not in missing:
            ct2 = os.path.join(folder, "ct2")
            if not os.path.exists(ct2):
                peers.write_ct2(hf, tokenizer, ct2)
            runs[name] = lambda b, compute=compute: last_run(peers.isolated(
                "CTranslate2", peers.ct2_greedy, ct2, tokens, b, n, threads, 2, compute))
    for name, kind in GGUF_KINDS.items():
        if name not in missing:
            gguf = os.path.join(folder, f"model-{kind}.gguf")
            peers.write_gguf(gguf, model.cfg, hf_folder.neox_state_dict(model), *hf_folder.spelled_vocabulary(bpe), kind)
            runs[name] = lambda b, gguf=gguf: last_run(peers.isolated(
                "llama.cpp", peers.llama_greedy, gguf, prompt, b, n, threads, 2))
    return runs


def last_run(result):
    """(rows, seconds of the last run) from an engine's (rows, [seconds of each run]): the first run warms up."""
    rows, seconds = result
    return rows, seconds[-1]


def table_peers(model, engines, device, sizes, runs, bandwidth, decode, out):
    """The same weights through the serving engines, side by side with the Engine's forms, greedy; an engine
    that cannot run here keeps its column, shown as -, and a line says why. Under each batch, the Engine's
    forms here over their own figures in table 4 (decode: its rows in this run), where it ran that length.

    llama.cpp and CTranslate2 each bring a thread pool that, once started in a process, slows torch
    and every other engine there for the rest of it; so each runs in a fresh process of its own,
    every round (a warm-up, then the timed run), and never during another's timing."""
    n = min(256, max(sizes["lengths"]))
    print(f"\n6. the same weights through the serving engines: greedy tok/s, {n} tokens (median); the Engine's "
          "forms as in table 4; llama.cpp and CTranslate2 each in a fresh process of its own every round")
    print("   Under each row, %bw: the MB a step must read (as in table 4; the 8-bit engines' weights counted as the")
    print("   int8 Engine's, llama.cpp's keys and values in f16) and bytes a step x steps a second over the bandwidth")
    missing = missing_peers(device)
    for name, why in missing.items():
        print(f"   {name}: {why}")
    prompt = drift_prompt(model)
    ratios = {"compiled/llama_cpp": ("engine_compiled", "llama_cpp"),
              "int8 compiled/q8_0": ("engine_int8_compiled", "llama_cpp_q8_0")}
    with tempfile.TemporaryDirectory() as tmp:
        peers = peer_runs(model, engines, missing, prompt, n, tmp)
        columns = [*engines, *PEERS]
        print(f"{'batch':>5} " + " ".join(f"{name:>15}" for name in columns)
              + "".join(f" {name:>20}" for name in ratios))
        for batch in sizes["batches"]:
            row = {"batch": batch, "tokens": n}
            timed = measure({name: lambda run=run: run(batch)[1] for name, run in peers.items()}, runs, device,
                            label=f"batch {batch}:")
            row.update({name: batch * n / t for name, (t, _) in timed.items()})
            for name in timed:
                reads = engines[PEER_READS.get(name, name)].model if PEER_READS.get(name, name) in engines else model
                put_bandwidth(row, name, bytes_per_step(reads, batch, n, cache_dtype=PEER_CACHE_DTYPES.get(name)),
                              bandwidth)
            out.append(row)
            cells = [f"{row[a] / row[b]:>19.2f}x" if a in row and b in row else f"{'-':>20}"
                     for a, b in ratios.values()]
            print(f"{batch:>5} " + " ".join(f"{row[name]:>15,.0f}" if name in row else f"{'-':>15}" for name in columns)
                  + "".join(f" {cell}" for cell in cells))
            print(f"{'%bw':>5} " + " ".join(bandwidth_cells(row, [name], 15) if name in row else f"{'-':>15}"
                                           for name in columns))
            print(f"{'':>5} {against_table_4(row, engines, decode)}", flush=True)


def against_table_4(row, engines, decode):
    """A line setting the Engine's forms in a table 6 row beside their figures in table 4's rows `decode`
    of the same run (kept in row["over_table_4"]): a form timed twice in one run should agree with itself."""
    same = [r for r in decode if (r["batch"], r["tokens"]) == (row["batch"], row["tokens"])]
    if not same:
        return f"(table 4 did not run batch {row['batch']}, {row['tokens']} tokens in this run: nothing to set beside)"
    row["over_table_4"] = {name: row[name] / same[0][name] for name in engines}
    return ("over table 4 in this run: " + ", ".join(f"{name} {x:.2f}x" for name, x in row["over_table_4"].items())
            + " (the same forms timed twice, a prompt apart)")


def table_peers_drift(device, n_tokens, out):
    """Where each form of the Engine and each serving engine parts from the float32 Engine, greedy, on the
    trained weights (table 6's 8-bit engines beside their float32 forms)."""
    print(f"\n6b. drift on {CHECKPOINT}: the first of {n_tokens} greedy tokens (8-token prompt, as 4b) where each "
          "parts from the float32 Engine;")
    print("   the compiled forms give their eager forms' tokens (table 4 checks)")
    model = drift_model(device)
    engines = {"engine": FastEngine(model), "engine_bf16": FastEngine(model, dtype=torch.bfloat16),
               "engine_int8": FastEngine(model, dtype=torch.int8)}
    prompt = drift_prompt(model)
    with tempfile.TemporaryDirectory() as tmp:
        runs = peer_runs(model, engines, missing_peers(device), prompt, n_tokens, tmp)
        reference = runs.pop("engine")(1)[0][0]
        for name, run in runs.items():
            out[name] = first_difference(reference, run(1)[0][0])
            print(f"  {name:<17} {'never' if out[name] is None else f'at token {out[name]}'}", flush=True)
