"""A served row's new tokens as text: whole UTF-8 characters only, and never a byte of a stop it met.

Tokens are byte strings (bpe.BPE.vocab), and a character can span two tokens: a stream that decoded each
token on its own would send half a character as U+FFFD. TextStream keeps the row's bytes, hands on only
the characters they complete (an incremental UTF-8 decoder holds back a partial one), and at the end
flushes what is left with errors="replace", as bpe.BPE.decode does. It also holds back any tail of the
bytes that could still grow into a stop string, so the text never shows a stop, as OpenAI's API promises:
the row ends at the token that completes a stop (prefill_clone.Engine's rule, whose tokens the engine
keeps), and the text is cut where the stop begins; a stop id's own bytes are not shown either.

    stream = TextStream(tokenizer.vocab, [b"\\n\\n"])
    text = stream.push(token)                  # while the row runs
    text = stream.push(token, stop_id=False)   # its last token: the rest, cut before a stop
"""
import codecs


def stop_prefix(data, stops):
    """The length of the longest tail of data that is the start of some stop (and not a whole one)."""
    return max((n for stop in stops for n in range(min(len(stop) - 1, len(data)), 0, -1)
                if data.endswith(stop[:n])), default=0)


class TextStream:
    def __init__(self, vocab, stops=()):
        self.vocab, self.stops = vocab, list(stops)
        self.data, self.sent = bytearray(), 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token, stop_id=None):
        """The text token completes. stop_id None: the row goes on; True or False: this is its last token,
        True when it ended on a stop id (whose bytes are then dropped)."""
        if self.vocab is None:  # an engine without a tokenizer streams ids only
            return ""
        self.data += self.vocab[token]
        if stop_id is None:
            return self._send(len(self.data) - stop_prefix(self.data, self.stops))
        end = len(self.data) - (len(self.vocab[token]) if stop_id else 0)
        # The earliest stop in the bytes is the one this token completed (an earlier one would have
        # ended the row), and what was held back covers it, so nothing of it was sent.
        end = min([end, *(i for i in map(self.data.find, self.stops) if i >= 0)])
        return self._send(end) + self.decoder.decode(b"", final=True)

    def _send(self, end):
        text = self.decoder.decode(bytes(self.data[self.sent:end])) if end > self.sent else ""
        self.sent = max(self.sent, end)
        return text
