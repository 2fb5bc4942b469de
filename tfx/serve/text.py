"""A choice's text as its tokens arrive: incremental decoding and stop strings.

Each update decodes all tokens so far (a byte-level BPE token may end inside a UTF-8
character, so decoding tokens one by one would garble text) and hands out only the new, settled
part: text that ends in an unfinished character (U+FFFD) or could still become a stop string is
held back until the next token decides it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ChoiceText"]


class ChoiceText:
    """The text of one choice, fed its token ids as the engine makes them.

    tokenizer: has `decode(ids) -> str` (special tokens skipped). stop: strings that end the
    choice; the text stops before the first one found.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._tokenizer, self._stop = tokenizer, tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.sent = ""  # the text handed out so far
        self.stopped = False  # a stop string was found: the choice is over

    def update(self, tokens: Sequence[int], final: bool = False) -> str:
        """Take the choice's tokens so far (a longer list each time); return the text to send
        now. `final`: no token follows, so nothing is held back."""
        self.tokens = list(tokens)
        text = self._tokenizer.decode(self.tokens)
        end = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if end >= 0:
            text, self.stopped, final = text[:end], True, True
        settled = text if final else text[:len(text) - self._held(text)]
        new = settled[len(self.sent):] if settled.startswith(self.sent) else ""
        self.sent += new
        return new

    def _held(self, text: str) -> int:
        """Characters at the end of `text` not to send yet: an unfinished character, or the
        longest tail that begins a stop string."""
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        return max((n for s in self._stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)
