"""Tests for tfx.train.chat: ChatTokenizer renders and tokenizes exactly as transformers'
`apply_chat_template` (the reference, run on the same folder), and masks the assistant's turns."""

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from hf_folders import CHATML, LLAMA3, chat_tokenizer, tokenizer_file  # noqa: E402

from tfx.train.chat import ChatTokenizer  # noqa: E402

# The end marker each template writes after a turn.
END = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}
SYSTEM = {"role": "system", "content": "You are terse."}
Q1 = {"role": "user", "content": "What is two plus two?"}
A1 = {"role": "assistant", "content": "It is four."}
Q2 = {"role": "user", "content": "And 2+3?"}
A2 = {"role": "assistant", "content": "Five, naïve 🙂 one."}
CONVERSATIONS = {
    "one_turn": [Q1, A1],
    "system": [SYSTEM, Q1, A1],
    "multi_turn": [SYSTEM, Q1, A1, Q2, A2],
    "prompt_only": [Q1],
    "awaiting_answer": [Q1, A1, Q2],
}


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def pair(request, tmp_path_factory):
    """(transformers' tokenizer, ChatTokenizer) over one saved folder."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = chat_tokenizer(transformers, folder, CHATML if request.param == "chatml"
                               else LLAMA3)
    return request.param, reference, ChatTokenizer(folder)


def reference_ids(reference, messages, **kwargs) -> list[int]:
    return list(reference.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"])


def test_special_tokens_match_transformers(pair):
    name, reference, tokenizer = pair
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<s>", END[name], "<pad>")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    assert tokenizer.chat_template == reference.chat_template


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_render_and_ids_equal_apply_chat_template(pair, conversation, add_generation_prompt):
    _, reference, tokenizer = pair
    messages = CONVERSATIONS[conversation]
    text = tokenizer.render(messages, add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids, mask = tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape
    assert ids.tolist() == reference_ids(reference, messages,
                                         add_generation_prompt=add_generation_prompt)


def test_assistant_mask_decodes_to_the_answers_and_end_markers(pair):
    name, reference, tokenizer = pair
    for add_generation_prompt in (False, True):
        ids, mask = tokenizer.encode_chat(CONVERSATIONS["multi_turn"],
                                          add_generation_prompt=add_generation_prompt)
        expected = {"chatml": "It is four.<|im_end|>Five, naïve 🙂 one.<|im_end|>",
                    "llama3": "It is four.<|eot_id|>Five, naïve 🙂 one.<|eot_id|>"}[name]
        assert reference.decode(ids[mask].tolist()) == expected
        # Two runs of masked tokens, one per turn, each ending on the end marker.
        starts = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int)])) == 1)
        ends = np.flatnonzero(np.diff(np.concatenate([mask.astype(int), [0]])) == -1)
        assert len(starts) == 2 and all(ids[e] == tokenizer.eos_id for e in ends)
    _, mask = tokenizer.encode_chat(CONVERSATIONS["prompt_only"], add_generation_prompt=True)
    assert not mask.any()


CONTENT = st.text(alphabet="ab .?\n", min_size=1, max_size=12).filter(lambda s: s.strip())


@st.composite
def conversations(draw):
    turns = draw(st.integers(1, 3))
    messages = [{"role": "system", "content": draw(CONTENT)}] if draw(st.booleans()) else []
    for _ in range(turns):
        messages += [{"role": "user", "content": draw(CONTENT)},
                     {"role": "assistant", "content": draw(CONTENT)}]
    if draw(st.booleans()):
        messages.append({"role": "user", "content": draw(CONTENT)})
    return messages


@settings(max_examples=12, deadline=None)
@given(messages=conversations(), add_generation_prompt=st.booleans())
def test_random_conversations_match_transformers(pair, messages, add_generation_prompt):
    name, reference, tokenizer = pair
    assert tokenizer.render(messages, add_generation_prompt=add_generation_prompt) == (
        reference.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=add_generation_prompt))
    ids, mask = tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids.tolist() == reference_ids(reference, messages,
                                         add_generation_prompt=add_generation_prompt)
    trim = str.strip if name == "llama3" else str  # LLAMA3's template trims the content
    said = [trim(m["content"]) + END[name] for m in messages if m["role"] == "assistant"]
    # A token whose first character is in the header (ChatML's "\n" merged with the answer's
    # leading spaces into one token) belongs to the prompt: the mask starts after it, so an
    # answer may lose leading whitespace, never anything else.
    masked = reference.decode(ids[mask].tolist())
    lost = "".join(f"\\s{{0,{len(s) - len(s.lstrip())}}}{re.escape(s.lstrip())}" for s in said)
    assert re.fullmatch(lost, masked), (masked, said)


def test_encode_chat_completion_masks_the_completion(pair):
    name, reference, tokenizer = pair
    prompt, completion = CONVERSATIONS["multi_turn"][:4], CONVERSATIONS["multi_turn"][4:]
    ids, mask = tokenizer.encode_chat_completion(prompt, completion)
    assert ids.tolist() == reference_ids(reference, prompt + completion)
    assert reference.decode(ids[mask].tolist()) == "Five, naïve 🙂 one." + END[name]
    prompt_ids = reference_ids(reference, prompt, add_generation_prompt=True)
    assert np.flatnonzero(mask)[0] == len(prompt_ids)


def test_encode_completion_is_bos_prompt_completion_eos(pair):
    _, reference, tokenizer = pair
    ids, mask = tokenizer.encode_completion("Q: two plus two?", " It is four.")
    prompt = reference.encode("Q: two plus two?", add_special_tokens=False)
    completion = reference.encode(" It is four.", add_special_tokens=False)
    assert ids.tolist() == [reference.bos_token_id, *prompt, *completion,
                            reference.eos_token_id]
    assert mask.tolist() == [False] * (1 + len(prompt)) + [True] * (len(completion) + 1)


def folder_with(tmp_path, config: dict, template: str | None = None,
                special_tokens_map: dict | None = None):
    """A tokenizer folder written by hand: tokenizer.json, tokenizer_config.json, and
    chat_template.jinja and special_tokens_map.json when given."""
    tokenizer_file(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (tmp_path / "chat_template.jinja").write_text(template)
    if special_tokens_map is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return tmp_path


def test_older_layout_template_inside_tokenizer_config(tmp_path):
    reference = chat_tokenizer(transformers, tmp_path / "new", CHATML)
    old = folder_with(tmp_path / "old", {
        "bos_token": {"content": "<s>", "lstrip": False, "special": True},
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"},
        "chat_template": CHATML}, special_tokens_map={"pad_token": {"content": "<pad>"}})
    tokenizer = ChatTokenizer(old)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<s>", "<|im_end|>", "<pad>")
    for messages in CONVERSATIONS.values():
        assert tokenizer.render(messages, add_generation_prompt=True) == (
            reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        assert tokenizer.encode_chat(messages)[0].tolist() == reference_ids(reference, messages)


def test_named_template_list_uses_default(tmp_path):
    folder = folder_with(tmp_path, {"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHATML}]})
    assert ChatTokenizer(folder).chat_template == CHATML


# The environment's extras, checked against transformers' rendering of the same template.
EXTRAS = (
    "{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- if m.role == 'system' %}"
    "{%- continue %}{%- endif %}{%- set ns.n = ns.n + 1 %}"
    "{% generation %}{{ m | tojson }}{% endgeneration %}\n"
    "{%- if ns.n > 4 %}{%- break %}{%- endif %}{%- endfor %}"
    "{{ dict(a=1) | tojson(sort_keys=True) }}{{ eos_token }}{{ pad_token }}{{ unk_token }}"
    "{{ strftime_now('%Y') }}{% if add_generation_prompt %}<go>{% endif %}")


def test_template_environment_matches_transformers(tmp_path):
    reference = chat_tokenizer(transformers, tmp_path, EXTRAS)
    tokenizer = ChatTokenizer(tmp_path)
    # The last message is left out by the template's `break`; None-valued keys are dropped.
    messages = [*CONVERSATIONS["multi_turn"], {"role": "user", "content": "<b>&", "x": None},
                {"role": "assistant", "content": "not rendered"}]
    for add_generation_prompt in (False, True):
        assert tokenizer.render(messages, add_generation_prompt=add_generation_prompt) == (
            reference.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt))
    text = tokenizer.render(messages)
    assert '"content": "<b>&"}' in text and "🙂" in text and "not rendered" not in text


def test_raise_exception_becomes_value_error(pair, tmp_path):
    name, _, tokenizer = pair
    if name == "llama3":
        with pytest.raises(ValueError, match="unknown role tool"):
            tokenizer.render([Q1, {"role": "tool", "content": "4"}])
    folder = folder_with(tmp_path, {"eos_token": "</s>"},
                         "{{ raise_exception('this model takes no system turn') }}")
    with pytest.raises(ValueError, match="this model takes no system turn"):
        ChatTokenizer(folder).render([SYSTEM])


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(_hidden=1) %}{{ ns._hidden }}",
    "{% set ns = namespace() %}{% set ns._hidden = 1 %}",
    "{{ messages.__class__.mro() }}",
    "{{ dict.__class__.__subclasses__() }}",
])
def test_sandbox_refuses_python_internals(tmp_path, template):
    tokenizer = ChatTokenizer(folder_with(tmp_path, {}, template))
    with pytest.raises(ValueError, match="chat template"):
        tokenizer.render([Q1])


def test_no_template_is_a_clear_error(tmp_path):
    tokenizer = ChatTokenizer(folder_with(tmp_path, {"eos_token": "</s>"}))
    assert tokenizer.chat_template is None and tokenizer.bos_id is None
    for call in (lambda: tokenizer.render([Q1]), lambda: tokenizer.encode_chat([Q1, A1])):
        with pytest.raises(ValueError, match=r"no chat template.*\"prompt\".*\"completion\""):
            call()
    ids, mask = tokenizer.encode_completion("a", "b")  # the plain format needs none
    assert ids[-1] == tokenizer.eos_id and mask[-1] and not mask[0]


def test_template_that_is_not_prefix_stable_is_refused(tmp_path):
    # Renders the conversation newest first, so a shorter one is not a prefix of a longer one.
    reverse = "{% for m in messages | reverse %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tokenizer = ChatTokenizer(folder_with(tmp_path, {"eos_token": "</s>"}, reverse))
    with pytest.raises(ValueError, match="not prefix-stable"):
        tokenizer.encode_chat([Q1, A1, Q2, A2])


@pytest.mark.parametrize("config, template, match", [
    ("{not json", None, "tokenizer_config.json"),
    ('["a list"]', None, "tokenizer_config.json.*JSON object"),
    ('{"bos_token": 3}', None, "tokenizer_config.json.*bos_token"),
    ('{"bos_token": "<nope>"}', None, "tokenizer_config.json.*'<nope>' is not in the vocab"),
    ('{"chat_template": {"x": 1}}', None, "tokenizer_config.json.*chat_template"),
    ("{}", "{% for m in messages %}", "chat_template.jinja.*does not compile"),
])
def test_bad_folder_names_the_file(tmp_path, config, template, match):
    tokenizer_file(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(config)
    if template is not None:
        (tmp_path / "chat_template.jinja").write_text(template)
    with pytest.raises(ValueError, match=match):
        ChatTokenizer(tmp_path)


def test_not_a_folder(tmp_path):
    with pytest.raises(ValueError, match="not one"):
        ChatTokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        ChatTokenizer(tmp_path)
