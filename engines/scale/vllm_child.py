"""vLLM's offline LLM on an exported folder, greedy, its prompts given as token ids: run in the vLLM venv, in a
process of its own (engines/scale/vllm_peer.py starts it, so a crash takes down only this process).

    .venv-vllm/bin/python engines/scale/vllm_child.py < request.json

request: {"folder", "prompts": [[id, ...], ...], "tokens": n, "dtype", "max_model_len"}; it prints one JSON line,
{"tokens": [[id, ...], ...], "start_s": seconds to build the LLM, "vllm", "torch"}, as its last line of stdout.
It imports vLLM and nothing of this repo (the vLLM venv holds vLLM's own torch).
"""
import json
import sys
import time


def main():
    request = json.load(sys.stdin)
    t0 = time.perf_counter()
    import torch
    import vllm
    llm = vllm.LLM(model=request["folder"], dtype=request["dtype"], max_model_len=request["max_model_len"],
                   seed=0)
    start_s = time.perf_counter() - t0
    greedy = vllm.SamplingParams(temperature=0, max_tokens=request["tokens"], ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in request["prompts"]], greedy, use_tqdm=False)
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    print(json.dumps({"tokens": tokens, "start_s": start_s, "vllm": vllm.__version__, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
