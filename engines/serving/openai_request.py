"""What a request to python -m engines.serve's server (engines/serving/server.py) may ask, read and checked once: seed (absent: a fresh
one), temperature (0: greedy), top_p, top_k, repetition_penalty (the lesson's; OpenAI's frequency and presence
penalties are another thing, refused by name unless 0), stop (a string or a list), max_tokens or
max_completion_tokens (1 to what the prompt leaves of the window), stream and stream_options.include_usage,
cache_salt (vLLM's: only requests with the same salt share the prefix cache; not empty); model may name anything, answers
name the served one; n and best_of only 1 (NOT_OFFERED lists the rest). A field not of its type, unknown or not offered
is refused by name with a 400; the engine's submit checks the values. And CHAT_TEMPLATE, the one text the
model reads for OpenAI's messages.
"""
import json

from engines.serving.http_policy import Refused

CHAT_TEMPLATE = """One line a message, its role's name, a colon, a space (none where the content is empty or begins
with a newline) and its content ("System: ...", "User: ...", "Assistant: ..."; "developer" reads as System),
joined by newlines, then a last line "Assistant:" for the model to go on from. A message whose content holds a
line that begins with a role's name and a colon is refused: it would read as a message of that role, so one
text could speak for others. The reply ends at max_tokens, at a stop string, or where the model begins a line
of a role (the server adds ROLE_LINES to the stops, so a reply sent back as history is never refused). It comes
back as the model wrote it, less one space where it begins with one (the space after "Assistant:"), so that,
sent back as history, it makes the very text generated: the next turn's prompt begins with this turn's
prompt and reply, and the prefix cache holds them."""
ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
ROLE_LINES = [f"\n{name}:" for name in ("System", "User", "Assistant")]
MAX_STOPS, MAX_STOP_CHARS = 4, 64  # OpenAI's 4 stop strings; every token is checked against each
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is what the window has left
NUMBER, WHOLE = (int, float), (int,)
# Every field a request may carry: its JSON types and its default (where absent or null). `model`: any name is
# accepted, answers name the served model; user, metadata, store, parallel_tool_calls: bookkeeping, unused.
FIELDS = {"model": ((str,), None), "stream": ((bool,), False), "stream_options": ((dict,), {}),
          "max_tokens": (WHOLE, None), "max_completion_tokens": (WHOLE, None), "seed": (WHOLE, None),
          "temperature": (NUMBER, 1.0), "top_p": (NUMBER, 1.0), "top_k": (WHOLE, 0),
          "repetition_penalty": (NUMBER, 1.0),
          "stop": ((str, list), []), "user": ((str,), None), "metadata": ((dict,), None), "store": ((bool,), None),
          "parallel_tool_calls": ((bool,), None), "cache_salt": ((str,), "")}
TYPE_NAMES = {NUMBER: "a number", WHOLE: "a whole number", (str,): "a string", (bool,): "true or false",
              (dict,): "an object", (str, list): "a string or a list of strings"}
PENALTIES = ("this model's knob is repetition_penalty (a repeated token's score divided by it if positive, "
             "multiplied if negative), not OpenAI's subtracted penalties; send repetition_penalty instead")
# OpenAI's fields this server does not offer: the values that ask for nothing (accepted), and why others are refused.
NOT_OFFERED = {"n": ((1,), "one choice a request; send n requests, each with its own seed"),
               "best_of": ((1,), "one choice a request; send several requests, each with its own seed"),
               "frequency_penalty": ((0,), PENALTIES), "presence_penalty": ((0,), PENALTIES),
               "logprobs": ((False,), "log probabilities are not returned (0 asks for the sampled tokens' own)"),
               "top_logprobs": ((0,), "log probabilities are not returned"), "echo": ((False,), "no echo"),
               "suffix": (("",), "no insertion mode"), "logit_bias": (({},), "no logit bias; use stop, top_k or top_p"),
               "tools": (([],), "the model has no tools"), "tool_choice": (("none", "auto"), "the model has no tools"),
               "response_format": (({"type": "text"},), "plain text only")}


def refusal(error, chat):
    """A BadValue (the engine's, the tokenizer's) as a 400 whose param is its field, by this API's name."""
    if error.field == "penalty":  # the engine's name for this server's repetition_penalty
        return Refused(f"repetition_{error}", "repetition_penalty")
    return Refused(str(error), "messages" if chat and error.field == "prompt" else error.field)


def shown(value):
    return json.dumps(value)[:80]


def asks_nothing(value, allowed):
    """Whether a NOT_OFFERED field's value is one that asks for nothing (0 is 0.0, but true is not 1, 0 not false)."""
    return value is None or any(value is v or value == v and bool not in (type(value), type(v)) for v in allowed)


