"""The model as a Hugging Face GPT-NeoX folder, its BPE as a fast tokenizer, and the proof they are the same model.

No serving engine knows this model by name, but GPT-NeoX has its shape
(pre-norm LayerNorm blocks, exact-GELU MLP, rotary attention on the whole head,
a sequential residual with use_parallel_residual=False), so the weights map
onto it one to one: zero biases where Part 3 has none, the tied head written
out as the output matrix, GQA key and value heads repeated.

The trap is RoPE's layout. Part 3 rotates interleaved channel pairs (2j, 2j+1);
GPT-NeoX rotates halves (j, j + head_dim/2). Weights copied as they are load
without a warning and give another model. Giving each head's q and k rows the
same permutation (evens first, then odds) fixes it: attention scores are dot
products, unchanged when q and k are permuted alike. One level up waits the
same trap: transformers 5 writes the rotary fraction as rope_parameters, and
transformers 4 (and the engines' converters), not finding rotary_pct, rotate
a quarter of each head. config.json carries both. export.py is the command.
"""
import copy
import json
import os

from engines.edge.files import atomic_write, shown
from engines.edge.errors import BadValue

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging



SAMPLE = ("To Sherlock Holmes she is always the woman. \"You have been in Afghanistan, I perceive,\" "
          "said he. It's a capital mistake to theorize before one has data.\n\n    Café, naïve, 1895!")


PROMPT = "The night was"  # cached.py's default


HF_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"}  # what an export writes, so all --force may replace


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


def spelled_vocabulary(bpe):
    """Part 1's tokens and merges in GPT-2's byte alphabet, as byte-level BPE files (and GGUF) write them."""
    alphabet = byte_alphabet()
    tokens, ids = [], {}
    for i, token_bytes in enumerate(bpe.vocab):
        tokens.append("".join(alphabet[b] for b in token_bytes))
        if ids.setdefault(tokens[-1], i) != i:
            raise BadValue(f"tokens {ids[tokens[-1]]} and {i} are the same bytes {token_bytes!r}; "
                             "a Hugging Face vocabulary cannot hold both")
    return tokens, [(tokens[a], tokens[b]) for a, b in bpe.merges]


def fast_tokenizer(bpe):
    """Part 1's BPE as a tokenizers BPE model: same merges in the same ranks, same split, same bytes."""
    tokens, merges = spelled_vocabulary(bpe)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's split: Part 1's
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def neox_config(cfg, rotary_pct=1.0):
    neox = GPTNeoXConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=4 * cfg.d_model, hidden_act="gelu",
        rotary_pct=rotary_pct, rotary_emb_base=10000, max_position_embeddings=cfg.context, layer_norm_eps=1e-5,
        use_parallel_residual=False, tie_word_embeddings=False, attention_dropout=0.0, hidden_dropout=0.0,
        bos_token_id=None, eos_token_id=None,
    )
    # transformers 5 writes the rotary fraction into rope_parameters only; transformers 4 (and the
    # engines' converters) read rotary_pct, and without it take 0.25: 16 of 64 channels rotate.
    neox.rotary_pct, neox.rotary_emb_base = rotary_pct, 10000
    return neox


# the config.json fields that change what the model computes, as any reader (transformers 4 or 5, an engine) reads them
SHAPING_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "hidden_act", "rotary_pct", "rotary_emb_base", "rope_parameters", "rope_theta",
                  "max_position_embeddings", "layer_norm_eps", "use_parallel_residual", "tie_word_embeddings",
                  "attention_bias")


TOKENIZER_PARTS = ("normalizer", "pre_tokenizer", "model", "decoder")  # what turns text into ids and back


def folder_differences(model, bpe, path, hf, hf_tokenizer):
    """Every way the folder is not exactly this export: each config field that shapes the model, each
    weight (bit for bit), and the whole tokenizer (every token's id, every merge's rank)."""
    with open(os.path.join(path, "config.json")) as f:
        written = json.load(f)
    expected = neox_config(model.cfg).to_dict()
    found = [f"config.json: {key} is {written.get(key)!r}, not {expected[key]!r}"
             for key in SHAPING_FIELDS if key in expected and written.get(key) != expected[key]]
    weights, loaded = neox_state_dict(model), hf.state_dict()
    if "embed_out.weight" in loaded:  # transformers 4's name for the output matrix
        weights["embed_out.weight"] = weights.pop("lm_head.weight")
    found += [f"model.safetensors: {name} differs from the checkpoint's" for name, tensor in weights.items()
              if name not in loaded or not torch.equal(loaded[name], tensor)]
    theirs = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    ours = json.loads(fast_tokenizer(bpe).backend_tokenizer.to_str())
    found += [f"tokenizer.json: its {part} differs from the tokenizer's" for part in TOKENIZER_PARTS
              if theirs.get(part) != ours.get(part)]
    return found


def write_folder(model, bpe, path, fix_layout=True, rotary_pct=1.0, dtype=torch.float32):
    """The folder, its weights stored as dtype (float32; bfloat16 or float16 for engines whose fast paths
    take no float32, vLLM's)."""
    hf = GPTNeoXForCausalLM(neox_config(model.cfg, rotary_pct))
    weights = neox_state_dict(model, fix_layout)
    if "embed_out.weight" in hf.state_dict():  # transformers 4's name for the output matrix
        weights["embed_out.weight"] = weights.pop("lm_head.weight")
    hf.load_state_dict(weights, strict=True)
    hf.to(dtype).save_pretrained(path)
    fast_tokenizer(bpe).save_pretrained(path)
    # transformers 5 names its class TokenizersBackend, which 4 does not know; both know this one
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f) | {"tokenizer_class": "PreTrainedTokenizerFast"}
    with atomic_write(config_path, "w", force=True) as f:
        json.dump(config, f, indent=2)


def load_folder(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def stored_dtype(path):
    """The dtype a folder's config.json says its weights are stored in (transformers 5: dtype, 4: torch_dtype)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")


def rounded_to(model, dtype):
    """The model with each weight rounded to dtype and widened back: what a folder stored in dtype holds, read as
    float32. A float32 model is returned as it is."""
    return model if dtype == torch.float32 else copy.deepcopy(model).to(dtype).float()


def read_folder(path):
    """load_folder, where whatever transformers, safetensors or tokenizers raise on a damaged folder is one line."""
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its load report would print a table of missing weights before the error
    try:
        return load_folder(path)
    except Exception as e:  # the libraries' own kinds (SafetensorError, a tokenizers Exception, OSError, ...)
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise BadValue(f"--check {shown(path)}: transformers cannot load it ({type(e).__name__}: {reason[:200]}); "
                         "export it again") from None
    finally:
        logging.set_verbosity(verbosity)


@torch.no_grad()
def compare(model, bpe, hf, hf_tokenizer, n_tokens=100):
    """(largest logit difference on 2 random sequences, tokenizer ids equal, greedy tokens, cached.py's tokens)."""
    length = min(200, model.cfg.context)
    idx = torch.randint(model.cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    diff = (hf(idx).logits - model(idx)[0]).abs().max().item()
    same_ids = hf_tokenizer(SAMPLE)["input_ids"] == bpe.encode(SAMPLE)
    prompt = torch.tensor([bpe.encode(PROMPT)])
    n_tokens = min(n_tokens, model.cfg.context - prompt.shape[1])
    theirs = hf.generate(prompt, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False,
                         pad_token_id=0)[0, prompt.shape[1]:].tolist()
    ours = model.generate_cached(prompt, n_tokens)[0, prompt.shape[1]:].tolist()
    return diff, same_ids, theirs, ours
