"""Continuous batching over a paged KV cache: `Engine`.

`tfx.generate` runs a fixed batch to its longest request: rows that finished early idle, and a
new request waits for the whole batch. The engine instead keeps up to `max_batch` requests
running and schedules every step on the host: a finished request leaves at once (its pages go
back to the free list) and a waiting one takes its row. Each step is one compiled call
(`tfx.generation._paged_step.paged_step`) of shape [max_batch, chunk] in which running requests
decode one token and newly admitted ones prefill up to `chunk` prompt tokens (chunked prefill:
a longer prompt takes several steps, beside the others' decoding); a step with no prefill uses
the [max_batch, 1] program. So the engine compiles twice, whatever the requests.

Memory: the pool holds `num_pages` pages of `page_size` tokens per layer, shared by all
requests; a request holds ceil((prompt + max_new_tokens - 1) / page_size) pages from admission
to its end (no preemption: a request is admitted only when its pages are free, first come
first served). The last generated token is never fed back, so it needs no slot.

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
from tfx.generation._paged_step import compile_step
from tfx.generation.pages import PageAllocator
from tfx.models.block import dtypes
from tfx.models.decoder import Decoder
from tfx.ops.paged import init_paged_cache

__all__ = ["Engine", "Result"]

PAGED_POSITIONS = ("rope", "learned", "sinusoidal", "none")


@dataclasses.dataclass(frozen=True)
class Result:
    """A finished request.

    request_id: the id `Engine.submit` returned.
    tokens: int32 [n] new tokens, EOS included when it ended the request.
    finish_reason: "eos" or "length" (max_new_tokens reached).
    """

    request_id: int
    tokens: np.ndarray
    finish_reason: str


@dataclasses.dataclass
class _Request:
    """A request's host-side state; `fed` counts prompt tokens already in the cache."""

    id: int
    prompt: np.ndarray
    max_new_tokens: int
    eos: list[int]
    temperature: float
    key: np.ndarray
    pages: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    fed: int = 0

    def feed(self, width: int) -> np.ndarray:
        """The tokens this step brings: the next prompt chunk, or the last new token."""
        if self.fed < len(self.prompt):
            return self.prompt[self.fed:self.fed + width]
        return np.asarray(self.tokens[-1:], np.int32)

    def finish_reason(self) -> str | None:
        if self.tokens and self.tokens[-1] in self.eos:
            return "eos"
        return "length" if len(self.tokens) == self.max_new_tokens else None


