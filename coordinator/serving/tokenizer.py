"""Text in and out: the checkpoint's ``tokenizer.json`` (``tokenizers`` library), incremental
detokenization for streaming, and stop strings.

A checkpoint without ``tokenizer.json`` is still served: requests then carry ``input_ids`` and
responses carry token ids with empty text.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
# prompt tokens given to the detokenizer as left context, so that the first generated token
# decodes with the spacing it has after the prompt
_CONTEXT_TOKENS = 4
# generated tokens held back while their text ends in an incomplete character: a UTF-8
# character is at most 4 bytes (4 byte tokens); a model that emits bytes that never complete
# one must not grow the decode window (quadratic work) for the rest of the request
_MAX_HELD_TOKENS = 8


class PromptTooLong(ValueError):
    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"prompt of {tokens} tokens exceeds {limit}")
        self.tokens = tokens


class TextTokenizer:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer | None:
        f = Path(path) / TOKENIZER_FILE
        return cls(Tokenizer.from_file(str(f))) if f.is_file() else None

    def encode(self, text: str, max_tokens: int | None = None, add_special_tokens: bool = True) -> list[int]:
        """With the tokenizer's own special tokens (e.g. a BOS its post-processor adds), unless
        ``add_special_tokens`` is False (a chat template writes them itself).

        Releases the GIL while it tokenizes (``encode_batch`` does; ``encode`` does not), so it
        can run in a worker thread without stalling the event loop. Raises PromptTooLong for
        more than ``max_tokens`` tokens, before building the Python list of ids."""
        enc = self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if max_tokens is not None and len(enc) > max_tokens:
            raise PromptTooLong(len(enc), max_tokens)
        return enc.ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def detokenizer(self, prompt_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids[-_CONTEXT_TOKENS:])


class IncrementalDetokenizer:
    """Turns generated ids into text pieces whose concatenation is the decoded completion.

    Decoding one token alone is wrong for tokenizers whose text depends on neighbours (spaces
    between words, a UTF-8 character split over byte tokens). So each new piece is the
    difference between decoding a short window ending at the new token and the same window
    without it; the window slides forward as text is emitted. A piece that ends in U+FFFD (an
    incomplete byte sequence) is held back until the following tokens complete it.
    """

    def __init__(self, tok: TextTokenizer, context: list[int]) -> None:
        self.tok = tok
        self.ids = list(context)
        self.start = 0  # window start
        self.emitted = len(self.ids)  # ids[:emitted] have been turned into text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end is emitted as is)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.emitted == len(self.ids):
            return ""
        before = self.tok.decode(self.ids[self.start : self.emitted])
        after = self.tok.decode(self.ids[self.start :])
        if after.endswith("\ufffd") and not final and len(self.ids) - self.emitted < _MAX_HELD_TOKENS:
            return ""
        self.start, self.emitted = self.emitted, len(self.ids)
        return after[len(before) :]


class StopMatcher:
    """Cuts the streamed text at the first stop string.

    Text that could be the start of a stop string is held back until it is known not to be,
    so a stop string never reaches the client, even split across pieces.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        assert all(stops), f"empty stop string in {stops=}"
        self.stops = stops
        self.held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was hit)."""
        buf = self.held + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string.

        Only the places where a stop string's first character occurs in the tail can start
        such a suffix (``str.find`` jumps between them), so the work per piece is about the
        tail's length per stop string, not its square."""
        best = 0
        for s in self.stops:
            start = max(0, len(buf) - len(s) + 1)  # a proper prefix is shorter than s
            i = buf.find(s[0], start)
            while i >= 0 and len(buf) - i > best:
                if s.startswith(buf[i:]):
                    best = len(buf) - i
                    break
                i = buf.find(s[0], i + 1)
        return best
