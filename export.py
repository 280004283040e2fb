"""Hand the trained model to the engines people serve with: a Hugging Face folder, proven exact.

No serving engine knows this model by name, but GPT-NeoX in `transformers` has
its shape (pre-norm LayerNorm blocks, exact-GELU MLP, rotary attention on the
whole head, a sequential residual with use_parallel_residual=False), so the
weights map onto it one to one: zero biases where Part 3 has none, the tied
head written out as the output matrix, GQA key and value heads repeated.

The trap is RoPE's layout. Part 3 rotates interleaved channel pairs (2j, 2j+1);
GPT-NeoX rotates halves (j, j + head_dim/2). Weights copied as they are load
without a warning and give another model. Giving each head's q and k rows the
same permutation (evens first, then odds) fixes it: attention scores are dot
products, unchanged when q and k are permuted alike.

    python export.py [CHECKPOINT] [OUT_DIR] --tokenizer tokenizer.json [--force]

writes OUT_DIR (default holmes-hf/) with config.json, model.safetensors and a
fast tokenizer, then loads it back through transformers and checks logits,
token ids and greedy generation against this repo; it exits 1 if any differ.

    python export.py --break layout

builds the folder without the permutation in a temporary directory, reports
how far the logits move and where greedy text parts, and keeps nothing.
"""
import os
import shutil
import tempfile

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging

from cached import first_difference, load_pair
from cli import Parser, run_cli

SAMPLE = ("To Sherlock Holmes she is always the woman. \"You have been in Afghanistan, I perceive,\" "
          "said he. It's a capital mistake to theorize before one has data.\n\n    Café, naïve, 1895!")


def rope_layout(head_dim):
    """The row order that turns interleaved pairs (2j, 2j+1) into halves (j, j + head_dim/2)."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def neox_state_dict(model, fix_layout=True):
    """Part 3's weights under GPT-NeoX's names and layout."""
    cfg, sd = model.cfg, model.state_dict()
    d, H, hd = cfg.d_model, cfg.n_heads, cfg.head_dim
    order = rope_layout(hd) if fix_layout else torch.arange(hd)
    out = {"gpt_neox.embed_in.weight": sd["emb.weight"], "gpt_neox.final_layer_norm.weight": sd["norm.weight"],
           "gpt_neox.final_layer_norm.bias": sd["norm.bias"], "lm_head.weight": sd["head.weight"].clone()}
    for i in range(cfg.n_layers):
        p, n = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        q, k, v = sd[p + "attn.qkv.weight"].split([d, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd])
        q = q.view(H, hd, d)[:, order]
        k, v = (t.view(cfg.n_kv_heads, hd, d).repeat_interleave(H // cfg.n_kv_heads, dim=0) for t in (k, v))
        out |= {
            n + "input_layernorm.weight": sd[p + "norm1.weight"], n + "input_layernorm.bias": sd[p + "norm1.bias"],
            n + "post_attention_layernorm.weight": sd[p + "norm2.weight"],
            n + "post_attention_layernorm.bias": sd[p + "norm2.bias"],
            # GPT-NeoX's fused projection is per head: q, k, v of head 0, then of head 1, ...
            n + "attention.query_key_value.weight": torch.cat((q, k[:, order], v), dim=1).reshape(3 * d, d),
            n + "attention.query_key_value.bias": torch.zeros(3 * d),
            n + "attention.dense.weight": sd[p + "attn.out.weight"], n + "attention.dense.bias": torch.zeros(d),
            n + "mlp.dense_h_to_4h.weight": sd[p + "mlp.0.weight"], n + "mlp.dense_h_to_4h.bias": sd[p + "mlp.0.bias"],
            n + "mlp.dense_4h_to_h.weight": sd[p + "mlp.2.weight"], n + "mlp.dense_4h_to_h.bias": sd[p + "mlp.2.bias"],
        }
    return {name: t.contiguous() for name, t in out.items()}


def byte_alphabet():
    """GPT-2's printable stand-in for each byte, the alphabet byte-level BPE files are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins, extra = {}, 0
    for b in range(256):
        if b in printable:
            stand_ins[b] = chr(b)
        else:
            stand_ins[b] = chr(256 + extra)
            extra += 1
    return stand_ins


