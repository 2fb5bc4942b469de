"""Tests for tfx.train.instructions: the SFT and preference JSONL readers, against
`ChatTokenizer.encode_*` and transformers' `apply_chat_template` on the same folder."""

import json
import re

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from hf_folders import CHATML, chat_tokenizer, tokenizer_file  # noqa: E402

from tfx.train.chat import ChatTokenizer  # noqa: E402
from tfx.train.instructions import Example, Pair, read_preference, read_sft  # noqa: E402

Q = {"role": "user", "content": "What is two plus two?"}
A = {"role": "assistant", "content": "It is four."}
B = {"role": "assistant", "content": "Five."}
SYSTEM = {"role": "system", "content": "You are terse."}
PLAIN = {"prompt": "Q: two plus two?", "completion": " It is four."}
CHAT = {"messages": [SYSTEM, Q, A, {"role": "user", "content": "Sure?"}, B]}
CHAT_COMPLETION = {"prompt": [Q], "completion": [A]}
PLAIN_PAIR = {"prompt": "Q: two plus two?", "chosen": " four", "rejected": " five"}
CHAT_PAIR = {"prompt": [SYSTEM, Q], "chosen": [A], "rejected": [B]}
BIG = 10_000


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(transformers' tokenizer, ChatTokenizer) over one ChatML folder."""
    folder = tmp_path_factory.mktemp("chatml")
    return chat_tokenizer(transformers, folder, CHATML), ChatTokenizer(folder)


def write(tmp_path, *lines, name="data.jsonl"):
    """A JSONL file of `lines` (objects are dumped, strings written as they are)."""
    path = tmp_path / name
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n"
                            for ln in lines), encoding="utf-8")
    return path


def reference_ids(reference, messages, **kwargs) -> list[int]:
    return list(reference.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"])


def test_read_sft_each_format(tokenizers, tmp_path):
    reference, tokenizer = tokenizers
    path = write(tmp_path, PLAIN, "", CHAT, "  ", CHAT_COMPLETION)
    examples, skipped = read_sft(path, tokenizer, max_tokens=BIG)
    assert skipped == 0 and len(examples) == 3
    assert all(isinstance(e, Example) and e.ids.dtype == np.int32 for e in examples)
    plain, chat, chat_completion = examples
    # Plain: BOS + prompt + completion + EOS, loss on the completion and the EOS.
    prompt = reference.encode(PLAIN["prompt"], add_special_tokens=False)
    completion = reference.encode(PLAIN["completion"], add_special_tokens=False)
    assert plain.ids.tolist() == [reference.bos_token_id, *prompt, *completion,
                                  reference.eos_token_id]
    assert plain.loss_mask.tolist() == [False] * (1 + len(prompt)) + [True] * (
        len(completion) + 1)
    # Chat: the ids of apply_chat_template, loss on each answer and its end marker.
    assert chat.ids.tolist() == reference_ids(reference, CHAT["messages"])
    assert reference.decode(chat.ids[chat.loss_mask].tolist()) == (
        "It is four.<|im_end|>Five.<|im_end|>")
    # Conversational prompt-completion: loss on the completion only.
    assert chat_completion.ids.tolist() == reference_ids(reference, [Q, A])
    assert reference.decode(chat_completion.ids[chat_completion.loss_mask].tolist()) == (
        "It is four.<|im_end|>")
    for example, expected in zip(examples, (
            tokenizer.encode_completion(PLAIN["prompt"], PLAIN["completion"]),
            tokenizer.encode_chat(CHAT["messages"]),
            tokenizer.encode_chat_completion([Q], [A])), strict=True):
        np.testing.assert_array_equal(example.ids, expected[0])
        np.testing.assert_array_equal(example.loss_mask, expected[1])


def test_read_preference_each_format(tokenizers, tmp_path):
    reference, tokenizer = tokenizers
    (plain, chat), skipped = read_preference(write(tmp_path, PLAIN_PAIR, CHAT_PAIR), tokenizer,
                                             max_tokens=BIG)
    assert skipped == 0 and isinstance(plain, Pair)
    encode = lambda text: reference.encode(text, add_special_tokens=False)  # noqa: E731
    assert plain.prompt.tolist() == [reference.bos_token_id, *encode(PLAIN_PAIR["prompt"])]
    assert plain.chosen.tolist() == [*encode(" four"), reference.eos_token_id]
    assert plain.rejected.tolist() == [*encode(" five"), reference.eos_token_id]
    prompt = reference_ids(reference, [SYSTEM, Q], add_generation_prompt=True)
    assert chat.prompt.tolist() == prompt
    for answer, ids in ((A, chat.chosen), (B, chat.rejected)):
        full = reference_ids(reference, [SYSTEM, Q, answer])
        # The rendering adds the answer, its end marker and a newline that belongs to no one.
        assert full == [*prompt, *ids.tolist(), *encode("\n")]
        assert reference.decode(ids.tolist()) == answer["content"] + "<|im_end|>"


def message(role="user", content="hi", **extra):
    return {"role": role, "content": content, **extra}


SFT_BAD = [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ({"text": "hello"}, "expected .*prompt.*messages.*got the keys \\['text'\\]"),
    ({"prompt": "q"}, "missing field 'completion'"),
    ({"completion": "a"}, "missing field 'prompt'"),
    ({"prompt": 3, "completion": "a"}, "both be strings or both lists.*int and str"),
    ({"prompt": "q", "completion": ""}, "empty 'completion'"),
    ({"prompt": "q", "completion": "  \n"}, "empty 'completion'"),
    ({"messages": "hi"}, "'messages' must be a non-empty list"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [message(), "hi"]}, "message 1 of 'messages' must be an object"),
    ({"messages": [message("bot"), message("assistant")]}, "unknown role 'bot'"),
    ({"messages": [message(), message("assistant", None)]}, "'content' must be a string"),
    ({"messages": [message(), message("assistant", "")]}, "empty assistant content"),
    ({"messages": [message(), message("user")]}, "no assistant message"),
    ({"messages": [message(), message("assistant")], "prompt": "q"}, "not both"),
    ({"prompt": [message()], "completion": [message()]}, "'completion' has no assistant"),
    ({"prompt": [], "completion": [message("assistant")]}, "'prompt' must be a non-empty"),
]


