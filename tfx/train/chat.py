"""Chat templates: a Hugging Face tokenizer folder rendered and tokenized as transformers does.

`ChatTokenizer(folder)` reads what `PreTrainedTokenizerFast.save_pretrained` writes
(`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`, perhaps the older
`special_tokens_map.json`) and renders the chat template with jinja2 in the environment that
transformers' `apply_chat_template` uses: a sandbox with `trim_blocks`, `lstrip_blocks`, loop
controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, and the
special tokens (`bos_token`, `eos_token`, ...) as variables. The rendered text is tokenized
without adding special tokens, so `encode_chat(messages)[0]` equals
`apply_chat_template(messages, tokenize=True)["input_ids"]`.

Which tokens are the model's to learn (the assistant mask) is found by rendering prefixes of the
conversation, which works for any template whose rendering of a prefix is a prefix of the whole;
templates need no `{% generation %}` markers (they are accepted and render their body).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
from collections.abc import Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import numpy as np

from tfx.train.tokens import HFTokenizer

__all__ = ["SPECIAL_TOKEN_NAMES", "ChatTokenizer"]

# The named special tokens transformers passes to every template (when the folder sets them).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
# A message's reasoning goes by these names; templates read the first, gpt-oss the second.
_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")


# ---------------------------------------------------------------------------------------------
# The jinja environment


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (TRL's marker of assistant text): the body renders
    unchanged, in its own scope as in transformers. The masks here do not need the marker."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja's `namespace()`, refusing attribute names that start with "_": templates are
    untrusted code and must not reach Python internals through it."""

    def __init__(*args, **kwargs):  # jinja's own signature, so `namespace(self=1)` works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set namespace attributes starting with '_', got {name!r}")


class _DictMaker:
    """The template's `dict`: builds dicts (`dict(a=1)`, `dict.fromkeys(...)`) but is not the type
    itself, so a template cannot reach the class and its subclasses."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys, value=None) -> dict:
        return dict.fromkeys(keys, value)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes <, > and & for HTML, which would change the text a model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_DictMaker(), namespace=_SafeNamespace)
    return env


_ENVIRONMENT = _environment()


# ---------------------------------------------------------------------------------------------
# The folder


def _read_json(file: pathlib.Path) -> dict:
    """The JSON object in `file`, {} when the file is absent."""
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{str(file)!r} is not a readable JSON file ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{str(file)!r} must hold a JSON object, got {type(value).__name__}")
    return value


def _token_string(value, name: str, file: pathlib.Path) -> str | None:
    """A special token as saved: a string, an AddedToken dict {"content": ...}, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{str(file)!r}: {name} must be a string or an AddedToken object "
                     f'{{"content": "..."}}, got {value!r}')


def _config_template(config: dict, file: pathlib.Path) -> str | None:
    """The chat template stored in tokenizer_config.json: a string, or a list of
    {"name", "template"} of which the one named "default" is used."""
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and all(isinstance(t, dict) for t in template):
        named = {t.get("name"): t.get("template") for t in template}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{str(file)!r}: chat_template must be a string or a list of "
                     f'{{"name", "template"}} objects with one named "default", got {template!r}')


