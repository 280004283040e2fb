"""Hand the trained model to the engines people serve with: a Hugging Face folder, a GGUF, a CTranslate2 model.

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
a quarter of each head. config.json carries both.

    python export.py [CHECKPOINT] [OUT_DIR] --tokenizer tokenizer.json [--force]

writes OUT_DIR (default holmes-hf/) with config.json, model.safetensors and a
fast tokenizer, then loads it back through transformers and checks logits,
token ids and greedy generation against this repo; it exits 1 if any differ.

    python export.py --gguf holmes.gguf [--gguf-type f32|f16|q8_0]
    python export.py --ct2 holmes-ct2

write a GGUF for llama.cpp (with the gguf package, llama.cpp's own writer) and
a CTranslate2 model (through ctranslate2's converter classes) from the same
proven folder, then run each engine greedily and report where it parts from
cached.py (serve.py; pip install -r requirements-serve.txt). OUT_DIR is
written too when given. --force replaces a previous export only.

    python export.py --break layout     # without the RoPE permutation
    python export.py --break rotary     # as transformers 4 reads a folder without rotary_pct

build the broken folder in a temporary directory, report how far the logits
move and where greedy text parts, and keep nothing.
"""
import errno
import json
import os
import shutil
import tempfile

# before torch: cli.startup_failure makes a failing import one line
from cli import Parser, appeared, atomic_write, check_output, place, run_cli, shown, write_failure

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging

from cached import first_difference, load_pair
import serve

SAMPLE = ("To Sherlock Holmes she is always the woman. \"You have been in Afghanistan, I perceive,\" "
          "said he. It's a capital mistake to theorize before one has data.\n\n    Café, naïve, 1895!")
PROMPT = "The night was"  # cached.py's default
HF_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"}  # what an export writes, so all --force may replace
BROKEN = {
    "layout": "--break layout: q and k rows left in Part 3's interleaved order, which GPT-NeoX reads as halves",
    "rotary": "--break rotary: no rotary_pct, read as transformers 4 reads it (0.25: a quarter of each head rotates)",
}


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
            raise ValueError(f"tokens {ids[tokens[-1]]} and {i} are the same bytes {token_bytes!r}; "
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


def write_folder(model, bpe, path, fix_layout=True, rotary_pct=1.0):
    hf = GPTNeoXForCausalLM(neox_config(model.cfg, rotary_pct))
    weights = neox_state_dict(model, fix_layout)
    if "embed_out.weight" in hf.state_dict():  # transformers 4's name for the output matrix
        weights["embed_out.weight"] = weights.pop("lm_head.weight")
    hf.load_state_dict(weights, strict=True)
    hf.save_pretrained(path)
    fast_tokenizer(bpe).save_pretrained(path)
    # transformers 5 names its class TokenizersBackend, which 4 does not know; both know this one
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f) | {"tokenizer_class": "PreTrainedTokenizerFast"}
    with atomic_write(config_path, "w", force=True) as f:
        json.dump(config, f, indent=2)