@pytest.mark.parametrize("line, match", SFT_BAD)
def test_read_sft_bad_lines_name_file_and_line(tokenizers, tmp_path, line, match):
    path = write(tmp_path, PLAIN, "", line, PLAIN)  # the bad line is physical line 3
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: ") + ".*" + match):
        read_sft(path, tokenizers[1], max_tokens=BIG)
    examples, skipped = read_sft(path, tokenizers[1], max_tokens=BIG, skip_bad=True)
    assert (len(examples), skipped) == (2, 1)


PAIR_BAD = [
    ("{not json", "not JSON"),
    ('"a string"', "expected a JSON object, got str"),
    ({"prompt": "q", "chosen": "a"}, "missing field 'rejected'"),
    ({"chosen": "a", "rejected": "b"}, "missing field 'prompt'"),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "empty 'chosen'"),
    ({"prompt": "q", "chosen": "a", "rejected": " "}, "empty 'rejected'"),
    ({"prompt": "q", "chosen": ["a"], "rejected": "b"}, "expected .*got str, list, str"),
    ({"prompt": [message()], "chosen": [message("user")], "rejected": [message("assistant")]},
     "message 0 of 'chosen': unknown role 'user'; expected one of assistant"),
    ({"prompt": [message()], "chosen": [message("assistant")], "rejected": []},
     "'rejected' must be a non-empty list"),
    ({"prompt": [message("human")], "chosen": [A], "rejected": [B]}, "unknown role 'human'"),
    ({"prompt": [message()], "chosen": [message("assistant", "")], "rejected": [B]},
     "empty assistant content"),
]


@pytest.mark.parametrize("line, match", PAIR_BAD)
def test_read_preference_bad_lines_name_file_and_line(tokenizers, tmp_path, line, match):
    path = write(tmp_path, PLAIN_PAIR, line, CHAT_PAIR)  # the bad line is line 2
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: ") + ".*" + match):
        read_preference(path, tokenizers[1], max_tokens=BIG)
    pairs, skipped = read_preference(path, tokenizers[1], max_tokens=BIG, skip_bad=True)
    assert (len(pairs), skipped) == (2, 1)