class Engine:
    """Serve many generation requests with continuous batching and a paged KV cache.

    >>> engine = Engine(model, num_pages=64, page_size=16, max_batch=8, chunk=64)
    >>> first = engine.submit([1, 2, 3], max_new_tokens=20, temperature=0.0)
    >>> results = engine.run()            # or engine.step() between submissions
    >>> results[0].tokens, results[0].finish_reason

    Args:
      model: a `tfx.models.Decoder` with rotary, learned, sinusoidal or no positions, no
        sliding window, attention pattern, latent attention or leading vectors.
      num_pages: pages in the pool (per layer), int >= 1.
      page_size: tokens per page, int >= 1.
      max_batch: requests running at once (rows of each step), int >= 1.
      chunk: prompt tokens a request prefills per step, int >= 1.
      dtype: of the pool (default: the model's compute dtype, float32 if unset).
    """

    def __init__(self, model: Decoder, *, num_pages: int, page_size: int = 16,
                 max_batch: int = 8, chunk: int = 64, dtype=None):
        _check_model(model)
        config = model.config
        self.page_size = integer("page_size", page_size)
        self.max_batch, self.chunk = integer("max_batch", max_batch), integer("chunk", chunk)
        self.allocator = PageAllocator(integer("num_pages", num_pages))
        self.config, self.max_len = config, config.max_len
        pages_per_seq = math.ceil(self.max_len / self.page_size)
        graphdef, self._state = nnx.split(model)
        self._step = compile_step(graphdef)
        self._cache = init_paged_cache(
            num_layers=config.num_layers, num_pages=num_pages, page_size=self.page_size,
            batch=self.max_batch, pages_per_seq=pages_per_seq, num_kv_heads=config.kv_heads,
            head_dim=config.attention.head_dim or config.d_model // config.num_heads,
            dtype=jnp.dtype(dtype or dtypes(config)["dtype"] or jnp.float32),
            stacked=config.compute.scan_layers)
        self._page_table = np.full((self.max_batch, pages_per_seq), -1, np.int32)
        self._next_position = np.zeros(self.max_batch, np.int32)
        self._rows: list[_Request | None] = [None] * self.max_batch
        self._waiting: collections.deque[_Request] = collections.deque()
        self._next_id = 0

    @property
    def pool_bytes(self) -> int:
        """Bytes of the page pools, all layers."""
        return self._cache.nbytes

    @property
    def num_programs(self) -> int:
        """Programs compiled so far for the steps (at most 2: [max_batch, chunk] and
        [max_batch, 1])."""
        return self._step._cache_size()

    @property
    def num_pending(self) -> int:
        """Requests submitted and not finished (waiting or running)."""
        return len(self._waiting) + sum(row is not None for row in self._rows)

    def submit(self, prompt, *, max_new_tokens: int, eos_token_id=None,
               temperature: float = 0.0, rng: jax.Array | None = None) -> int:
        """Queue a request; it joins the running batch at a later `step`.

        Args:
          prompt: int [prompt_len >= 1] token ids in [0, vocab_size) (list or array).
          max_new_tokens: int >= 1; prompt_len + max_new_tokens <= the model's max_len.
          eos_token_id: token id(s) that end the request (included in its tokens), or None.
          temperature: 0.0 greedy; > 0 samples from softmax(logits / temperature).
          rng: a jax.random key (typed, or raw uint32 [2]), required when temperature > 0.
        Returns:
          the request id (0, 1, 2, ... in submission order).
        Raises:
          ValueError: for a bad argument, or a request that can never fit the model's max_len
            or the pool, before it is queued.
        """
        config = self.config
        ids, _ = prompt_and_mask([prompt] if np.ndim(prompt) == 1 else prompt, None,
                                 config.vocab_size)
        if ids.shape[0] != 1:
            raise ValueError(f"prompt must be one sequence of ids [prompt_len], got shape "
                             f"{np.shape(prompt)}")
        max_new_tokens = integer("max_new_tokens", max_new_tokens)
        temperature = real("temperature", temperature, low=0.0, hint=" (0 is greedy)")
        if ids.shape[1] + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens "
                             f"({max_new_tokens}) exceeds the model's max_len ({self.max_len})")
        request = _Request(self._next_id, ids[0].astype(np.int32), max_new_tokens,
                           token_ids("eos_token_id", eos_token_id, config.vocab_size),
                           temperature, _key_data(rng, temperature))
        if self._pages_needed(request) > self.allocator.num_pages:
            raise ValueError(f"the request needs {self._pages_needed(request)} pages of "
                             f"{self.page_size} tokens, more than the pool's num_pages "
                             f"({self.allocator.num_pages})")
        self._waiting.append(request)
        self._next_id += 1
        return request.id

    def step(self) -> list[Result]:
        """Admit waiting requests that fit, run one compiled step, retire finished requests.
        Returns the requests that finished in this step (none when nothing is running)."""
        self._admit()
        running = [(row, r) for row, r in enumerate(self._rows) if r is not None]
        if not running:
            return []
        width = self.chunk if any(len(r.prompt) - r.fed > 1 for _, r in running) else 1
        ids = np.zeros((self.max_batch, width), np.int32)
        fed = np.zeros(self.max_batch, np.int32)
        for row, request in running:
            tokens = request.feed(width)
            ids[row, :len(tokens)], fed[row] = tokens, len(tokens)
        chosen = self._call(ids, fed, running)
        self._next_position += fed
        finished = []
        for row, request in running:
            request.fed = min(request.fed + int(fed[row]), len(request.prompt))
            if request.fed == len(request.prompt):  # prompt done: the token is a new one
                request.tokens.append(int(chosen[row]))
            if (reason := request.finish_reason()) is not None:
                finished.append(self._retire(row, request, reason))
        return finished

    def run(self, *, progress: bool = False) -> list[Result]:
        """Step until every submitted request has finished; their results by request id.
        progress: show a tqdm bar of finished requests."""
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.num_pending, unit="request")
        results = []
        while self.num_pending:
            done = self.step()
            results.extend(done)
            if bar is not None:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        return sorted(results, key=lambda result: result.request_id)

    def generate(self, prompts, *, max_new_tokens, eos_token_id=None, temperature: float = 0.0,
                 rng: jax.Array | None = None, progress: bool = False) -> list[Result]:
        """Submit `prompts` (a list of id sequences) and run them all; results in prompt order.

        max_new_tokens: one int for all, or one per prompt. rng: one key, split per prompt
        (required when temperature > 0). Other arguments as in `submit`."""
        if not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError("prompts must be a non-empty list of token id sequences")
        counts = ([max_new_tokens] * len(prompts) if np.ndim(max_new_tokens) == 0
                  else list(max_new_tokens))
        if len(counts) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(counts)} entries for {len(prompts)} "
                             "prompts")
        keys = [None] * len(prompts) if rng is None else list(jax.random.split(rng, len(prompts)))
        ids = [self.submit(prompt, max_new_tokens=count, eos_token_id=eos_token_id,
                           temperature=temperature, rng=key)
               for prompt, count, key in zip(prompts, counts, keys, strict=True)]
        mine = set(ids)
        return [r for r in self.run(progress=progress) if r.request_id in mine]

    def _pages_needed(self, request: _Request) -> int:
        return math.ceil((len(request.prompt) + request.max_new_tokens - 1) / self.page_size)

    def _admit(self) -> None:
        """Move waiting requests into free rows while their pages are free (in order)."""
        for row in range(self.max_batch):
            if not self._waiting:
                return
            request = self._waiting[0]
            if self._rows[row] is not None:
                continue
            if self._pages_needed(request) > self.allocator.num_free:
                return
            self._waiting.popleft()
            request.pages = self.allocator.allocate(self._pages_needed(request))
            self._page_table[row, :len(request.pages)] = request.pages
            self._rows[row] = request

    def _call(self, ids: np.ndarray, fed: np.ndarray, running) -> np.ndarray:
        """The compiled step on this step's tokens; the token chosen for each row."""
        temperature = np.zeros(self.max_batch, np.float32)
        keys = np.zeros((self.max_batch, 2), np.uint32)
        counts = np.zeros(self.max_batch, np.int32)
        for row, request in running:
            temperature[row], keys[row] = request.temperature, request.key
            counts[row] = len(request.tokens)
        cache = dataclasses.replace(self._cache, page_table=self._page_table.copy(),
                                    next_position=self._next_position.copy())
        valid = np.arange(ids.shape[1])[None, :] < fed[:, None]
        chosen, self._cache = self._step(self._state, cache, ids, valid, temperature, keys,
                                         counts)
        return np.asarray(chosen)

    def _retire(self, row: int, request: _Request, reason: str) -> Result:
        """Free a finished request's row and pages."""
        self.allocator.release(request.pages)
        self._page_table[row] = -1
        self._next_position[row] = 0
        self._rows[row] = None
        return Result(request.id, np.asarray(request.tokens, np.int32), reason)


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
    if model.embeddings.num_leading:
        problems.append("leading vectors")
    if problems:
        raise ValueError("the paged cache cannot serve this model: it has "
                         + ", ".join(problems))


def _key_data(rng, temperature: float) -> np.ndarray:
    """A request's key as raw uint32 [2] (zeros for a greedy request without one)."""
    if rng is None:
        if temperature > 0:
            raise ValueError("rng must be a jax.random key when temperature > 0 "
                             "(temperature=0.0 decodes greedily)")
        return np.zeros(2, np.uint32)
    if jnp.issubdtype(getattr(rng, "dtype", None), jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    data = np.asarray(rng)
    if data.shape != (2,) or data.dtype != np.uint32:
        raise ValueError(f"rng must be a jax.random key (threefry, raw uint32 [2]), got "
                         f"{getattr(rng, 'shape', rng)!r}")
    return data
