"""A request to the serving engine, the Events it gets back, and the Sequence the engine keeps for it.

A Sequence is one request as it runs (nano-vllm's Sequence): its tokens (the prompt, then new ones), knobs,
generator, row of the cache and the digests of that row's full blocks. Its place in the scheduler's queues
(waiting, prefilling, running) is its status.
"""
from dataclasses import dataclass, field

import torch

from engines.serving.blocks import chain_root, digests_of
from engines.serving.text import TextStream


@dataclass
class Request:
    id: str
    prompt: list[int]
    max_tokens: int
    seed: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    penalty: float = 1.0
    stop: list = field(default_factory=list)  # token ids and/or strings
    cache_salt: str = ""  # only requests with the same salt share cached blocks (vLLM's cache_salt)


@dataclass
class Event:
    """A token a request made this step (token None: it was cancelled). text: the whole characters it completes;
    finish_reason "stop", "length" or "cancelled" on a request's last event, else None."""
    request_id: str
    token: int | None
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Sequence:
    """One request as it runs. tokens and n_prompt are what prefill_clone's stop rule reads of a row; computed
    counts the positions whose keys are in its row, cached those of them copied from the prefix cache."""

    def __init__(self, request, tokens, seed, knobs, stop_ids, stop_texts, stops_at, vocab, block_size, device):
        self.id, self.max_tokens, self.knobs = request.id, request.max_tokens, knobs
        self.tokens, self.n_prompt = list(tokens), len(tokens)
        self.generator = torch.Generator(device).manual_seed(seed)
        self.stop_ids, self.stops_at, self.text = stop_ids, stops_at, TextStream(vocab, stop_texts)
        self.root = chain_root(request.cache_salt)
        self.prompt_digests = digests_of(self.tokens, block_size, self.root)
        self.row, self.digests = None, []  # its row of the cache; the digests of the row's leading full blocks
        self.computed = self.cached = 0

    def event(self, token, text, finish_reason):
        return Event(self.id, token, text, finish_reason, self.n_prompt, self.cached, len(self.tokens) - self.n_prompt)
