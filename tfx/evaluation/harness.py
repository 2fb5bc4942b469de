"""`TfxLM`: a tfx decoder as an lm-evaluation-harness model, registered as "tfx".

Importing this module imports lm_eval (`tfx.evaluation` imports it only on first use of
`TfxLM` or `evaluate`). The numbers follow lm-eval's `hf` backend for a causal LM:
- texts are encoded as its `tok_encode` does: the tokenizer's ids, BOS first when
  `add_bos_token` (unless the text already starts with BOS); context / continuation split by
  lm-eval's `TemplateLM` (trailing spaces of the context move to the continuation, the pair is
  encoded whole and split after the context's tokens; an empty context is BOS, else EOS);
- loglikelihood: inputs longer than `max_length` + 1 lose tokens on the left
  (`tfx.evaluation.scoring`);
- loglikelihood_rolling: lm-eval's disjoint rolling windows of `max_length` tokens, the first
  one after the prefix token, summed;
- generate_until: greedy (or sampled with do_sample and a temperature > 0) up to
  `max_gen_toks` new tokens or EOS, the context cut on the left to leave room for them; the text
  is cut at the first stop string (`until`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import jax
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from tfx.evaluation import loading
from tfx.evaluation.scoring import continuation_logprobs
from tfx.generation import generate
from tfx.models.decoder import Decoder

__all__ = ["TfxLM"]

# Keys of a request's gen_kwargs (after lm-eval's normalize_gen_kwargs) that tfx.generate takes.
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p")


def _positive_int(name: str, value) -> int:
    if isinstance(value, str) and value.isdigit():  # --model_args and --batch_size are text
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


@register_model("tfx")
class TfxLM(TemplateLM):
    """A tfx `Decoder` and its tokenizer answering lm-eval's three request types.

    Args:
      model: a tfx Decoder (`tfx.hf.load`, `tfx.train.load_run(...).model`).
      tokenizer: `encode(text) -> int ids` without special tokens, `decode(ids) -> str`
        skipping them (`tfx.train.data.HFTokenizer`, `ByteTokenizer`).
      batch_size: rows per model call.
      max_length: longest model input in tokens; None: the model's `config.max_len`.
      bos_id: the tokenizer's BOS id: the context of an empty context and of the first rolling
        window (else the first EOS), and the first token of every text when add_bos_token.
      eos_id: an id or ids that end generation; the first is lm-eval's end-of-text token.
      add_bos_token: start every encoded text with bos_id (the hf backend's add_bos_token; its
        default is the tokenizer's own, which `from_path` reads).
      max_gen_toks: new tokens when a request's gen_kwargs give none.
      seed: the sampling key of requests with do_sample and a temperature > 0.
    """

    def __init__(self, model: Decoder, tokenizer, *, batch_size: int = 8,
                 max_length: int | None = None, bos_id: int | None = None,
                 eos_id: int | Sequence[int] | None = None, add_bos_token: bool = False,
                 max_gen_toks: int = 256, seed: int = 1234):
        super().__init__()
        if not isinstance(model, Decoder):
            raise ValueError(f"model must be a tfx Decoder, got {type(model).__name__}")
        self.model, self.tokenizer = model, tokenizer
        self._batch_size = _positive_int("batch_size", batch_size)
        self._max_length = _positive_int("max_length", model.config.max_len
                                         if max_length is None else max_length)
        self._max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        vocab = model.config.vocab_size
        ids = [] if eos_id is None else [eos_id] if np.isscalar(eos_id) else list(eos_id)
        for name, values in (("bos_id", [] if bos_id is None else [bos_id]), ("eos_id", ids)):
            if any(isinstance(v, bool) or not isinstance(v, int | np.integer)
                   or not 0 <= v < vocab for v in values):
                raise ValueError(f"{name} must be token ids in [0, {vocab}), got {values!r}")
        if add_bos_token and bos_id is None:
            raise ValueError("add_bos_token=True needs bos_id")
        self.bos_id, self.eos_ids = bos_id, tuple(int(i) for i in ids)
        self.add_bos_token = bool(add_bos_token)
        self._rng = jax.random.key(seed)

    @classmethod
    def from_path(cls, path, *, dtype: str | None = None, add_bos_token: bool | None = None,
                  **kwargs) -> TfxLM:
        """A run workdir or a Hugging Face folder (`tfx.evaluation.loading.load`); kwargs as the
        constructor's. add_bos_token None: the tokenizer's default, as the hf backend."""
        loaded = loading.load(path, dtype=dtype)
        add = loaded.add_bos_token if add_bos_token is None else add_bos_token
        return cls(loaded.model, loaded.tokenizer, bos_id=loaded.bos_id,
                   eos_id=loaded.eos_ids or None, add_bos_token=add, **kwargs)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """lm-eval's `--model tfx --model_args path=...,batch_size=...`."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        # lm-eval passes device and max_batch_size to every model: jax places the model.
        extra = {k: v for k, v in (additional_config or {}).items()
                 if v is not None and k not in ("device", "max_batch_size")}
        args = {**extra, **arg_dict}
        if "path" not in args:
            raise ValueError(f"model_args must name path=RUN_OR_HF_FOLDER, got {arg_dict!r}")
        return cls.from_path(args.pop("path"), **args)

    @property
    def eot_token_id(self) -> int:
        if not self.eos_ids:
            raise ValueError("eos_id: this model has no EOS token; pass eos_id= (or bos_id=)")
        return self.eos_ids[0]

    @property
    def prefix_token_id(self) -> int:
        return self.eot_token_id if self.bos_id is None else self.bos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:
        """Token ids of `string`, BOS first as the hf backend adds it: add_special_tokens, else
        add_bos_token, unless (add_special_tokens None) the text starts with BOS already."""
        ids = [int(t) for t in self.tokenizer.encode(string)]
        add = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if add and self.bos_id is not None and not (add_special_tokens is None
                                                    and ids[:1] == [self.bos_id]):
            ids = [self.bos_id, *ids]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(np.asarray(tokens, np.int64))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """requests: ((context, continuation) or None, context ids, continuation ids)."""
        answers = continuation_logprobs(self.model, [(c, t) for _, c, t in requests],
                                        batch_size=self.batch_size, max_length=self.max_length)
        for (strings, _, _), answer in zip(requests, answers, strict=True):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of log-probs of each whole text, over disjoint windows of max_length tokens."""
        windows, owners = [], []
        for i, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for window in get_rolling_token_windows(tokens, self.prefix_token_id,
                                                    self.max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owners.append(i)
        totals = [0.0] * len(requests)
        answers = continuation_logprobs(self.model, windows, batch_size=self.batch_size,
                                        max_length=self.max_length)
        for owner, (logprob, _) in zip(owners, answers, strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation up to its first stop string (gen_kwargs `until`),
        `max_gen_toks` new tokens or EOS; requests with equal gen_kwargs share batches, longest
        context first."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            key = json.dumps(request.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
        texts: list[str] = [""] * len(requests)
        for indices in groups.values():
            kwargs = dict(normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks))
            # EOS ends a row by its id; the hf backend's EOS stop string is the same stop.
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
            new_tokens = _positive_int("max_gen_toks", kwargs.pop("max_gen_toks"))
            if new_tokens >= self.max_length:
                raise ValueError(f"max_gen_toks ({new_tokens}) must be below max_length "
                                 f"({self.max_length})")
            sampling = self._sampling(kwargs)
            # An empty context starts from the prefix token, as an empty one does in
            # loglikelihood: a decoder needs one token to continue.
            prompts = {i: self.tok_encode(requests[i].args[0],
                                          left_truncate_len=self.max_length - new_tokens)
                       or [self.prefix_token_id] for i in indices}
            order = sorted(indices, key=lambda i: (-len(prompts[i]), requests[i].args[0]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                outs = self._generate([prompts[i] for i in chunk], until, new_tokens, sampling)
                for i, text in zip(chunk, outs, strict=True):
                    texts[i] = postprocess_generated_text(text, until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, texts[i])
        return texts

    def _sampling(self, kwargs: dict) -> dict:
        """tfx.generate's sampling arguments for normalized gen_kwargs."""
        unknown = sorted(set(kwargs) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"gen_kwargs: {unknown} not supported (tfx takes until, "
                             f"max_gen_toks and {', '.join(SAMPLING_KEYS)})")
        temperature = float(kwargs.get("temperature", 0.0))
        if not kwargs.get("do_sample") or temperature == 0.0:
            return {"temperature": 0.0}
        self._rng, key = jax.random.split(self._rng)
        return {"temperature": temperature, "top_k": kwargs.get("top_k"),
                "top_p": kwargs.get("top_p"), "rng": key}

    def _generate(self, prompts: list[list[int]], until: list[str], new_tokens: int,
                  sampling: dict, *, stop_early: bool = True) -> list[str]:
        """The new text of each prompt (left-padded into one batch), before EOS."""
        width = max(map(len, prompts))
        # A short last batch repeats its first prompt: one compiled program per prompt bucket.
        ids = np.zeros((self.batch_size, width), np.int32)
        mask = np.zeros((self.batch_size, width), bool)
        for row, prompt in enumerate(prompts + prompts[:1] * (self.batch_size - len(prompts))):
            ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, True
        # Stop strings as token sequences end rows early; the text is cut at the strings.
        stops = [self.tok_encode(s, add_special_tokens=False) for s in until] if stop_early else []
        tokens, lengths = generate(self.model, ids, attention_mask=mask,
                                   max_new_tokens=new_tokens, eos_token_id=self.eos_ids or None,
                                   stop_sequences=[s for s in stops if s] or None,
                                   return_lengths=True, **sampling)
        texts, redo = [], []
        for row, (out, end) in enumerate(zip(np.asarray(tokens)[:len(prompts)],
                                             np.asarray(lengths)[:len(prompts)], strict=True)):
            new = out[width:end]
            ended_by_eos = len(new) and int(new[-1]) in self.eos_ids
            texts.append(self.tok_decode(new[:-1] if ended_by_eos else new))
            # A stop sequence that began in the prompt (or a stop string that decodes apart from
            # its tokens) can end a row whose text shows no stop string: decode it again whole.
            if len(new) < new_tokens and not ended_by_eos and not any(s and s in texts[-1]
                                                                       for s in until):
                redo.append(row)
        if redo:
            again = self._generate([prompts[r] for r in redo], until, new_tokens, sampling,
                                   stop_early=False)
            for row, text in zip(redo, again, strict=True):
                texts[row] = text
        return texts