def fast_tokenizer(bpe):
    """Part 1's BPE as a tokenizers BPE model: same merges in the same ranks, same split, same bytes."""
    alphabet = byte_alphabet()

    def spelled(token_bytes):
        return "".join(alphabet[b] for b in token_bytes)
    vocab = {}
    for i, token_bytes in enumerate(bpe.vocab):
        if vocab.setdefault(spelled(token_bytes), i) != i:
            raise ValueError(f"tokens {vocab[spelled(token_bytes)]} and {i} are the same bytes {token_bytes!r}; "
                             "a Hugging Face vocabulary cannot hold both")
    merges = [(spelled(bpe.vocab[a]), spelled(bpe.vocab[b])) for a, b in bpe.merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's split: Part 1's
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def write_folder(model, bpe, path, fix_layout=True):
    cfg = model.cfg
    neox = GPTNeoXConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=4 * cfg.d_model, hidden_act="gelu",
        rotary_pct=1.0, rotary_emb_base=10000, max_position_embeddings=cfg.context, layer_norm_eps=1e-5,
        use_parallel_residual=False, tie_word_embeddings=False, attention_dropout=0.0, hidden_dropout=0.0,
        bos_token_id=None, eos_token_id=None,
    )
    hf = GPTNeoXForCausalLM(neox)
    hf.load_state_dict(neox_state_dict(model, fix_layout), strict=True)
    hf.save_pretrained(path)
    fast_tokenizer(bpe).save_pretrained(path)


def load_folder(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def compare(model, bpe, hf, hf_tokenizer, n_tokens=100):
    """(largest logit difference on 2 random sequences, tokenizer ids equal, greedy tokens, cached.py's tokens)."""
    length = min(200, model.cfg.context)
    idx = torch.randint(model.cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    diff = (hf(idx).logits - model(idx)[0]).abs().max().item()
    same_ids = hf_tokenizer(SAMPLE)["input_ids"] == bpe.encode(SAMPLE)
    prompt = torch.tensor([bpe.encode("The night was")])
    n_tokens = min(n_tokens, model.cfg.context - prompt.shape[1])
    theirs = hf.generate(prompt, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False,
                         pad_token_id=0)[0, prompt.shape[1]:].tolist()
    ours = model.generate_cached(prompt, n_tokens)[0, prompt.shape[1]:].tolist()
    return diff, same_ids, theirs, ours


def check_out_dir(path, force):
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} exists and is not a folder; give another OUT_DIR")
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise ValueError(f"{path} exists and is not empty; pass --force to replace it whole")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"cannot write {path}: the folder {parent} does not exist")


def replace_folder(built, path):
    """Move the finished folder into place; an old one is replaced whole, never mixed."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(built):  # temporary folders and safetensors files are private; this one is not
        os.chmod(os.path.join(built, name), 0o666 & ~umask)
    os.chmod(built, 0o777 & ~umask)
    old = None
    if os.path.exists(path):
        old = tempfile.mkdtemp(prefix=".old-", dir=os.path.dirname(os.path.abspath(path)))
        os.rename(path, os.path.join(old, "out"))
    os.rename(built, path)
    if old:
        shutil.rmtree(old)


def report(diff, same_ids, theirs, ours):
    parted = first_difference(theirs, ours)
    print(f"logits, 2 x 200 random tokens: largest difference from model.py {diff:.2e} (must be below 1e-4)")
    print(f"tokenizer: ids {'equal' if same_ids else 'DIFFER from'} bpe.py's on the sample text")
    print(f"greedy generate through transformers' KV cache, {len(ours)} tokens: "
          + ("the same tokens as cached.py" if parted is None else f"parts from cached.py after {parted} tokens"))
    return diff < 1e-4 and same_ids and parted is None


def main():
    logging.disable_progress_bar()  # seconds of work; their bars would bury the report
    ap = Parser(description="Export a Part 3 checkpoint as a Hugging Face GPT-NeoX folder, and prove it exact.")
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("out_dir", nargs="?", default="holmes-hf")
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR whole")
    ap.add_argument("--break", dest="broken", metavar="layout", help="export without the RoPE permutation")
    args = ap.parse_args()
    if args.broken not in (None, "layout"):
        raise ValueError(f"--break must be 'layout', got {args.broken!r}")
    if args.broken is None:
        check_out_dir(args.out_dir, args.force)
    model, bpe = load_pair(args.checkpoint, args.tokenizer)
    parent = tempfile.gettempdir() if args.broken else os.path.dirname(os.path.abspath(args.out_dir))
    built = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        write_folder(model, bpe, built, fix_layout=args.broken is None)
        if args.broken:
            print("--break layout: q and k rows left in Part 3's interleaved order, which GPT-NeoX reads as halves")
        else:
            print(f"{args.checkpoint} as GPTNeoXForCausalLM, {args.tokenizer} as a fast tokenizer, "
                  "loaded back through transformers:")
        exact = report(*compare(model, bpe, *load_folder(built)))
        if args.broken:
            return
        if not exact:
            raise ValueError(f"the exported folder does not reproduce {args.checkpoint}; {args.out_dir} not written")
        replace_folder(built, args.out_dir)
        print(f"wrote {args.out_dir}/")
    finally:
        if os.path.exists(built):
            shutil.rmtree(built)


if __name__ == "__main__":
    run_cli(main)
