"""The engines' side of export.py: a GGUF for llama.cpp, a CTranslate2 model, and each engine run greedily.

Not a script. export.py (--gguf, --ct2), the engine tests and bench.py's peers
table import it; nothing else does, so a reader without engines/requirements.txt
still runs every other script. It takes what export.py already built (the
weights under GPT-NeoX's names and layout, the vocabulary in GPT-2's byte
alphabet) and hands it to each engine's own writer: the `gguf` package is
llama.cpp's, and the CTranslate2 model goes through ctranslate2's GPT-NeoX
loader. No engine is patched.

Each engine runs in a process of its own (isolated): a native crash there
(llama.cpp's AMX path segfaults on some Intel VMs, see llama_model_params)
is then one error naming the engine and the signal, and an engine's thread
pool never slows torch or another engine down for the rest of a process.

BOS and EOS. Part 1's tokenizer has no special tokens, and llama.cpp, left
without ids, takes id 11 (a vertical-tab byte) as both. Here nothing is
prepended to a prompt, and the stop id is the byte 0xFF: ids 0-255 are raw
bytes, and 0xFF never occurs in UTF-8, so no text encodes to it and a model
trained on text does not pick it.
"""
import contextlib
import importlib
import multiprocessing
import os
import pickle
import signal
import sys
import time
from types import SimpleNamespace

import numpy as np

from engines.edge.errors import BadValue, EngineFailed

REQUIREMENTS = "engines/requirements.txt"
GGUF_TYPES = ("f32", "f16", "q8_0")
STOP_ID = 0xFF  # the byte no UTF-8 text holds: the honest end-of-text id for a vocabulary without one
CT2_FILES = {"config.json", "model.bin", "vocabulary.json", "vocabulary.txt", "shared_vocabulary.json"}


def engine(module):
    """Import an engine package, or stop with one line naming the requirements file."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = "" if e.name == module else f" ({e.name} missing)"
        raise BadValue(f"{module} is not installed{missing}; pip install -r {REQUIREMENTS}") from None


GGUF_BLOCK = {"q8_0": 32}  # a quantized type's values come in blocks of this many along each matrix's rows


def check_gguf_type(cfg, kind):
    """Refuse, before any work, a GGUF type this model's shapes cannot be written in: q8_0 quantizes each
    matrix's rows (d_model or 4 x d_model values) in blocks of 32."""
    block = GGUF_BLOCK.get(kind)
    if block and cfg.d_model % block:
        raise BadValue(f"--gguf-type {kind} stores each matrix's rows in blocks of {block} values, and this model's "
                       f"rows are d_model = {cfg.d_model} long, not a multiple of {block}; use --gguf-type f16 or f32")


def write_gguf(path, cfg, tensors, tokens, merges, kind="f32"):
    """A GGUF llama.cpp loads as it is: GPT-NeoX, GPT-2-style BPE with GPT-2's split (Part 1's).

    tensors: GPT-NeoX-named weights (export.neox_state_dict); tokens and merges in GPT-2's byte alphabet."""
    gguf = engine("gguf")
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPTNEOX])
    writer.add_context_length(cfg.context)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(4 * cfg.d_model)
    writer.add_rope_dimension_count(cfg.head_dim)  # the whole head rotates
    writer.add_rope_freq_base(10000.0)
    writer.add_head_count(cfg.n_heads)  # export.py has already repeated GQA's key and value heads
    writer.add_parallel_residual(False)
    writer.add_layer_norm_eps(1e-5)
    writer.add_file_type(file_type)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_bos_token_id(STOP_ID)
    writer.add_eos_token_id(STOP_ID)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPTNEOX, cfg.n_layers)
    for name, tensor in tensors.items():
        if "query_key_value" in name:
            # transformers fuses q, k, v per head; llama.cpp reads all q, then all k, then all v
            tensor = tensor.unflatten(0, (cfg.n_heads, 3, cfg.head_dim)).transpose(0, 1).flatten(0, 2)
        data = tensor.float().numpy()
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        # as llama.cpp's converter does: norms and biases stay f32, only matrices shrink
        if data.ndim == 1 or kind == "f32":
            writer.add_tensor(gguf_name, data)
        elif kind == "f16":
            writer.add_tensor(gguf_name, data.astype(np.float16))
        else:
            kind_q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, kind_q8), raw_dtype=kind_q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_ct2(hf, tokenizer, out_dir):
    """A CTranslate2 model directory through ctranslate2's own GPT-NeoX loader, float32.

    The loader reads two names transformers 5 no longer has, config.rotary_pct (now in
    rope_parameters) and the output matrix embed_out (now lm_head), and copies null
    bos/eos/unk strings that its Generator then refuses; it is handed them here."""
    converters = engine("ctranslate2.converters")
    loader = converters.transformers.GPTNeoXLoader()
    config = SimpleNamespace(**hf.config.to_dict(), rotary_pct=hf.config.rope_parameters["partial_rotary_factor"])
    model = SimpleNamespace(config=config, gpt_neox=hf.gpt_neox, embed_out=hf.get_output_embeddings())
    stop = tokenizer.convert_ids_to_tokens(STOP_ID)
    vocab = SimpleNamespace(get_vocab=tokenizer.get_vocab, bos_token=stop, eos_token=stop, unk_token=stop)

    class FolderConverter(converters.Converter):
        def _load(self):
            return loader(model, vocab)
    FolderConverter().convert(out_dir, quantization="float32")