class ChatTokenizer(HFTokenizer):
    """A Hugging Face tokenizer folder with its special tokens and chat template.

    Special tokens come from `tokenizer_config.json`, then `special_tokens_map.json` for those it
    lacks; the template from `chat_template.jinja`, else the `chat_template` of
    `tokenizer_config.json` (the older layout), else none.

    Raises:
      ValueError: naming the file, for a missing folder or `tokenizer.json`, unreadable JSON, a
        special token that is not in the vocabulary, or a template that does not compile.
    """

    def __init__(self, folder: str | os.PathLike):
        folder = pathlib.Path(folder)
        if not folder.is_dir():
            raise ValueError(f"ChatTokenizer needs a tokenizer folder, {str(folder)!r} is not one")
        super().__init__(folder)
        self.folder = folder
        config_file = folder / "tokenizer_config.json"
        config = _read_json(config_file)
        legacy_file = folder / "special_tokens_map.json"
        legacy = _read_json(legacy_file)
        self.special_tokens: dict[str, str] = {}  # name -> token, the template's variables
        self._special_ids: dict[str, int] = {}
        for name in SPECIAL_TOKEN_NAMES:
            value, file = config.get(name), config_file
            if value is None:
                value, file = legacy.get(name), legacy_file
            token = _token_string(value, name, file)
            if token is None:
                continue
            token_id = self._tokenizer.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{str(file)!r}: {name} {token!r} is not in the vocabulary of "
                                 f"{str(self.path)!r}")
            self.special_tokens[name], self._special_ids[name] = token, token_id
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            try:
                self.chat_template: str | None = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise ValueError(f"cannot read {str(template_file)!r} ({err})") from err
        else:
            template_file = config_file
            self.chat_template = _config_template(config, config_file)
        self._template = None
        if self.chat_template is not None:
            try:
                self._template = _ENVIRONMENT.from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as err:
                raise ValueError(f"{str(template_file)!r}: the chat template does not compile "
                                 f"(line {err.lineno}: {err.message})") from err

    def __repr__(self) -> str:
        return f"ChatTokenizer({str(self.folder)!r})"

    bos_token = property(lambda self: self.special_tokens.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens.get("eos_token"))
    pad_token = property(lambda self: self.special_tokens.get("pad_token"))
    bos_id = property(lambda self: self._special_ids.get("bos_token"))
    eos_id = property(lambda self: self._special_ids.get("eos_token"))
    pad_id = property(lambda self: self._special_ids.get("pad_token"))

    # -----------------------------------------------------------------------------------------
    # Rendering

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
        """The chat template applied to `messages` (dicts with "role", "content", ...), exactly
        as `apply_chat_template(messages, tokenize=False)` renders it.

        Raises:
          ValueError: when the tokenizer has no template, or the template fails on these messages
            (its `raise_exception(...)`, an undefined value, a type error).
        """
        if self._template is None:
            raise ValueError(
                f"the tokenizer in {str(self.folder)!r} has no chat template (no "
                "chat_template.jinja, no chat_template in tokenizer_config.json); use the "
                '{"prompt": str, "completion": str} format, which works without one')
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not all(
                isinstance(m, dict) for m in messages):
            raise TypeError(f"messages must be a list of dicts, got {messages!r}")
        try:
            return self._template.render(
                messages=[_template_message(m) for m in messages], tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except (jinja2.TemplateError, TypeError) as err:
            raise ValueError(f"the chat template of {str(self.folder)!r} failed: {err}") from err

    # -----------------------------------------------------------------------------------------
    # Tokenizing

    def encode_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = False
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the rendered conversation and the mask of what the assistant says.

        The ids are those of `apply_chat_template(messages, tokenize=True)`: the rendering
        tokenized once, no special tokens added. Assistant message i spans the characters from
        the end of `render(messages[:i], add_generation_prompt=True)` to the end of
        `render(messages[:i + 1])` less trailing whitespace: its content and the turn's end
        marker ("It is four.<|im_end|>"), not the header the generation prompt already wrote nor
        the newline after the marker, which the model never has to produce. A token is masked
        when its first character lies in such a span.

        Returns:
          (ids int32 [n], assistant_mask bool [n]).
        Raises:
          ValueError: as `render`, or when the template is not prefix-stable (renders an earlier
            part of the conversation differently once later messages follow).
        """
        text = self.render(messages, add_generation_prompt=add_generation_prompt)
        spans = [self._span(text, messages[:i], messages[:i + 1])
                 for i, message in enumerate(messages) if message.get("role") == "assistant"]
        return self._encode_spans(text, spans)

    def encode_chat_completion(self, prompt: Sequence[dict], completion: Sequence[dict]
                               ) -> tuple[np.ndarray, np.ndarray]:
        """The conversation `prompt + completion` and the mask of its completion (TRL's
        conversational prompt-completion): ids as `encode_chat(prompt + completion)`, mask True
        on the tokens that start between the end of `render(prompt, add_generation_prompt=True)`
        and the end of the rendering less trailing whitespace.

        Returns:
          (ids int32 [n], completion_mask bool [n]); the masked tokens are contiguous.
        """
        text = self.render([*prompt, *completion])
        return self._encode_spans(text, [self._span(text, prompt, [*prompt, *completion])])

    def encode_completion(self, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
        """The plain format, no template: BOS (when the tokenizer has one) + prompt tokens +
        completion tokens + EOS, as TRL's "standard" prompt-completion rows (which also end in
        EOS, so the model learns to stop). Prompt and completion are tokenized apart, so the
        boundary between them is exact.

        Returns:
          (ids int32 [n], completion_mask bool [n]) with the mask True on the completion tokens
          and the EOS.
        Raises:
          ValueError: when the tokenizer has no eos_token.
        """
        if self.eos_id is None:
            raise ValueError(f"the tokenizer in {str(self.folder)!r} has no eos_token, which "
                             "the prompt-completion format appends to mark the end")
        head = np.asarray([] if self.bos_id is None else [self.bos_id], np.int32)
        prompt_ids = np.concatenate([head, self.encode(prompt)])
        completion_ids = np.append(self.encode(completion), np.int32(self.eos_id))
        ids = np.concatenate([prompt_ids, completion_ids]).astype(np.int32)
        return ids, np.arange(len(ids)) >= len(prompt_ids)

    def _span(self, text: str, before: Sequence[dict], through: Sequence[dict]
              ) -> tuple[int, int]:
        """Characters [start, end) of `text` that `through` adds to the prompt `before`."""
        prompt = self.render(before, add_generation_prompt=True)
        turn = self.render(through).rstrip()
        for part, count in ((prompt, len(before)), (turn, len(through))):
            if not text.startswith(part):
                raise ValueError(
                    f"the chat template of {str(self.folder)!r} is not prefix-stable: the first "
                    f"{count} messages alone render to text ending {part[-60:]!r}, which does "
                    "not begin the whole conversation's rendering, so the answer's tokens "
                    "cannot be found; expected a template that renders earlier turns the same "
                    "whatever follows")
        return len(prompt), max(len(prompt), len(turn))

    def _encode_spans(self, text: str, spans: Sequence[tuple[int, int]]
                      ) -> tuple[np.ndarray, np.ndarray]:
        """`text` tokenized once (no special tokens added) -> (ids int32 [n], mask bool [n]),
        mask True on tokens whose first character lies in one of `spans`."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, np.int32)
        starts = np.asarray([start for start, _ in encoding.offsets], np.int64)
        mask = np.zeros(len(ids), bool)
        for start, end in spans:
            mask |= (starts >= start) & (starts < end)
        return ids, mask


def _template_message(message: dict) -> dict:
    """A copy as transformers hands it to the template: keys whose value is None dropped (many
    templates would print "None"), reasoning under both names templates read."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[k] for k in _REASONING_NAMES if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message