def load_folder(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def read_folder(path):
    """load_folder, where whatever transformers, safetensors or tokenizers raise on a damaged folder is one line."""
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its load report would print a table of missing weights before the error
    try:
        return load_folder(path)
    except Exception as e:  # the libraries' own kinds (SafetensorError, a tokenizers Exception, OSError, ...)
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ValueError(f"--check {shown(path)}: transformers cannot load it ({type(e).__name__}: {reason[:200]}); "
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


def inside(path, folder):
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath((path, folder)) == folder


def listing(names, shown=4):
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def not_an_export(path, export_files):
    """What in the folder `path` no export writes: the names --force must not remove."""
    return [n for n in sorted(os.listdir(path)) if n not in export_files or not os.path.isfile(os.path.join(path, n))]


def check_out_dir(path, force, export_files, inputs, flag):
    """Before any work: `path` can be written, and --force replaces only a previous export there.

    A previous export holds nothing but the files an export writes (export_files); a folder with
    anything else, the working folder or one holding it, or one holding this export's own inputs,
    is refused whatever the flags. A link counts as existing (it is replaced, never written through)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"{shown(path)} exists and is not a folder; give another {flag}")
    if inside(os.getcwd(), path):
        raise ValueError(f"{flag} {shown(path)} is the working folder or holds it, which an export never "
                         "replaces; give a new folder's name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"cannot write {shown(path)}: the folder {shown(parent)} does not exist")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=parent))
    except OSError as e:
        raise OSError(f"cannot write {shown(path)}: the folder {shown(parent)} is not writable ({e.strerror})") \
            from None
    if not os.path.lexists(path):
        return
    if (os.listdir(path) or os.path.islink(path)) and not force:
        raise ValueError(f"{shown(path)} exists and is not empty; pass --force to replace a previous export there")
    others = not_an_export(path, export_files)
    if others:
        raise ValueError(f"--force replaces only a previous export, and {shown(path)} also holds "
                         f"{listing(others)}, which it would remove; give another {flag}")
    used = [p for p in inputs if inside(p, path)]
    if used:
        raise ValueError(f"{shown(path)} holds {shown(used[0])}, which this export reads; give another {flag}")


def check_apart(outputs, folders):
    """No output inside an output folder: moving the folder into place would remove it."""
    for folder in folders:
        held = [p for p in outputs if p != folder and inside(p, folder)]
        if held:
            raise ValueError(f"{shown(held[0])} is inside {shown(folder)}, which the export replaces whole; "
                             "give outputs that do not nest")


def put_in_place(built, path, force, export_files):
    """Move a finished file or folder into place, judging what stands there at that moment.

    Without force nothing is replaced (a folder is renamed onto nothing or an empty folder only).
    With force, a folder is swapped with the previous export: the old one is moved aside, checked
    again, and removed; on any failure it goes back, and no .old-* folder is left."""
    umask = os.umask(0)
    os.umask(umask)
    # temporary folders and safetensors files are private; the export is not
    for name in os.listdir(built) if os.path.isdir(built) else []:
        os.chmod(os.path.join(built, name), 0o666 & ~umask)
    os.chmod(built, (0o777 if os.path.isdir(built) else 0o666) & ~umask)
    if not os.path.isdir(built):
        place(built, path, force)
        return
    if not force:
        try:
            os.rename(built, path)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise
            raise FileExistsError(appeared(path)) from None
        return
    old = tempfile.mkdtemp(prefix=".old-", dir=os.path.dirname(os.path.abspath(path)))
    aside = os.path.join(old, "out")
    try:
        try:
            if os.path.lexists(path):
                os.rename(path, aside)
            if os.path.lexists(aside) and not os.path.isdir(aside):
                raise ValueError(f"{shown(path)} is no longer a folder; it is left as it was and nothing was "
                                 "written there")
            others = not_an_export(aside, export_files) if os.path.lexists(aside) else []
            if others:
                raise ValueError(f"{shown(path)} now holds {listing(others)}, which --force would remove; "
                                 "it is left as it was and nothing was written there")
            os.rename(built, path)
        except BaseException:
            if os.path.lexists(aside):
                os.rename(aside, path)
            raise
    finally:
        shutil.rmtree(old)


def report(diff, same_ids, theirs, ours):
    parted = first_difference(theirs, ours)
    print(f"logits, 2 x 200 random tokens: largest difference from model.py {diff:.2e} (must be below 1e-4)")
    print(f"tokenizer: ids {'equal' if same_ids else 'DIFFER from'} bpe.py's on the sample text")
    print(f"greedy generate through transformers' KV cache, {len(ours)} tokens: "
          + ("the same tokens as cached.py" if parted is None else f"parts from cached.py after {parted} tokens"))
    return diff < 1e-4 and same_ids and parted is None


def export_gguf(model, bpe, path, kind):
    """Write the GGUF with llama.cpp's own writer; run it through llama.cpp when that is installed."""
    serve.write_gguf(path, model.cfg, neox_state_dict(model), *spelled_vocabulary(bpe), kind)
    print(f"GGUF, {kind}: GPT-NeoX, GPT-2-style BPE with GPT-2's split, {os.path.getsize(path) / 2**20:.1f} MiB, "
          f"nothing prepended, stop id {serve.STOP_ID} (byte 0xFF, in no UTF-8 text)")
    try:
        serve.engine("llama_cpp")
    except ValueError as e:
        print(f"llama.cpp: not run here ({e})")
        return
    prompt = bpe.encode(PROMPT)
    [(ids, _)] = run_engine("llama.cpp", serve.llama_tokenize, path, [SAMPLE])
    [theirs], _ = run_engine("llama.cpp", serve.llama_greedy, path, prompt, 1, 100, torch.get_num_threads())
    engine_report("llama.cpp", ids == bpe.encode(SAMPLE), theirs, cached_tokens(model, prompt, 100))


def export_ct2(model, bpe, hf, tokenizer, path):
    """Write the CTranslate2 model through ctranslate2's converter classes; load it back and run it."""
    serve.write_ct2(hf, tokenizer, path)
    prompt = bpe.encode(PROMPT)
    [theirs], _ = run_engine("CTranslate2", serve.ct2_greedy, path, tokenizer.convert_ids_to_tokens(prompt), 1, 100,
                             torch.get_num_threads())
    engine_report("CTranslate2, float32", None, theirs, cached_tokens(model, prompt, 100))


def run_engine(name, fn, *args):
    """An engine's self-check in a process of its own: a native crash there stops the export, in one line."""
    try:
        return serve.isolated(name, fn, *args)
    except ChildProcessError as e:
        raise ChildProcessError(f"{e}; nothing written") from None


def cached_tokens(model, prompt, n_tokens):
    return model.generate_cached(torch.tensor([prompt]), n_tokens)[0, len(prompt):].tolist()


def engine_report(name, same_ids, theirs, ours):
    """Print what an engine gave; its tokenizer must agree, its greedy tokens are reported (its GELU may differ)."""
    if same_ids is not None:
        print(f"{name}: tokenizer ids {'equal' if same_ids else 'DIFFER from'} bpe.py's on the sample text")
    parted = first_difference(theirs, ours)
    print(f"{name}: {len(ours)} greedy tokens from {PROMPT!r}: "
          + ("the same tokens as cached.py" if parted is None else f"parts from cached.py after {parted} tokens"))
    if same_ids is False:
        raise ValueError(f"{name} tokenizes differently from bpe.py; nothing written")


def work_folder(beside, works):
    """A new, unique temporary folder beside an output (so the result moves in by a rename), or in /tmp."""
    parent = os.path.dirname(os.path.abspath(beside)) if beside else tempfile.gettempdir()
    works.append(tempfile.mkdtemp(prefix=".export-", dir=parent))
    return works[-1]


def check_folder(args):
    """--check: an existing Hugging Face folder, read by whichever transformers is installed (4 or 5)."""
    if args.broken or args.gguf or args.ct2 or args.out_dir:
        raise ValueError("--check reads a folder and writes nothing; give it with CHECKPOINT and --tokenizer only")
    if not os.path.isdir(args.check) or not os.path.exists(os.path.join(args.check, "config.json")):
        raise ValueError(f"--check {shown(args.check)}: not a folder with a config.json; give an exported folder")
    model, bpe = load_pair(args.checkpoint, args.tokenizer)
    hf, hf_tokenizer = read_folder(args.check)
    print(f"{shown(args.check)} loaded through transformers {transformers.__version__}:")
    same = report(*compare(model, bpe, hf, hf_tokenizer))
    differences = folder_differences(model, bpe, args.check, hf, hf_tokenizer)
    print("config, every weight and the whole tokenizer: " + ("exactly the export's" if not differences else
                                                               "; ".join(differences)))
    if not same or differences:
        raise ValueError(f"{shown(args.check)} does not reproduce {shown(args.checkpoint)}")


def main():
    logging.disable_progress_bar()  # seconds of work; their bars would bury the report
    ap = Parser(description="Export a Part 3 checkpoint for the serving engines: a Hugging Face GPT-NeoX folder, "
                            "a GGUF, a CTranslate2 model; each proven against this repo.")
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("out_dir", nargs="?", help="the Hugging Face folder (default holmes-hf, unless --gguf/--ct2)")
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--gguf", metavar="FILE", help=f"write a GGUF for llama.cpp ({serve.REQUIREMENTS})")
    ap.add_argument("--gguf-type", default="f32", choices=serve.GGUF_TYPES)
    ap.add_argument("--ct2", metavar="DIR", help=f"write a CTranslate2 model directory ({serve.REQUIREMENTS})")
    ap.add_argument("--force", action="store_true", help="replace a previous export (never anything else)")
    ap.add_argument("--break", dest="broken", metavar="layout|rotary", help="show a gotcha; writes nothing")
    ap.add_argument("--check", metavar="DIR", help="load an exported folder through the installed transformers "
                                                   "and compare it with this repo; writes nothing")
    args = ap.parse_args()
    if args.check is not None:
        check_folder(args)
        return
    if args.broken not in (None, "layout", "rotary"):
        raise ValueError(f"--break must be 'layout' or 'rotary', got {args.broken!r}")
    if args.broken and (args.gguf or args.ct2):
        raise ValueError("--break writes nothing; drop --gguf and --ct2")
    out_dir = args.out_dir or (None if args.gguf or args.ct2 else "holmes-hf")
    outputs = [p for p in (out_dir, args.gguf, args.ct2) if p]
    if not args.broken:
        if len({os.path.abspath(p) for p in outputs}) < len(outputs):
            raise ValueError("OUT_DIR, --gguf and --ct2 name the same path; give each its own")
        check_apart(outputs, [p for p in (out_dir, args.ct2) if p])
        inputs = [p for p in (args.checkpoint, args.tokenizer) if os.path.exists(p)]
        if out_dir:
            check_out_dir(out_dir, args.force, HF_FILES, inputs, "OUT_DIR")
        if args.ct2:
            check_out_dir(args.ct2, args.force, serve.CT2_FILES, inputs, "--ct2 DIR")
        if args.gguf:
            check_output(args.gguf, args.force, inputs=inputs)
    for wanted, module in ((args.gguf, "gguf"), (args.ct2, "ctranslate2")):
        if wanted:
            serve.engine(module)
    model, bpe = load_pair(args.checkpoint, args.tokenizer)
    works = []
    try:
        built = {}
        folder = os.path.join(work_folder(None if args.broken else outputs[0], works), "hf")
        write_folder(model, bpe, folder, fix_layout=args.broken != "layout",
                     rotary_pct=0.25 if args.broken == "rotary" else 1.0)
        print(BROKEN.get(args.broken, f"{args.checkpoint} as GPTNeoXForCausalLM, {args.tokenizer} as a fast "
                                      f"tokenizer, loaded back through transformers {transformers.__version__}:"))
        hf, tokenizer = load_folder(folder)
        exact = report(*compare(model, bpe, hf, tokenizer))
        if args.broken:
            return
        if not exact:
            raise ValueError(f"the exported folder does not reproduce {args.checkpoint}; nothing written")
        if args.gguf:
            built[args.gguf] = os.path.join(work_folder(args.gguf, works), "model.gguf")
            export_gguf(model, bpe, built[args.gguf], args.gguf_type)
        if args.ct2:
            built[args.ct2] = os.path.join(work_folder(args.ct2, works), "ct2")
            export_ct2(model, bpe, hf, tokenizer, built[args.ct2])
        if out_dir:
            built[out_dir] = folder
        for path, result in built.items():
            put_in_place(result, path, args.force, serve.CT2_FILES if path == args.ct2 else HF_FILES)
            print(f"wrote {path}")
    except Exception as e:
        if write_failure(e) is None:
            raise
        raise OSError(f"cannot write {listing([shown(p) for p in outputs])}: {write_failure(e)}; "
                      "nothing was written there") from None
    finally:
        for work in works:
            shutil.rmtree(work)


if __name__ == "__main__":
    run_cli(main)
