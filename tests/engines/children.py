"""What the engine tests run in a process of their own (serve.isolated). The child imports the module
of the function it runs; this one imports nothing heavy, so a child starts in a fraction of a second,
where a test file's imports (torch, transformers) would cost it seconds."""
import ctypes
import time


def segfault(*args):
    ctypes.string_at(0)  # reads address 0: SIGSEGV, as a crashing native library would


def ready_then_wait():
    print("ready", flush=True)
    time.sleep(60)


def refuse(message):
    raise ValueError(message)


def ct2_greedy_as_it_loads(path, start):
    """100 greedy ids from a CTranslate2 folder loaded with no argument but the folder."""
    import ctranslate2
    result = ctranslate2.Generator(str(path)).generate_batch([start], max_length=100, min_length=100,
                                                             sampling_topk=1, include_prompt_in_result=False)
    return result[0].sequences_ids[0]
