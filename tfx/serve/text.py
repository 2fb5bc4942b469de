"""A choice's text as its tokens arrive: incremental decoding and stop strings.

A byte-level BPE token may end inside a UTF-8 character, and a tokenizer may render a token
differently after its neighbour (a leading space), so tokens are never decoded one by one. As
in vLLM and TGI, each update decodes a short window twice: the tokens since the last settled
point without and with the new ones; the difference is the new text, unless it ends in an
unfinished character (U+FFFD), which waits for the next token. Text that could still become a
stop string is held back too, until the next token decides it.
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
        self._longest_stop = max(map(len, self._stop), default=0)
        self.tokens: list[int] = []
        self.text = ""  # decoded so far (the window's unfinished tail excluded)
        self.sent = ""  # the text handed out so far
        self.stopped = False  # a stop string was found: the choice is over
        self._window, self._read = 0, 0  # tokens [window, read) decode to the end of text

    def update(self, tokens: Sequence[int], final: bool = False) -> str:
        """Take the choice's tokens so far (a longer list each time); return the text to send
        now. `final`: no token follows, so nothing is held back."""
        self.tokens = list(tokens)
        self._decode(final)
        text, start = self.text, max(0, len(self.sent) - self._longest_stop + 1)
        end = min((i for i in (text.find(s, start) for s in self._stop) if i >= 0), default=-1)
        if end >= 0:
            text, self.stopped, final = text[:end], True, True
        settled = text if final else text[:len(text) - self._held(text)]
        new = settled[len(self.sent):]
        self.sent += new
        return new

    def _decode(self, final: bool) -> None:
        """Extend `text` by what the new tokens add to the window's decoding."""
        before = self._tokenizer.decode(self.tokens[self._window:self._read])
        after = self._tokenizer.decode(self.tokens[self._window:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._window, self._read = self._read, len(self.tokens)

    def _held(self, text: str) -> int:
        """Characters at the end of `text` not to send yet: the longest tail that begins a
        stop string."""
        return max((n for s in self._stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)
