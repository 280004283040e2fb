"""The serving engine's model runner (nano-vllm's ModelRunner): a step's Plan run on the device, and the pick.

The decode step runs over the fewest first rows of the cache that hold every decoding row (the step runner's,
engines/runner.py: eager, or compiled, on CUDA captured as a graph, one a size), each decoding row fed its
next token at its own position; the other rows a step runs over (prefilling, or free) are fed a token at the
first position they have not written, which the keys that belong there overwrite before anything reads them.
The prompt chunks run into their rows, those of about one length in one forward of the lesson's
CachedGPT.step (engines/row_cache.py's prompt_step, each query masked at its own position); where the decode
steps are compiled on a CPU, one chunk a call through its compiled program (row_cache.CompiledChunks). Each sequence's
next token is picked as the lesson's Engine picks it for that request alone: its generator, its knobs, its
history.
"""
import torch

from engines.rope import with_row_attention
from engines.row_cache import CompiledChunks, prompt_step
from engines.runner import StepRunner, compiles_in_process
from model import check_finite


class ServingRunner:
    """max_rows rows of the full window (self.rows, the step runner's cache). on_logits: None, or a callable
    (logits, sequences) given the scores each step's tokens are picked from, a row a sequence: how a check
    sees what the engine picks from (engines/serving_check.py)."""

    def __init__(self, model, lesson, max_rows, fixed_shapes=False, compile=False, compile_cache=None):
        self.model, self.lesson, self.fixed_shapes = model, lesson, fixed_shapes
        self.prompt_model = with_row_attention(model)  # the prompts' chunks, each query masked at its position
        self.steps = StepRunner(model, max_rows, [max_rows] if fixed_shapes else None, compile, compile_cache).made()
        self.rows, self.device = self.steps.cache, model.emb.weight.device
        self.chunks = self._compiled_chunks(compile, compile_cache)
        self.on_logits = None

    def use_compiled(self, compile_cache=None):
        """From the next step on, run the decode steps compiled (loaded from compile_cache where kept). Making each
        ready runs it on the rows and puts them back as they were, so call it between two steps."""
        self.steps = StepRunner(self.model, self.rows.shape["batch"], self.steps.sizes, True, compile_cache,
                                cache=self.rows).made()
        self.chunks = self._compiled_chunks(True, compile_cache)

    def _compiled_chunks(self, compile, compile_cache):
        """The prompt chunks compiled (row_cache.CompiledChunks) where the decode steps are compiled on a CPU; None:
        eager, as on CUDA, where compiled programs are made in the process and never kept as packages."""
        if not compile or self.fixed_shapes or compiles_in_process(self.device):
            return None
        return CompiledChunks(self.model, self.rows, compile_cache)

    def decode(self, plan):
        """{sequence: the scores its next token is picked from} for the plan's decoding rows: the decode step over
        the fewest first rows that hold every one of them."""
        if not plan.decoding:
            return {}
        step = self.steps.step(max(s.row for s in plan.decoding) + 1)
        n = step.cache.shape["batch"]
        tokens, positions = [0] * n, [0] * n
        for s in plan.holding:
            if s.row < n:
                positions[s.row] = s.computed
        for s in plan.decoding:
            tokens[s.row] = s.tokens[s.computed]
        self.rows.cache_seqlens[:n].copy_(torch.tensor(positions))
        last = self.model.cfg.context - 1 if self.fixed_shapes else max(s.computed for s in plan.decoding)
        logits = step(torch.tensor(tokens, device=self.device).view(-1, 1), last)
        return {s: logits[s.row] for s in plan.decoding}

    def prefill(self, plan):
        """{sequence: the scores of its chunk's last token} for the plan's prompt chunks."""
        if self.chunks is not None:  # compiled: a chunk a call
            return {s: self.chunks(s.row, s.tokens[a:b], a)[0] for s, a, b in plan.chunks}
        scores = {}
        for group in self._by_length(plan.chunks):
            logits = prompt_step(self.prompt_model, self.rows, [(s.row, s.tokens[a:b], a) for s, a, b in group])
            scores.update((s, row) for (s, _, _), row in zip(group, logits))
        return scores

    @staticmethod
    def _by_length(chunks):
        """The chunks in groups of a forward each: those whose lengths share a power of two above them, so no
        forward pads a chunk to more than twice its length (padding costs its compute; a forward of its own
        costs the operators' fixed time, which on a small model is most of a short chunk's)."""
        groups = {}
        for chunk in chunks:
            groups.setdefault((chunk[2] - chunk[1] - 1).bit_length(), []).append(chunk)
        return groups.values()

    def pick(self, scores, seqs):
        """One token for each of seqs from its scores ({sequence: scores}), as the Engine picks it for that request
        alone: rows without a repetition penalty in one call of its pick (which groups equal knobs and gives each
        row its own generator), each penalized row with its own history, the prompt and its tokens so far."""
        if not seqs:
            return []
        logits = torch.stack([scores[s] for s in seqs])
        check_finite(logits, min(len(s.tokens) - s.n_prompt for s in seqs))
        if self.on_logits is not None:
            self.on_logits(logits, seqs)
        picked = [None] * len(seqs)
        plain = [i for i, s in enumerate(seqs) if s.knobs["penalty"] == 1.0]
        if plain:
            tokens = self.lesson.pick(logits[plain], None, [seqs[i].generator for i in plain],
                                      [seqs[i].knobs for i in plain])
            for i, token in zip(plain, tokens.tolist()):
                picked[i] = token
        for i, s in enumerate(seqs):
            if picked[i] is None:
                history = torch.tensor([s.tokens], device=self.device)
                picked[i] = self.lesson.pick(logits[i:i + 1], history, [s.generator], [s.knobs]).item()
        return picked
