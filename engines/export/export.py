"""export.py's command: the checks before the work, the export proven, and each output put in place safely.

The formats are engines/export/hf_folder.py's (and engines/export/peers.py's for GGUF and
CTranslate2); this file holds what makes the command safe to run: every
output checked before the work, --force replacing only a previous export,
each result renamed into place, and every engine's self-check in a process
of its own.
"""
import errno
import os
import shutil
import tempfile

from engines.edge.cli import Parser
from engines.edge.files import appeared, check_input_folder, check_output, place, shown, starts_with
from engines.edge.errors import Appeared, BadInput, BadValue, EngineFailed

import torch
import transformers

from cached import first_difference
from engines.edge.checkpoint import load_pair
from engines.export import peers
from engines.export.hf_folder import (HF_FILES, PROMPT, SAMPLE, compare, folder_differences, load_folder, logging,
                               neox_state_dict, read_folder, rounded_to, spelled_vocabulary, stored_dtype,
                               write_folder)


FOLDER_DTYPES = ("float32", "bfloat16", "float16")
GGUF = starts_with(b"GGUF")  # every GGUF begins with its magic: --force replaces only such a file
BROKEN = {
    "layout": "--break layout: q and k rows left in Part 3's interleaved order, which GPT-NeoX reads as halves",
    "rotary": "--break rotary: no rotary_pct, read as transformers 4 reads it (0.25: a quarter of each head rotates)",
}


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
        raise BadValue(f"{shown(path)} exists and is not a folder; give another {flag}")
    if inside(os.getcwd(), path):
        raise BadValue(f"{flag} {shown(path)} is the working folder or holds it, which an export never "
                         "replaces; give a new folder's name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise BadValue(f"cannot write {shown(path)}: the folder {shown(parent)} does not exist")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=parent))
    except OSError as e:
        raise BadInput(f"cannot write {shown(path)}: the folder {shown(parent)} is not writable ({e.strerror})") \
            from None
    if not os.path.lexists(path):
        return
    if (os.listdir(path) or os.path.islink(path)) and not force:
        raise BadValue(f"{shown(path)} exists and is not empty; pass --force to replace a previous export there")
    others = not_an_export(path, export_files)
    if others:
        raise BadValue(f"--force replaces only a previous export, and {shown(path)} also holds "
                         f"{listing(others)}, which it would remove; give another {flag}")
    used = [p for p in inputs if inside(p, path)]
    if used:
        raise BadValue(f"{shown(path)} holds {shown(used[0])}, which this export reads; give another {flag}")


def check_apart(outputs, folders):
    """No output inside an output folder: moving the folder into place would remove it."""
    for folder in folders:
        held = [p for p in outputs if p != folder and inside(p, folder)]
        if held:
            raise BadValue(f"{shown(held[0])} is inside {shown(folder)}, which the export replaces whole; "
                             "give outputs that do not nest")


WRITE_FAILURES = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def write_failure(error):
    """Why a write failed, where `error` says: a full disk, ulimit -f or a quota; else None. Writers
    in Rust or C++ (safetensors, ctranslate2) pass the system's reason on only as text."""
    if isinstance(error, OSError) and error.errno in WRITE_FAILURES:
        return error.strerror
    return next((os.strerror(code) for code in WRITE_FAILURES if os.strerror(code) in str(error)), None)


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
        place(built, path, force, GGUF)  # the one file an export writes
        return
    if not force:
        try:
            os.rename(built, path)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise
            raise Appeared(appeared(path)) from None
        return
    old = tempfile.mkdtemp(prefix=".old-", dir=os.path.dirname(os.path.abspath(path)))
    aside = os.path.join(old, "out")
    try:
        try:
            if os.path.lexists(path):
                os.rename(path, aside)
            if os.path.lexists(aside) and not os.path.isdir(aside):
                raise BadValue(f"{shown(path)} is no longer a folder; it is left as it was and nothing was "
                                 "written there")
            others = not_an_export(aside, export_files) if os.path.lexists(aside) else []
            if others:
                raise BadValue(f"{shown(path)} now holds {listing(others)}, which --force would remove; "
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
    peers.write_gguf(path, model.cfg, neox_state_dict(model), *spelled_vocabulary(bpe), kind)
    print(f"GGUF, {kind}: GPT-NeoX, GPT-2-style BPE with GPT-2's split, {os.path.getsize(path) / 2**20:.1f} MiB, "
          f"nothing prepended, stop id {peers.STOP_ID} (byte 0xFF, in no UTF-8 text)")
    try:
        peers.engine("llama_cpp")
    except ValueError as e:
        print(f"llama.cpp: not run here ({e})")
        return
    prompt = bpe.encode(PROMPT)
    [(ids, _)] = run_engine("llama.cpp", peers.llama_tokenize, path, [SAMPLE])
    [theirs], _ = run_engine("llama.cpp", peers.llama_greedy, path, prompt, 1, 100, torch.get_num_threads())
    engine_report("llama.cpp", ids == bpe.encode(SAMPLE), theirs, cached_tokens(model, prompt, 100))


def export_ct2(model, bpe, hf, tokenizer, path):
    """Write the CTranslate2 model through ctranslate2's converter classes; load it back and run it."""
    peers.write_ct2(hf, tokenizer, path)
    prompt = bpe.encode(PROMPT)
    [theirs], _ = run_engine("CTranslate2", peers.ct2_greedy, path, tokenizer.convert_ids_to_tokens(prompt), 1, 100,
                             torch.get_num_threads())
    engine_report("CTranslate2, float32", None, theirs, cached_tokens(model, prompt, 100))


def run_engine(name, fn, *args):
    """An engine's self-check in a process of its own: a native crash there stops the export, in one line."""
    try:
        return peers.isolated(name, fn, *args)
    except ChildProcessError as e:
        raise EngineFailed(f"{e}; nothing written") from None


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
        raise BadValue(f"{name} tokenizes differently from bpe.py; nothing written")


def work_folder(beside, works):
    """A new, unique temporary folder beside an output (so the result moves in by a rename), or in /tmp."""
    parent = os.path.dirname(os.path.abspath(beside)) if beside else tempfile.gettempdir()
    works.append(tempfile.mkdtemp(prefix=".export-", dir=parent))
    return works[-1]


def check_folder(args):
    """--check: an existing Hugging Face folder, read by whichever transformers is installed (4 or 5)."""
    if args.broken or args.gguf or args.ct2 or args.out_dir:
        raise BadValue("--check reads a folder and writes nothing; give it with CHECKPOINT and --tokenizer only")
    if not os.path.isdir(args.check) or not os.path.exists(os.path.join(args.check, "config.json")):
        raise BadValue(f"--check {shown(args.check)}: not a folder with a config.json; give an exported folder")
    check_input_folder(args.check, "exported file", 2**40)  # a FIFO there would block transformers for good
    model, bpe = load_pair(args.checkpoint, args.tokenizer)
    hf, hf_tokenizer = read_folder(args.check)
    dtype = stored_dtype(args.check)
    model = rounded_to(model, dtype)  # a bfloat16 or float16 folder holds the weights rounded
    print(f"{shown(args.check)} ({str(dtype).removeprefix('torch.')}) loaded through transformers "
          f"{transformers.__version__}:")
    same = report(*compare(model, bpe, hf, hf_tokenizer))
    differences = folder_differences(model, bpe, args.check, hf, hf_tokenizer)
    print("config, every weight and the whole tokenizer: " + ("exactly the export's" if not differences else
                                                               "; ".join(differences)))
    if not same or differences:
        raise BadValue(f"{shown(args.check)} does not reproduce {shown(args.checkpoint)}")


def main():
    logging.disable_progress_bar()  # seconds of work; their bars would bury the report
    ap = Parser(description="Export a Part 3 checkpoint for the serving engines: a Hugging Face GPT-NeoX folder, "
                            "a GGUF, a CTranslate2 model; each proven against this repo.")
    ap.add_argument("checkpoint", nargs="?", default="holmes.pt")
    ap.add_argument("out_dir", nargs="?", help="the Hugging Face folder (default holmes-hf, unless --gguf/--ct2)")
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--gguf", metavar="FILE", help=f"write a GGUF for llama.cpp ({peers.REQUIREMENTS})")
    ap.add_argument("--gguf-type", default="f32", choices=peers.GGUF_TYPES)
    ap.add_argument("--ct2", metavar="DIR", help=f"write a CTranslate2 model directory ({peers.REQUIREMENTS})")
    ap.add_argument("--dtype", default="float32", choices=FOLDER_DTYPES,
                    help="the Hugging Face folder's weights (vLLM's fast attention takes bfloat16 or float16); it "
                         "is proven against the checkpoint's weights rounded alike")
    ap.add_argument("--force", action="store_true", help="replace a previous export (never anything else)")
    ap.add_argument("--break", dest="broken", metavar="layout|rotary", help="show a gotcha; writes nothing")
    ap.add_argument("--check", metavar="DIR", help="load an exported folder through the installed transformers "
                                                   "and compare it with this repo; writes nothing")
    args = ap.parse_args()
    if args.check is not None:
        check_folder(args)
        return
    if args.broken not in (None, "layout", "rotary"):
        raise BadValue(f"--break must be 'layout' or 'rotary', got {args.broken!r}")
    if args.broken and (args.gguf or args.ct2):
        raise BadValue("--break writes nothing; drop --gguf and --ct2")
    if args.dtype != "float32" and (args.gguf or args.ct2):
        raise BadValue("--dtype is the Hugging Face folder's; a GGUF has --gguf-type, and CTranslate2 converts from "
                       "float32: export them without --dtype")
    out_dir = args.out_dir or (None if args.gguf or args.ct2 else "holmes-hf")
    outputs = [p for p in (out_dir, args.gguf, args.ct2) if p]
    if not args.broken:
        if len({os.path.abspath(p) for p in outputs}) < len(outputs):
            raise BadValue("OUT_DIR, --gguf and --ct2 name the same path; give each its own")
        check_apart(outputs, [p for p in (out_dir, args.ct2) if p])
        inputs = [p for p in (args.checkpoint, args.tokenizer) if os.path.exists(p)]
        if out_dir:
            check_out_dir(out_dir, args.force, HF_FILES, inputs, "OUT_DIR")
        if args.ct2:
            check_out_dir(args.ct2, args.force, peers.CT2_FILES, inputs, "--ct2 DIR")
        if args.gguf:
            check_output(args.gguf, args.force, inputs=inputs, ours=GGUF)
    for wanted, module in ((args.gguf, "gguf"), (args.ct2, "ctranslate2")):
        if wanted:
            peers.engine(module)
    model, bpe = load_pair(args.checkpoint, args.tokenizer)
    dtype = getattr(torch, args.dtype)
    model = rounded_to(model, dtype)  # the folder holds the weights rounded: proven against the same rounding
    if args.gguf:
        peers.check_gguf_type(model.cfg, args.gguf_type)  # before the folder is built and proven
    works = []
    try:
        built = {}
        folder = os.path.join(work_folder(None if args.broken else outputs[0], works), "hf")
        write_folder(model, bpe, folder, fix_layout=args.broken != "layout",
                     rotary_pct=0.25 if args.broken == "rotary" else 1.0, dtype=dtype)
        rounded = "" if args.dtype == "float32" else f" (its weights {args.dtype}, model.py's rounded alike)"
        print(BROKEN.get(args.broken, f"{args.checkpoint} as GPTNeoXForCausalLM{rounded}, {args.tokenizer} as a fast "
                                      f"tokenizer, loaded back through transformers {transformers.__version__}:"))
        hf, tokenizer = load_folder(folder)
        exact = report(*compare(model, bpe, hf, tokenizer))
        if args.broken:
            return
        if not exact:
            raise BadValue(f"the exported folder does not reproduce {args.checkpoint}; nothing written")
        if args.gguf:
            built[args.gguf] = os.path.join(work_folder(args.gguf, works), "model.gguf")
            export_gguf(model, bpe, built[args.gguf], args.gguf_type)
        if args.ct2:
            built[args.ct2] = os.path.join(work_folder(args.ct2, works), "ct2")
            export_ct2(model, bpe, hf, tokenizer, built[args.ct2])
        if out_dir:
            built[out_dir] = folder
        for path, result in built.items():
            put_in_place(result, path, args.force, peers.CT2_FILES if path == args.ct2 else HF_FILES)
            print(f"wrote {path}")
    except Exception as e:
        if write_failure(e) is None:
            raise
        raise BadInput(f"cannot write {listing([shown(p) for p in outputs])}: {write_failure(e)}; "
                      "nothing was written there") from None
    finally:
        for work in works:
            shutil.rmtree(work)
