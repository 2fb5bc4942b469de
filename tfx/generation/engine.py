"""Continuous batching over a paged KV cache: `Engine`.

`tfx.generate` runs a fixed batch to its longest request: rows that finished early idle, and a
new request waits for the whole batch. The engine instead keeps up to `max_batch` requests
running and schedules every step on the host: a finished request leaves at once (its pages go
back to the free list) and a waiting one takes its row. A step makes up to two compiled calls
(`tfx.generation._paged_step.paged_step`) over the shared page pools: up to `prefill_rows`
requests still reading their prompt feed their next `chunk` prompt tokens ([prefill_rows,
chunk]: chunked prefill, a longer prompt takes several steps), and every other running request
decodes one token ([max_batch, 1]). Decoding rows never pay for the prefill's width, and a
prompt never waits for the decoders. So the engine compiles twice, whatever the requests.

Memory: the pool holds `num_pages` pages of `page_size` tokens per layer, shared by all
requests; a request holds ceil((prompt + max_new_tokens - 1) / page_size) pages from admission
to its end (no preemption: a request is admitted only when its pages are free, first come
first served). The last generated token is never fed back, so it needs no slot. With
`prefix_cache`, full pages of prompt tokens stay cached after their request and a later
request whose prompt starts with the same pages (and variant) takes them instead of new ones,
reading from its first uncached token on (`tfx.generation.prefix_cache`).

A hybrid model's linear-attention layers (Gated DeltaNet) hold no pages: each keeps one
fixed-size state per row, emptied when a request takes the row. Their state after a prefix
cannot be read back from shared pages, so prefix caching is refused for them.

Greedy requests produce exactly the tokens of `tfx.generate(model, prompt, temperature=0.0)`
run alone; sampled ones draw from their own `rng`, folded with the token index, so their
tokens do not depend on the other requests.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tfx.generation._inputs import integer, prompt_and_mask, real, token_ids
from tfx.generation._paged_step import RowSettings, compile_step
from tfx.generation.pages import PageAllocator
from tfx.generation.prefix_cache import PrefixCache, page_keys
from tfx.generation.requests import Request, Result, key_data
from tfx.models.block import dtypes
from tfx.models.decoder import Decoder
from tfx.ops.paged import init_paged_cache

__all__ = ["Engine", "Result"]

PAGED_POSITIONS = ("rope", "learned", "sinusoidal", "none")


class Engine:
    """Serve many generation requests with continuous batching and a paged KV cache.

    >>> engine = Engine(model, num_pages=64, page_size=16, max_batch=8, chunk=64)
    >>> first = engine.submit([1, 2, 3], max_new_tokens=20, temperature=0.0)
    >>> results = engine.run()            # or engine.step() between submissions
    >>> results[0].tokens, results[0].finish_reason

    A finished request's `Result` is kept until `run()` returns it or `pop_result(id)` takes
    it, whichever `step()` finished it; `cancel(id)` drops a request at once, its pages freed.

    Args:
      model: a `tfx.models.Decoder` with rotary, learned, sinusoidal or no positions, no
        sliding window, attention pattern, latent attention or leading vectors; its
        linear-attention layers (a hybrid model) keep one state per row instead of pages.
      num_pages: pages in the pool (per attention layer), int >= 1.
      page_size: tokens per page, int >= 1.
      max_batch: requests running at once (rows of each step), int >= 1.
      chunk: prompt tokens a request prefills per step, int >= 1.
      prefill_rows: requests that prefill in one step, in [1, max_batch] (default
        max_batch // 4, at least 1).
      dtype: of the pool (default: the model's compute dtype, float32 if unset).
      prefix_cache: keep full pages of prompts for later requests with the same prefix (not
        for a model with linear-attention layers).
      variants: weight variants the model holds (`tfx.nn.row_variants`, e.g. LoRA adapters
        attached with `tfx.peft.multi_lora`, 0 = the base weights): a request's `variant` is
        below this; 1 for a plain model.
    """

    def __init__(self, model: Decoder, *, num_pages: int, page_size: int = 16,
                 max_batch: int = 8, chunk: int = 64, prefill_rows: int | None = None,
                 dtype=None, variants: int = 1, prefix_cache: bool = False):
        _check_model(model)
        config = model.config
        self.page_size = integer("page_size", page_size)
        self.max_batch, self.chunk = integer("max_batch", max_batch), integer("chunk", chunk)
        self.prefill_rows = integer("prefill_rows", max(1, self.max_batch // 4)
                                    if prefill_rows is None else prefill_rows)
        if self.prefill_rows > self.max_batch:
            raise ValueError(f"prefill_rows must be in [1, max_batch = {self.max_batch}], got "
                             f"{prefill_rows}")
        self.variants = integer("variants", variants)
        self.allocator = PageAllocator(integer("num_pages", num_pages))
        self._pages = PrefixCache(self.allocator, enabled=prefix_cache)
        self.config, self.max_len = config, config.max_len
        pages_per_seq = math.ceil(self.max_len / self.page_size)
        graphdef, self._state = nnx.split(model)
        self._step = compile_step(graphdef)
        linear = sum(config.layer_type(i) == "linear" for i in range(config.num_layers))
        if linear and prefix_cache:
            raise ValueError("prefix_cache must be False for a model with linear-attention "
                             "layers: their state after a prefix is not in the shared pages")
        dtype = jnp.dtype(dtype or dtypes(config)["dtype"] or jnp.float32)
        self._cache = init_paged_cache(
            num_layers=max(config.num_layers - linear, 1), num_pages=num_pages,
            page_size=self.page_size, batch=self.max_batch, pages_per_seq=pages_per_seq,
            num_kv_heads=config.kv_heads,
            head_dim=config.attention.head_dim or config.d_model // config.num_heads,
            dtype=dtype, stacked=config.compute.scan_layers)
        if linear:  # one state per row of the engine, beside the attention layers' pools
            self._cache = model.with_linear_states(self._cache, self.max_batch, dtype)
        self._page_table = np.full((self.max_batch, pages_per_seq), -1, np.int32)
        self._next_position = np.zeros(self.max_batch, np.int32)
        self._rows: list[Request | None] = [None] * self.max_batch
        self._waiting: collections.deque[Request] = collections.deque()
        self._finished: dict[int, Result] = {}
        self._next_id = 0

    @property
    def pool_bytes(self) -> int:
        """Bytes of the page pools, all attention layers."""
        return self._cache.nbytes - self._cache.state_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of the linear-attention layers' states, one per row (0 without such
        layers)."""
        return self._cache.state_bytes

    @property
    def num_programs(self) -> int:
        """Programs compiled so far for the steps (at most 2: [max_batch, chunk] and
        [max_batch, 1])."""
        return self._step._cache_size()

    @property
    def num_free_pages(self) -> int:
        """Pages a new request could take (free, or cached prefixes that no request holds)."""
        return self._pages.num_free

    @property
    def num_pending(self) -> int:
        """Requests submitted and not finished (waiting or running)."""
        return len(self._waiting) + sum(row is not None for row in self._rows)

    def submit(self, prompt, *, max_new_tokens: int, eos_token_id=None,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               rng: jax.Array | None = None, variant: int = 0) -> int:
        """Queue a request; it joins the running batch at a later `step`.

        Args:
          prompt: int [prompt_len >= 1] token ids in [0, vocab_size) (list or array).
          max_new_tokens: int >= 1; prompt_len + max_new_tokens <= the model's max_len.
          eos_token_id: token id(s) that end the request (included in its tokens), or None.
          temperature: 0.0 greedy; > 0 samples from softmax(logits / temperature).
          top_k: sample among the k most likely tokens (int >= 1), or None.
          top_p: sample within the nucleus of probability top_p (in (0, 1]), or None.
          rng: a jax.random key (typed, or raw uint32 [2]), required when temperature > 0.
          variant: the weight variant of the request, in [0, variants).
        Returns:
          the request id (0, 1, 2, ... in submission order).
        Raises:
          ValueError: for a bad argument, or a request that can never fit the model's max_len
            or the pool, before it is queued.
        """
        config = self.config
        prompt = np.asarray(prompt) if isinstance(prompt, list | tuple) else prompt
        ids, _ = prompt_and_mask(prompt[None] if np.ndim(prompt) == 1 else prompt, None,
                                 config.vocab_size)  # numpy on the host: no device round trip
        if ids.shape[0] != 1:
            raise ValueError(f"prompt must be one sequence of ids [prompt_len], got shape "
                             f"{np.shape(prompt)}")
        max_new_tokens = integer("max_new_tokens", max_new_tokens)
        temperature = real("temperature", temperature, low=0.0, hint=" (0 is greedy)")
        if ids.shape[1] + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens "
                             f"({max_new_tokens}) exceeds the model's max_len ({self.max_len})")
        request = Request(
            self._next_id, ids[0].astype(np.int32), max_new_tokens,
            token_ids("eos_token_id", eos_token_id, config.vocab_size), temperature,
            config.vocab_size if top_k is None else integer("top_k", top_k),
            1.0 if top_p is None else real("top_p", top_p, low=0.0, high=1.0, open_low=True),
            key_data(rng, temperature), self._variant(variant))
        if self._pages.enabled:
            request.keys = page_keys(request.prompt, request.variant, self.page_size)
        if self._pages_needed(request) > self.allocator.num_pages:
            raise ValueError(f"the request needs {self._pages_needed(request)} pages of "
                             f"{self.page_size} tokens, more than the pool's num_pages "
                             f"({self.allocator.num_pages})")
        self._waiting.append(request)
        self._next_id += 1
        return request.id

    def step(self) -> list[Result]:
        """Admit waiting requests that fit, prefill and decode once, retire finished requests.
        Returns the requests that finished in this step (none when nothing is running)."""
        self._admit()
        running = [(row, r) for row, r in enumerate(self._rows) if r is not None]
        prefilling = [(row, r) for row, r in running if len(r.prompt) - r.fed > 1]
        decoding = [(row, r) for row, r in running if len(r.prompt) - r.fed <= 1]
        finished = []
        if prefilling:
            finished += self._feed(prefilling[:self.prefill_rows], self.prefill_rows, self.chunk)
        if decoding:  # the last prompt token or the last new token
            finished += self._feed(decoding, self.max_batch, 1)
        self._finished.update((result.request_id, result) for result in finished)
        return finished

    def run(self, *, progress: bool = False) -> list[Result]:
        """Step until every submitted request has finished; every result not taken yet (those
        that earlier `step()` calls finished included), by request id.
        progress: show a tqdm bar of finished requests."""
        self._step_until(lambda: not self.num_pending, progress)
        results = sorted(self._finished.values(), key=lambda result: result.request_id)
        self._finished.clear()
        return results

    def pop_result(self, request_id: int) -> Result:
        """Take the result of a finished request (ValueError if it has not finished, or was
        taken or cancelled)."""
        if request_id not in self._finished:
            raise ValueError(f"request {request_id!r} has no result to take (not finished, "
                             "already taken, cancelled or never submitted)")
        return self._finished.pop(request_id)

    def tokens_so_far(self, request_id: int) -> tuple[list[int], list[float]]:
        """(new tokens, their log-probabilities) of a waiting or running request: what a
        streaming client has not been sent yet is the tail."""
        request = self._find(request_id)
        if request is None:
            raise ValueError(f"request {request_id!r} is not waiting or running")
        return list(request.tokens), list(request.logprobs)

    def cancel(self, request_id: int) -> bool:
        """Drop a request (waiting, running or finished and not taken): its pages are free at
        once and no result is kept. Returns False when there was nothing to drop."""
        if self._finished.pop(request_id, None) is not None:
            return True
        for request in self._waiting:
            if request.id == request_id:
                self._waiting.remove(request)
                return True
        for row, request in enumerate(self._rows):
            if request is not None and request.id == request_id:
                self._retire(row, request, "cancelled")
                return True
        return False

    def generate(self, prompts, *, max_new_tokens, eos_token_id=None, temperature: float = 0.0,
                 rng: jax.Array | None = None, progress: bool = False,
                 **settings) -> list[Result]:
        """Submit `prompts` (a list of id sequences) and run them all; results in prompt order.

        max_new_tokens: one int for all, or one per prompt. rng: one key, split per prompt
        (required when temperature > 0). Other arguments (and `settings`: top_k, top_p,
        variant) as in `submit`."""
        if not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError("prompts must be a non-empty list of token id sequences")
        counts = ([max_new_tokens] * len(prompts) if np.ndim(max_new_tokens) == 0
                  else list(max_new_tokens))
        if len(counts) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(counts)} entries for {len(prompts)} "
                             "prompts")
        keys = [None] * len(prompts) if rng is None else list(jax.random.split(rng, len(prompts)))
        ids = [self.submit(prompt, max_new_tokens=count, eos_token_id=eos_token_id,
                           temperature=temperature, rng=key, **settings)
               for prompt, count, key in zip(prompts, counts, keys, strict=True)]
        self._step_until(lambda: all(i in self._finished for i in ids), progress)
        return [self.pop_result(request_id) for request_id in ids]

    def _step_until(self, done, progress: bool) -> None:
        """Step until `done()`; with `progress`, a tqdm bar of the requests that finish."""
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.num_pending, unit="request")
        while not done():
            finished = self.step()
            if bar is not None:
                bar.update(len(finished))
        if bar is not None:
            bar.close()

    def _variant(self, variant) -> int:
        if isinstance(variant, bool) or not isinstance(variant, int | np.integer) \
                or not 0 <= variant < self.variants:
            raise ValueError(f"variant must be an int in [0, {self.variants}) (the engine's "
                             f"variants), got {variant!r}")
        return int(variant)

    def _find(self, request_id: int) -> Request | None:
        running = (request for request in self._rows if request is not None)
        return next((request for request in (*self._waiting, *running)
                     if request.id == request_id), None)

    def _pages_needed(self, request: Request) -> int:
        return math.ceil((len(request.prompt) + request.max_new_tokens - 1) / self.page_size)

    def _admit(self) -> None:
        """Move waiting requests into free rows while their pages are free (in order)."""
        for row in range(self.max_batch):
            if not self._waiting:
                return
            request = self._waiting[0]
            if self._rows[row] is not None:
                continue
            admitted = self._pages.admit(request.keys, self._pages_needed(request))
            if admitted is None:
                return
            self._waiting.popleft()
            request.pages, shared = admitted
            request.fed = request.cached = shared * self.page_size
            self._page_table[row, :len(request.pages)] = request.pages
            self._next_position[row] = request.fed
            self._rows[row] = request

    def _feed(self, group: list[tuple[int, Request]], size: int, width: int) -> list[Result]:
        """One compiled call of shape [size, width] for `group` (row, request), packed into its
        first rows; each request takes its token once its prompt is read. Returns those that
        finished."""
        ids, fed = np.zeros((size, width), np.int32), np.zeros(size, np.int32)
        rows = np.asarray([row for row, _ in group])
        fresh = np.zeros(size, bool)  # a request's first tokens start from empty states
        for slot, (_, request) in enumerate(group):
            tokens = request.feed(width)
            ids[slot, :len(tokens)], fed[slot] = tokens, len(tokens)
            fresh[slot] = request.fed == 0
        chosen, logprobs = self._call(ids, fed, rows, fresh,
                                      [request for _, request in group])
        self._next_position[rows] += fed[:len(group)]
        finished = []
        for slot, (row, request) in enumerate(group):
            reading = request.fed < len(request.prompt)
            request.fed = min(request.fed + int(fed[slot]), len(request.prompt))
            if reading:  # its newly written full prompt pages become shareable
                self._pages.register(request.keys, request.pages, request.fed, self.page_size)
            if request.fed == len(request.prompt):  # prompt done: the token is a new one
                request.tokens.append(int(chosen[slot]))
                request.logprobs.append(float(logprobs[slot]))
            if (reason := request.finish_reason()) is not None:
                finished.append(self._retire(row, request, reason))
        return finished

    def _call(self, ids: np.ndarray, fed: np.ndarray, rows: np.ndarray, fresh: np.ndarray,
              requests: list[Request]) -> tuple[np.ndarray, np.ndarray]:
        """The compiled step on ids [size, width] of `requests` (in rows `rows` of the page
        table, packed in that order; `fresh` bool [size] those that begin); each slot's chosen
        token and its log-probability."""
        size = ids.shape[0]
        settings = {name: np.zeros(size, dtype) for name, dtype in (
            ("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32),
            ("counts", np.int32), ("variants", np.int32))}
        keys = np.zeros((size, 2), np.uint32)
        for slot, request in enumerate(requests):
            for name, value in (("temperature", request.temperature), ("top_k", request.top_k),
                                ("top_p", request.top_p), ("counts", len(request.tokens)),
                                ("variants", request.variant)):
                settings[name][slot] = value
            keys[slot] = request.key
        page_table = np.full((size, self._page_table.shape[1]), -1, np.int32)
        next_position = np.zeros(size, np.int32)
        page_table[:len(rows)], next_position[:len(rows)] = (self._page_table[rows],
                                                             self._next_position[rows])
        cache = dataclasses.replace(self._cache, page_table=page_table,
                                    next_position=next_position)
        valid = np.arange(ids.shape[1])[None, :] < fed[:, None]
        state_rows = np.full(size, self.max_batch, np.int32)  # unused slots: no row
        state_rows[:len(rows)] = rows
        chosen, logprobs, self._cache = self._step(
            self._state, cache, ids, valid,
            RowSettings(keys=keys, state_rows=state_rows, fresh=fresh, **settings))
        return np.asarray(chosen), np.asarray(logprobs)

    def _retire(self, row: int, request: Request, reason: str) -> Result:
        """Free a finished (or cancelled) request's row and pages."""
        self._pages.release(request.pages)
        self._page_table[row] = -1
        self._next_position[row] = 0
        self._rows[row] = None
        return request.result(reason)


def _check_model(model) -> None:
    """Refuse what a paged cache cannot serve, naming it."""
    if not isinstance(model, Decoder):
        raise TypeError(f"model must be a tfx Decoder, got {type(model).__name__}")
    c = model.config
    problems = []
    if c.position not in PAGED_POSITIONS:
        problems.append(f"position={c.position!r} (paged attention has no score bias; "
                        f"supported: {PAGED_POSITIONS})")
    if any(c.layer_type(i) == "sliding" for i in range(c.num_layers)):
        problems.append("sliding-window layers")
    if c.attention.pattern is not None:
        problems.append("an attention pattern")
    if c.latent is not None:
        problems.append("latent attention (its cache holds latents, not keys and values)")
    if c.layer_heads("full") != c.layer_heads("sliding"):  # the pools have one page shape
        problems.append("attention.full_head_dim / full_kv_heads (wider full layers)")
    if model.embeddings.num_leading:
        problems.append("leading vectors")
    if problems:
        raise ValueError("the paged cache cannot serve this model: it has "
                         + ", ".join(problems))

