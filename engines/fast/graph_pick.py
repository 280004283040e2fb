"""The lesson's pick (sampling.pick) as part of the compiled decode step, as gpt-fast's decode_one_token.

sampling.pick branches on its knobs' values, one call per group of rows that share them; a compiled
program cannot. Here every row runs the same steps, its knobs tensors of the batch (Knobs), and a row's
knob that asks for nothing leaves its scores as they were: the same operations on the same values as
sampling.pick, so each row gets the token the lesson's Engine picks for it. The program is made for
the knobs some row of the generation uses (stages_for), so a greedy run does not pay for a sort, nor
one without a penalty for the penalty's float64 pass.

The draw: ATen's multinomial, for one sample, is the exponential race (the Gumbel-max trick): it draws
an Exp(1) for every vocabulary entry from the row's generator and takes argmax(p / q). Knobs.draw makes
those very numbers with the same call on the same generator, outside the program (a compiled program
cannot hold a torch.Generator), so the program picks the token multinomial would, and each generator
ends where the lesson's would (tests/engines/test_graph_pick.py checks both).

    program inputs: logits (B, vocab), the token just fed (B, 1) and Knobs' tensors
    program output: the next token of each row (B, 1), -1 where the row's scores are not finite
"""
import torch
import torch.nn as nn

STAGES = ("penalty", "temperature", "top_k", "top_p")  # in the order sampling.pick applies them


def stages_for(settings, vocab_size):
    """The knobs some row of `settings` (one dict of sampling.pick's knobs per row) uses; () is greedy with
    no penalty. Top-k and top-p count only where some row draws: a greedy row ignores them."""
    drawing = any(s.get("temperature", 1.0) != 0 for s in settings)
    used = {"penalty": any(s.get("penalty", 1.0) != 1.0 for s in settings),
            "temperature": drawing,
            "top_k": drawing and any(0 < s.get("top_k", 0) < vocab_size for s in settings),
            "top_p": drawing and any(s.get("top_p", 1.0) < 1.0 for s in settings)}
    return tuple(name for name in STAGES if used[name])


class Knobs:
    """Each row's knobs as tensors of the batch, what the program reads, and `seen`: the tokens each row's
    repetition penalty pushes down (the prompt and every token fed since: sampling.pick's history, as a
    mask). The flags are decided here, in Python's double precision, as sampling.pick decides them."""

    def __init__(self, batch, vocab_size, device):
        self.seen = torch.zeros(batch, vocab_size, dtype=torch.bool, device=device)
        self.noise = torch.ones(batch, vocab_size, device=device)
        self.penalty, self.temperature, self.top_p = (torch.ones(batch, 1, device=device) for _ in range(3))
        self.top_k = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.greedy, self.nucleus = (torch.zeros(batch, 1, dtype=torch.bool, device=device) for _ in range(2))
        self.drawing = []  # the rows that draw (temperature above 0)

    def set(self, settings, prompt):
        """settings: one dict of knobs a row; prompt: the tokens every row begins with."""
        knobs = [dict(temperature=1.0, top_k=0, top_p=1.0, penalty=1.0) | s for s in settings]
        for name in ("penalty", "temperature", "top_p", "top_k"):
            getattr(self, name).copy_(torch.tensor([[k[name]] for k in knobs]))
        self.greedy.copy_(torch.tensor([[k["temperature"] == 0] for k in knobs]))
        self.nucleus.copy_(torch.tensor([[k["top_p"] < 1.0] for k in knobs]))
        self.temperature.masked_fill_(self.greedy, 1.0)  # a greedy row divides by nothing
        self.seen.zero_()
        self.seen[:, prompt] = True
        self.drawing = [i for i, k in enumerate(knobs) if k["temperature"] != 0]

    def draw(self, generators):
        """Each drawing row's Exp(1) for every vocabulary entry, from its generator, as multinomial draws them."""
        for i in self.drawing:
            self.noise[i:i + 1].exponential_(1, generator=generators[i])

    def tensors(self):
        return [self.seen, self.penalty, self.temperature, self.greedy, self.top_k, self.top_p, self.nucleus,
                self.noise]


def penalized(logits, seen, penalty):
    """sampling.penalized on a mask of the tokens seen: a positive score divided by the penalty, a negative
    one multiplied, and a row that overflows to infinity penalized in float64, shifted by its top score."""
    def push_down(scores, by):
        return torch.where(seen, torch.where(scores > 0, scores / by, scores * by), scores)
    out = push_down(logits, penalty)
    wide = push_down(logits.double(), penalty.double())
    # isinf().any() as the row's largest magnitude, a reduction inductor vectorizes: the same rows wherever the
    # scores are finite (a finite score pushed down is never NaN), and a row that is not is marked -1 anyway
    overflows = out.abs().amax(-1, keepdim=True) == float("inf")
    return torch.where(overflows, (wide - wide.amax(-1, keepdim=True)).to(out.dtype), out)


class GraphPick(nn.Module):
    """The next token of every row from its scores, its knobs and its noise, sampling.pick's steps in its
    order: the penalty, then (stages) temperature, top-k, top-p and the draw; greedy rows take the argmax."""

    def __init__(self, stages):
        super().__init__()
        assert list(stages) == [s for s in STAGES if s in stages], stages
        assert "temperature" in stages or not {"top_k", "top_p"} & set(stages), "top-k and top-p come with a draw"
        self.stages = tuple(stages)

    def forward(self, logits, token, seen, penalty, temperature, greedy, top_k, top_p, nucleus, noise):
        finite = logits.abs().amax(-1, keepdim=True).isfinite()  # model.check_finite's test, a row at a time
        logits = logits.float()
        if "penalty" in self.stages:
            seen.scatter_(1, token, True)  # the token fed is in the history from now on
            logits = penalized(logits, seen, penalty)
        best = logits.argmax(-1, keepdim=True)
        if "temperature" in self.stages:
            best = torch.where(greedy, best, self.drawn(logits, temperature, top_k, top_p, nucleus, noise))
        return torch.where(finite, best, -1)

    def drawn(self, logits, temperature, top_k, top_p, nucleus, noise):
        scaled = logits / temperature
        overflows = scaled.amax(-1, keepdim=True).isinf()
        logits = torch.where(overflows, (logits - logits.amax(-1, keepdim=True)) / temperature, scaled)
        vocab = logits.shape[-1]
        if "top_k" in self.stages:
            ranked = logits.sort(dim=-1, descending=True).values
            kth = ranked.gather(-1, (top_k - 1).clamp(0, vocab - 1))
            logits = torch.where((top_k > 0) & (top_k < vocab) & (logits < kth), float("-inf"), logits)
        if "top_p" in self.stages:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs >= top_p
            drop[:, 0] = False
            kept = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
            logits = torch.where(nucleus, kept, logits)
        return (logits.softmax(-1) / noise).argmax(-1, keepdim=True)