def isolated(name, fn, *args):
    """fn(*args) in a fresh process of its own: an engine's native crash (a segfault, an abort) then ends
    that process alone, and comes back here as one ChildProcessError naming the engine and the signal.

    Each engine also brings its own thread pool; in a process of its own it cannot slow torch or
    another engine down for the rest of this one. fn must be importable by name (a module's function)."""
    context = multiprocessing.get_context("spawn")  # a clean interpreter: no forked locks or thread pools
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=send_result, args=(send, fn, args), daemon=True)
    with main_script_hidden(), ctrl_c_ignored():
        child.start()
    send.close()
    try:
        failed, result = receive.recv()
    except EOFError:  # the child died before it could answer
        child.join()
        code = child.exitcode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        raise EngineFailed(f"{name} crashed ({how}) in a process of its own")
    finally:
        receive.close()
    child.join()
    if failed:
        raise result
    return result


@contextlib.contextmanager
def ctrl_c_ignored():
    """Ctrl-C ignored while a child starts, so the child inherits it ignored from its first instruction: a
    terminal's Ctrl-C reaches the whole process group, and only this process answers it, in one line (its
    daemon child ends with it)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def main_script_hidden():
    """A spawned child runs this process's main script again before fn, unless it cannot tell which script
    that is. fn is a module's function, so the child needs none of it, and a script's imports (torch,
    transformers) would cost seconds in every child."""
    main = sys.modules["__main__"]
    path, spec = main.__dict__.pop("__file__", None), main.__spec__
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = spec
        if path is not None:
            main.__file__ = path


def send_result(connection, fn, args):
    try:
        connection.send((False, fn(*args)))
    except Exception as e:  # the engine's own error, raised again in the parent
        connection.send((True, e if picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")))
    finally:
        connection.close()


def picklable(value):
    try:
        pickle.dumps(value)
        return True
    except Exception:
        return False


def llama_model_params(llama_cpp):
    """llama.cpp's default model parameters, without the weight repacking that crashes on AMX CPUs.

    A llama.cpp built with Intel AMX repacks quantized (q8_0) weights into an AMX buffer, and decoding
    from it segfaults on such VMs (ggml-org/llama.cpp#20824). Elsewhere the repacking stays on: it is
    much faster where it works (docs/serving.md has the figures)."""
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = not uses_amx(llama_cpp)
    return params


def uses_amx(llama_cpp):
    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


GGML_LOG_LEVEL_ERROR = 4  # ggml's log levels: none, debug, info, warn, error, cont
LOG_CALLBACK = []  # the ctypes callback llama.cpp holds, kept alive for as long as the process runs


def quiet_llama(llama_cpp):
    """llama.cpp's own log to stderr, errors only: its load and context reports would bury the results."""
    def errors_only(level, text, user_data):
        if level == GGML_LOG_LEVEL_ERROR:
            sys.stderr.write(text.decode(errors="replace"))
    LOG_CALLBACK[:] = [llama_cpp.llama_log_callback(errors_only)]
    llama_cpp.llama_log_set(LOG_CALLBACK[0], None)


def llama_tokenize(path, texts):
    """(ids, decoded text) for each text through the GGUF's own tokenizer (its vocabulary only, no weights)."""
    llama_cpp = engine("llama_cpp")
    quiet_llama(llama_cpp)
    llm = llama_cpp.Llama(os.fspath(path), vocab_only=True, verbose=False)
    return [(ids, llm.detokenize(ids).decode()) for ids in (llm.tokenize(t.encode(), add_bos=True) for t in texts)]


def llama_greedy(path, prompt, batch, n_tokens, threads, runs=1):
    """batch greedy continuations of the prompt ids through llama.cpp's C API, and the seconds each of
    `runs` generations took (the model loaded once, before the clock).

    The prompt is decoded once into KV cells every sequence shares (the prefill-and-clone
    trick), then each step decodes one token per sequence in one call."""
    llama_cpp = engine("llama_cpp")
    quiet_llama(llama_cpp)
    model = llama_cpp.llama_model_load_from_file(os.fsencode(path), llama_model_params(llama_cpp))
    if not model:
        raise BadValue(f"llama.cpp could not load {os.fspath(path)!r}")
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = len(prompt) + batch * n_tokens
    params.n_seq_max, params.kv_unified = batch, True
    params.n_threads = params.n_threads_batch = threads
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    tokens = llama_cpp.llama_batch_init(max(len(prompt), batch), 0, batch)

    def decode(ctx, rows):  # rows of (token, position, sequence ids, wants logits); the argmax of each wanted row
        tokens.n_tokens = len(rows)
        for i, (token, pos, seqs, logits) in enumerate(rows):
            tokens.token[i], tokens.pos[i], tokens.n_seq_id[i], tokens.logits[i] = token, pos, len(seqs), logits
            for j, seq in enumerate(seqs):
                tokens.seq_id[i][j] = seq
        if llama_cpp.llama_decode(ctx, tokens) != 0:
            raise RuntimeError("llama.cpp could not decode a batch")
        wanted = sum(logits for *_, logits in rows)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(wanted, n_vocab)).argmax(-1)

    def generate():
        ctx = llama_cpp.llama_init_from_model(model, params)
        try:
            every = list(range(batch))
            out = [decode(ctx, [(t, p, every, p == len(prompt) - 1) for p, t in enumerate(prompt)]).repeat(batch)]
            for pos in range(len(prompt), len(prompt) + n_tokens - 1):
                out.append(decode(ctx, [(int(out[-1][s]), pos, [s], True) for s in every]))
            return np.stack(out, axis=1).tolist()
        finally:
            llama_cpp.llama_free(ctx)
    try:
        seconds = []
        for _ in range(runs):
            started = time.perf_counter()
            rows = generate()
            seconds.append(time.perf_counter() - started)
        return rows, seconds
    finally:
        llama_cpp.llama_batch_free(tokens)
        llama_cpp.llama_model_free(model)


def ct2_greedy(path, tokens, batch, n_tokens, threads, runs=1, compute_type="float32"):
    """batch greedy continuations of one prompt (token strings) through CTranslate2, as ids, and the
    seconds each of `runs` generations took (the model loaded once, before the clock). compute_type:
    CTranslate2's, "int8" to quantize a float32 conversion's weights as it loads them."""
    ctranslate2 = engine("ctranslate2")
    generator = ctranslate2.Generator(os.fspath(path), device="cpu", compute_type=compute_type, intra_threads=threads)
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        results = generator.generate_batch([tokens] * batch, max_length=n_tokens, min_length=n_tokens,
                                           sampling_topk=1, include_prompt_in_result=False)
        seconds.append(time.perf_counter() - started)
    return [r.sequences_ids[0] for r in results], seconds