def test_lines_are_physical_and_not_utf8_is_a_bad_line(tokenizers, tmp_path):
    path = tmp_path / "data.jsonl"
    # "\u2028" inside a JSON string and a "\r" do not start new lines; the bytes on line 3 are
    # not UTF-8.
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a\xe2\x80\xa8b", "completion": "c"}\r\n'
                     b'{"prompt": "a", "completion": "d"}\n{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: not UTF-8")):
        read_sft(path, tokenizers[1], max_tokens=BIG)


def test_skip_bad_counts_and_all_bad_is_an_error(tokenizers, tmp_path):
    tokenizer = tokenizers[1]
    path = write(tmp_path, "{", PLAIN, "", {"prompt": "q", "completion": ""}, CHAT, "[]")
    examples, skipped = read_sft(path, tokenizer, max_tokens=BIG, skip_bad=True)
    assert (len(examples), skipped) == (2, 3)
    path = write(tmp_path, "{", "[]", name="bad.jsonl")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*all 2 lines are bad.*:1: not"):
        read_sft(path, tokenizer, max_tokens=BIG, skip_bad=True)


@pytest.mark.parametrize("reader", [read_sft, read_preference])
def test_missing_or_empty_file_names_the_path(tokenizers, tmp_path, reader):
    with pytest.raises(ValueError, match=r"nothing\.jsonl.*no such file"):
        reader(tmp_path / "nothing.jsonl", tokenizers[1], max_tokens=BIG)
    empty = write(tmp_path, "", "  ", name="empty.jsonl")
    with pytest.raises(ValueError, match=r"empty\.jsonl.* is empty"):
        reader(empty, tokenizers[1], max_tokens=BIG, skip_bad=True)


@pytest.mark.parametrize("line", [PLAIN, CHAT, CHAT_COMPLETION])
def test_too_long_examples_are_refused_not_truncated(tokenizers, tmp_path, line):
    short = {"prompt": "", "completion": "a"}  # BOS a EOS
    path = write(tmp_path, line, short)
    (example, _), _ = read_sft(path, tokenizers[1], max_tokens=BIG)
    n = len(example.ids)
    (fits, _), _ = read_sft(path, tokenizers[1], max_tokens=n)
    assert len(fits.ids) == n
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: the example is {n} tokens, more "
                                                   f"than max_tokens={n - 1}")):
        read_sft(path, tokenizers[1], max_tokens=n - 1)
    (kept,), skipped = read_sft(path, tokenizers[1], max_tokens=n - 1, skip_bad=True)
    assert skipped == 1 and len(kept.ids) == 3


@pytest.mark.parametrize("line", [PLAIN_PAIR, CHAT_PAIR])
def test_too_long_pairs_are_refused(tokenizers, tmp_path, line):
    path = write(tmp_path, line)
    (pair,), _ = read_preference(path, tokenizers[1], max_tokens=BIG)
    longest = len(pair.prompt) + max(len(pair.chosen), len(pair.rejected))
    which = "chosen" if len(pair.chosen) >= len(pair.rejected) else "rejected"
    assert read_preference(path, tokenizers[1], max_tokens=longest)[0][0].chosen.size
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: prompt + {which} is {longest}")):
        read_preference(path, tokenizers[1], max_tokens=longest - 1)


def test_template_refusal_is_a_bad_line_and_no_template_is_not_skipped(tmp_path):
    folder = tmp_path / "tokenizer"
    tokenizer_file(folder)
    (folder / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ m.content }}{% endfor %}")
    tool = {"messages": [message(), message("tool", "4"), message("assistant", "four")]}
    path = write(tmp_path, PLAIN, tool)
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: ") + ".*no tools"):
        read_sft(path, ChatTokenizer(folder), max_tokens=BIG)
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: ") + ".*none; the .*prompt"):
        read_sft(path, ChatTokenizer(folder), max_tokens=BIG, skip_bad=True)


@pytest.mark.parametrize("max_tokens, error", [(0, ValueError), (1.5, TypeError),
                                                (True, TypeError)])
def test_max_tokens_is_checked(tokenizers, tmp_path, max_tokens, error):
    with pytest.raises(error, match="max_tokens"):
        read_sft(write(tmp_path, PLAIN), tokenizers[1], max_tokens=max_tokens)