def lone_surrogate(value):
    """Whether a string anywhere in value, a key too, holds a lone surrogate (JSON's "\\ud800"): not text."""
    if isinstance(value, dict):
        return any(lone_surrogate(k) or lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(map(lone_surrogate, value))
    try:
        isinstance(value, str) and value.encode()
    except UnicodeEncodeError:
        return True
    return False


def read_request(body, prompt_field):
    """The JSON body's fields as {name: value}: each known, of its type, or Refused naming it."""
    if not isinstance(body, dict):
        raise Refused("the request body must be a JSON object")
    if prompt_field not in body:
        raise Refused(f"'{prompt_field}' is required", prompt_field)
    for name, value in body.items():
        if lone_surrogate(name) or lone_surrogate(value):  # no text to encode, to the model or in an answer
            where = None if lone_surrogate(name) else name if name != "messages" or not isinstance(value, list) else \
                f"messages[{next(i for i, m in enumerate(value) if lone_surrogate(m))}]"
            raise Refused(f"{where or 'a field name'} holds a lone surrogate (as JSON's \"\\ud800\"), which is not "
                          "text; send UTF-8 text", where)
        if name in NOT_OFFERED and not asks_nothing(value, NOT_OFFERED[name][0]):
            raise Refused(f"{name}={shown(value)} is not offered: {NOT_OFFERED[name][1]}", name)
        if name in FIELDS and value is not None and type(value) not in FIELDS[name][0]:
            raise Refused(f"{name} must be {TYPE_NAMES[FIELDS[name][0]]}, got {shown(value)}", name)
        if name not in (prompt_field, *FIELDS, *NOT_OFFERED):
            known = sorted([prompt_field, *FIELDS, *NOT_OFFERED])
            raise Refused(f"unknown field {name!r}; the fields are {known}", name)
    fields = {name: default if body.get(name) is None else body[name] for name, (_, default) in FIELDS.items()}
    for name in (n for n, (kinds, _) in FIELDS.items() if kinds is NUMBER):
        try:
            fields[name] = float(fields[name])  # the engine's knobs are floats; JSON may say 1 or 1e999
        except OverflowError:
            raise Refused(f"{name} {shown(fields[name])} is too large for a number", name) from None
    if fields["max_tokens"] is not None and fields["max_completion_tokens"] is not None:
        raise Refused("give max_tokens or max_completion_tokens (the same thing), not both", "max_completion_tokens")
    fields["max_tokens"] = fields["max_completion_tokens"] if fields["max_tokens"] is None else fields["max_tokens"]
    stops = [fields["stop"]] if isinstance(fields["stop"], str) else fields["stop"]
    if not all(isinstance(s, str) and s for s in stops):
        raise Refused(f"stop must be a non-empty string or a list of them, got {shown(fields['stop'])}", "stop")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise Refused(f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
    if body.get("cache_salt") == "":
        raise Refused("cache_salt must be a non-empty string: an empty one would be no salt, sharing the unsalted "
                      "prefix cache; leave the field out for that", "cache_salt")
    options = fields["stream_options"]
    if options and not fields["stream"]:
        raise Refused('stream_options is for a stream only ("stream": true)', "stream_options")
    if set(options) - {"include_usage"} or any(type(v) is not bool for v in options.values()):
        raise Refused(f'stream_options takes {{"include_usage": true or false}} alone, got {shown(options)}',
                      "stream_options")
    return {**fields, prompt_field: body[prompt_field], "stop": stops}


def chat_prompt(messages):
    """The text CHAT_TEMPLATE makes of OpenAI's messages."""
    if not isinstance(messages, list) or not messages:
        raise Refused('messages must be a non-empty list of {"role", "content"} objects', "messages")
    lines = []
    for i, message in enumerate(messages):
        role, content = (message.get("role"), message.get("content")) if isinstance(message, dict) else (None, None)
        if unknown := sorted(set(message) - {"role", "content"}) if isinstance(message, dict) else None:
            raise Refused(f"messages[{i}].{unknown[0]} is not offered: a message is its role and content alone",
                          f"messages[{i}]")
        if isinstance(content, list):  # OpenAI's content parts: text parts only
            parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
            content = "".join(parts) if all(isinstance(p, str) for p in parts) else None
        if role not in ROLES or not isinstance(content, str):
            raise Refused(f'messages[{i}] must be {{"role": one of {sorted(ROLES)}, "content": text}}, got '
                          f"{shown(message)}", f"messages[{i}]")
        if forged := min((line for line in ROLE_LINES if line in content), key=content.index, default=None):
            raise Refused(f"messages[{i}]'s content holds a line that begins {forged[1:]!r}, which would read as a "
                          "message of that role; send it as a message of its own, or begin the line otherwise",
                          f"messages[{i}]")
        space = "" if content == "" or content.startswith("\n") else " "  # a reply is sent back as it was written
        lines.append(f"{ROLES[role]}:{space}{content}")
    return "\n".join(lines + ["Assistant:"])
