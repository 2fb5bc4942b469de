"""tfx.serve.text.ChoiceText: however the tokens arrive (one by one or in bursts), the pieces
it hands out add up to the decoding of all of them, cut before the first stop string, and
never show an unfinished character or text a stop string later removes."""

import hypothesis.strategies as st
from hypothesis import given, settings

from tfx.serve.text import ChoiceText
from tfx.train.data import ByteTokenizer

TOKENIZER = ByteTokenizer()
TEXTS = st.text(alphabet="ab é€🙂\n", min_size=0, max_size=24)


def _feed(text: str, cuts: list[int], stop=()) -> tuple[list[str], ChoiceText]:
    ids = list(text.encode())
    choice, pieces, seen = ChoiceText(TOKENIZER, stop), [], 0
    for cut in sorted({min(c, len(ids)) for c in cuts}):
        if cut > seen:
            pieces.append(choice.update(ids[:cut]))
            seen = cut
    pieces.append(choice.update(ids, final=True))
    return pieces, choice


@settings(max_examples=200, deadline=None)
@given(TEXTS, st.lists(st.integers(0, 100), max_size=12))
def test_pieces_add_up_to_the_whole_decoding(text, cuts):
    pieces, _ = _feed(text, cuts)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


@settings(max_examples=200, deadline=None)
@given(TEXTS, st.lists(st.integers(0, 100), max_size=12), st.sampled_from(["b€", "é", "a a"]))
def test_text_stops_before_the_first_stop_string(text, cuts, stop):
    pieces, choice = _feed(text, cuts, stop=[stop, "never"])
    cut = text.find(stop)
    assert "".join(pieces) == (text if cut < 0 else text[:cut])
    assert choice.stopped == (cut >= 0)
