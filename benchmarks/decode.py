"""Greedy decoding speed: tfx.generate (KV cache) vs recomputing without a cache vs transformers.

    python benchmarks/decode.py                      # prompt 64 + 128 new tokens, batch 1 and 8
    python benchmarks/decode.py --quick              # 8 new tokens, 1 repeat: a smoke run
    python benchmarks/decode.py --json r.json --markdown r.md   # keep the numbers

A GPT-2 shaped tfx Decoder (6 layers, width 384, 6 heads, vocab 8192, learned positions, GELU
tanh, tied head, float32) with random weights, exported with `tfx.hf.save` and loaded in
`transformers.GPT2LMHeadModel`, so both sides decode with the same weights. Each batch size:
- tfx: `tfx.generate(model, ids, max_new_tokens=N, temperature=0.0)`, warm (compiled once);
- recompute: one jitted loop that re-runs the whole model on a fixed [batch, prompt + N] buffer
  each step and takes the logits at the current position (causal, so later slots do not matter);
- transformers: `model.generate` (greedy, min_new_tokens = max_new_tokens, no EOS) under
  torch.no_grad, with torch's default thread count;
- weight products: one jitted loop of N steps that each multiply a [batch, in] input by every
  weight matrix of the model once and do nothing else: the products no cached step avoids,
  as XLA compiles them. At batch 1 they are bound by reading the 55 MB of float32 weights
  once per step; "products / transformers" is how low tfx's ratio could go with attention,
  norms, sampling and the loop free;
- products + cache reads: the same loop, each step also attending one query per head over a
  full cache in every layer, as long as tfx.generate's (this prompt's bucket, 64, plus N):
  the bytes a decoder with a cache of static length reads per step (at batch 8 the cache is
  half the weights' bytes). transformers' cache grows, so its steps read only the tokens so far
  (128 slots on average at N = 128).
The five run alternately in this process; times are medians of --repeats runs on the same
prompts. tokens/s counts new tokens of the whole batch (batch * N / seconds). "tfx / transformers"
is a ratio of times: below 1 means tfx is faster (issue 22's goal: <= 0.35). Compile seconds are
what jax.monitoring reports for tracing, lowering and compiling during tfx's first call. The
warm-call check runs generate again with a shorter prompt that falls in the same length bucket
and counts XLA compilations (0 expected).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import pathlib
import statistics
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import markdown_table, provenance, publish

import tfx
import tfx.hf
from tfx.generation import bucket_length
from tfx.models import DecoderConfig, MlpConfig, NormConfig, create
from tfx.ops.attention import cached_attention
from tfx.train.host_memory import keep_freed_memory

CONFIG = DecoderConfig(vocab_size=8192, d_model=384, num_layers=6, num_heads=6, d_ff=4 * 384,
                       max_len=192, position="learned", mlp=MlpConfig(activation="gelu_tanh"),
                       use_bias=True, norm=NormConfig(kind="layer"))
PROMPT_LEN = 64
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileWatch:
    """Counts XLA compilations and sums compile-phase seconds while active, from jax.monitoring;
    names what was compiled from jax's compile log."""

    def __init__(self):
        self.compiles, self.seconds, self.names = 0, 0.0, []

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self.seconds += duration
            self.compiles += event == COMPILE_EVENTS[-1]

    def __enter__(self) -> CompileWatch:
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        self._handler = _NameHandler(self.names)
        logging.getLogger("jax").addHandler(self._handler)
        self._log_compiles = jax.config.jax_log_compiles
        jax.config.update("jax_log_compiles", True)
        return self

    def __exit__(self, *exc) -> None:
        jax.config.update("jax_log_compiles", self._log_compiles)
        logging.getLogger("jax").removeHandler(self._handler)
        jax.monitoring.unregister_event_duration_listener(self._on_duration)


class _NameHandler(logging.Handler):
    """Keeps the function names of jax's "Compiling <name> ..." log records, printing nothing."""

    def __init__(self, names: list):
        super().__init__(logging.DEBUG)
        self.names = names

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.names.append(message.split()[1])


@contextlib.contextmanager
def _quiet_jax_log():
    """jax_log_compiles logs at WARNING through jax's own stderr handler: keep it off screen."""
    logger = logging.getLogger("jax")
    level, propagate = logger.level, logger.propagate
    handlers = [h for h in logger.handlers if not isinstance(h, _NameHandler)]
    for h in handlers:
        logger.removeHandler(h)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield
    finally:
        for h in handlers:
            logger.addHandler(h)
        logger.setLevel(level)
        logger.propagate = propagate


def build_model():
    """The benchmark model with random GPT-2 style weights: matrices N(0, 0.02); norm scales
    1 + N(0, 0.02) and biases N(0, 0.02), so that every parameter matters. Drawn with numpy
    (initialising eagerly in JAX compiles every initialiser on its own: many seconds)."""
    abstract = nnx.eval_shape(lambda: create(CONFIG, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    rng = np.random.default_rng(0)

    def draw(path, x):
        value = rng.normal(0.0, 0.02, x.shape).astype(x.dtype)
        return jnp.asarray(value + 1.0 if jax.tree_util.keystr(path).endswith("['scale'].value")
                           else value)

    model = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, params), rest)
    model.eval()
    return model


@functools.partial(jax.jit, static_argnames=("graphdef", "prompt_len"))
def _recompute(graphdef, state, buffer, *, prompt_len: int):
    """Greedy decoding without a cache: fill buffer[:, prompt_len:] one token at a time, each
    step running the model over the whole buffer. buffer: int32 [batch, total]."""
    model = nnx.merge(graphdef, state)

    def step(i, buffer):
        hidden = model.hidden_states(buffer)
        last = jax.lax.dynamic_index_in_dim(hidden, i - 1, axis=1)  # [batch, 1, d_model]
        token = jnp.argmax(model.logits(last)[:, 0], axis=-1).astype(jnp.int32)
        return buffer.at[:, i].set(token)

    return jax.lax.fori_loop(prompt_len, buffer.shape[1], step, buffer)


def recompute_runner(model, prompts: np.ndarray, new_tokens: int):
    graphdef, state = nnx.split(model)
    buffer = jnp.asarray(np.pad(prompts, ((0, 0), (0, new_tokens))), jnp.int32)
    return lambda: jax.block_until_ready(
        _recompute(graphdef, state, buffer, prompt_len=prompts.shape[1]))


def tfx_runner(model, prompts: np.ndarray, new_tokens: int):
    ids = jnp.asarray(prompts, jnp.int32)
    return lambda: jax.block_until_ready(
        tfx.generate(model, ids, max_new_tokens=new_tokens, temperature=0.0))


def cache_slots(new_tokens: int) -> int:
    """The slots of tfx.generate's cache for this benchmark's prompt: its length bucket, then
    the new tokens."""
    return bucket_length(PROMPT_LEN, CONFIG.max_len - new_tokens) + new_tokens


def products_runner(model, batch: int, new_tokens: int, cache_len: int = 0):
    """`new_tokens` passes over every weight matrix: x [batch, in] @ w [in, out] for each 2-D
    parameter, in one compiled loop (x depends on the step, so XLA cannot hoist the products).
    With cache_len > 0, each pass also reads a full KV cache of cache_len slots in every layer,
    as a decoding step's attention does: one query per head attends over it
    (`tfx.ops.attention.cached_attention`)."""
    matrices = [w for w in jax.tree.leaves(nnx.state(model, nnx.Param)) if w.ndim == 2]
    widest = max(w.shape[0] for w in matrices)
    heads, head_dim = CONFIG.num_heads, CONFIG.d_model // CONFIG.num_heads
    rng = np.random.default_rng(0)
    shape = (2, batch, heads, cache_len, head_dim)  # keys and values of one layer
    caches = [jnp.asarray(rng.standard_normal(shape), jnp.float32)
              for _ in range(CONFIG.num_layers)] if cache_len else []

    @jax.jit
    def run(matrices, caches):
        def step(i, total):
            x = jnp.full((batch, widest), i, matrices[0].dtype)
            query = jnp.full((batch, 1, heads, head_dim), i, jnp.float32)
            reads = sum(jnp.sum(cached_attention(query, key, value)) for key, value in caches)
            return total + reads + sum(jnp.sum(x[:, :w.shape[0]] @ w) for w in matrices)

        return jax.lax.fori_loop(0, new_tokens, step, jnp.float32(0))

    return lambda: jax.block_until_ready(run(matrices, caches))


def torch_runner(hf_model, prompts: np.ndarray, new_tokens: int):
    import torch

    ids = torch.from_numpy(prompts.astype(np.int64))
    mask = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            return hf_model.generate(ids, attention_mask=mask, do_sample=False,
                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     pad_token_id=0)

    return run


def load_transformers(model, folder: pathlib.Path):
    """The same weights in transformers.GPT2LMHeadModel, eval mode, greedy without EOS."""
    import transformers

    transformers.logging.set_verbosity_error()  # GPT2Config's out-of-vocab default EOS note
    transformers.utils.logging.disable_progress_bar()
    tfx.hf.save(model, folder, architecture="GPT2LMHeadModel")
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    # The exported config has no EOS; GPT2Config would default it to 50256 (outside this vocab).
    # Without EOS both sides produce exactly max_new_tokens tokens.
    for config in (hf_model.config, hf_model.generation_config):
        config.eos_token_id = config.bos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    return hf_model


def alternating_medians(runs: dict, repeats: int) -> dict:
    """Median seconds of each runner, timed in turn (a, b, c, a, b, c, ...) so that load from
    elsewhere on the machine falls on all of them alike. Each runner must block."""
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _matching(ours: np.ndarray, theirs: np.ndarray) -> dict:
    """How many new tokens agree, in all and before each row's first difference."""
    same = ours == theirs
    prefix = np.where(same.all(axis=1), same.shape[1], np.argmin(same, axis=1))
    return {"equal": int(same.sum()), "equal_prefix": int(prefix.sum()), "total": same.size}


def measure_batch(args, model, hf_model, batch: int) -> dict:
    import torch

    prompts = np.random.default_rng(batch).integers(0, CONFIG.vocab_size,
                                                    (batch, PROMPT_LEN))
    cache_len = cache_slots(args.new_tokens)
    runs = {"tfx": tfx_runner(model, prompts, args.new_tokens),
            "recompute": recompute_runner(model, prompts, args.new_tokens),
            "transformers": torch_runner(hf_model, prompts, args.new_tokens),
            "products": products_runner(model, batch, args.new_tokens),
            "products_reads": products_runner(model, batch, args.new_tokens, cache_len)}
    with _quiet_jax_log(), CompileWatch() as first:
        start = time.perf_counter()
        ours = np.asarray(runs["tfx"]())[:, PROMPT_LEN:]
        first_call = time.perf_counter() - start
    with _quiet_jax_log(), CompileWatch() as recompute_compile:
        recomputed = np.asarray(runs["recompute"]())[:, PROMPT_LEN:]
    theirs = runs["transformers"]().numpy()[:, PROMPT_LEN:]
    for name in ("products", "products_reads"):  # compiled before the timed runs, as the rest
        runs[name]()
    row = {"batch": batch, "new_tokens": args.new_tokens, "cache_len": cache_len,
           "first_call_s": first_call,
           "compile_s": first.seconds, "compiles_on_first_call": first.compiles,
           "first_call_compiled": first.names,
           "recompute_compile_s": recompute_compile.seconds,
           "tokens_match_transformers": _matching(ours, theirs),
           "tokens_match_recompute": _matching(ours, recomputed)}
    # A warm call with a shorter prompt in the same bucket must reuse the compiled program.
    shorter = jnp.asarray(prompts[:, :PROMPT_LEN - 4], jnp.int32)
    with _quiet_jax_log(), CompileWatch() as warm:
        jax.block_until_ready(tfx.generate(model, shorter, max_new_tokens=args.new_tokens,
                                           temperature=0.0))
    row["compiles_on_warm_call"], row["warm_call_compiled"] = warm.compiles, warm.names
    seconds = alternating_medians(runs, args.repeats)
    tokens = batch * args.new_tokens
    for name, s in seconds.items():
        row[f"{name}_s"] = s
        row[f"{name}_tokens_per_s"] = tokens / s
    row["time_vs_transformers"] = seconds["tfx"] / seconds["transformers"]
    row["recompute_vs_tfx"] = seconds["recompute"] / seconds["tfx"]
    row["products_vs_transformers"] = seconds["products"] / seconds["transformers"]
    row["tfx_vs_products"] = seconds["tfx"] / seconds["products"]
    row["products_reads_vs_transformers"] = (seconds["products_reads"]
                                             / seconds["transformers"])
    row["torch_threads"] = torch.get_num_threads()
    return row


def _line(row: dict) -> str:
    match = row["tokens_match_transformers"]
    return (f"batch {row['batch']}: tfx {row['tfx_tokens_per_s']:8.0f} tok/s  recompute "
            f"{row['recompute_tokens_per_s']:8.0f} tok/s  transformers "
            f"{row['transformers_tokens_per_s']:8.0f} tok/s  tfx/transformers time "
            f"{row['time_vs_transformers']:.2f}  weight products/transformers "
            f"{row['products_vs_transformers']:.2f}  with cache reads "
            f"{row['products_reads_vs_transformers']:.2f}  compile {row['compile_s']:.1f} s "
            f"({row['compiles_on_first_call']} compilations; warm call with prompt "
            f"{PROMPT_LEN - 4}: {row['compiles_on_warm_call']})\n"
            f"  greedy tokens {'match' if match['equal'] == match['total'] else 'DIFFER'}: "
            f"{match['equal']}/{match['total']} equal to transformers "
            f"({match['equal_prefix']} before the first difference per row); recompute "
            f"{row['tokens_match_recompute']['equal']}/{match['total']}")


def kv_cache_bytes(batches, cache_len: int = 192) -> list[dict]:
    """Bytes of `init_cache(batch, cache_len)` with 6 query heads and 6 / 2 / 1 KV heads."""
    rows = []
    for name, kv_heads in (("MHA", 6), ("GQA", 2), ("MQA", 1)):
        model = nnx.eval_shape(
            lambda k=kv_heads: create(CONFIG.replace(attention={"num_kv_heads": k})))
        row = {"attention": name, "num_kv_heads": kv_heads, "cache_len": cache_len}
        for batch in batches:
            row[f"batch_{batch}"] = model.init_cache(batch, cache_len).nbytes
        rows.append(row)
    for row in rows:
        row["saving_vs_mha"] = rows[0][f"batch_{batches[0]}"] / row[f"batch_{batches[0]}"]
    return rows


def render(results: dict) -> str:
    """The markdown report of a results dict (as written by --json)."""
    batches = [results[k] for k in results if k.startswith("batch_")]
    first = batches[0]
    lines = [
        f"Command: `{results['command']}` at revision `{results['revision']}` "
        f"({results['date']}); jax {results['jax']}, torch {results['torch']}, transformers "
        f"{results['transformers']}, {results['cpus']} CPUs, torch threads "
        f"{first['torch_threads']}; load average (1 min) {results['load_average_before'][0]:.1f} "
        f"before, {results['load_average_after'][0]:.1f} after.",
        "",
        f"## Greedy decoding, prompt {PROMPT_LEN} + {first['new_tokens']} new tokens, float32",
        "",
        "GPT-2 shape: 6 layers, width 384, 6 heads, vocab 8192, random weights shared by both "
        "sides through `tfx.hf.save`. Medians of "
        f"{results['repeats']} alternating runs. tokens/s = batch * new tokens / seconds. "
        "tfx / transformers is a ratio of times (issue 22's goal: <= 0.35). Weight products: "
        "every weight matrix multiplied once per new token and nothing else (55 MB of weights "
        "read per step), the part of a step that no cached decoder avoids; + cache reads: the "
        f"same with attention over a full {first['cache_len']}-slot cache in every layer, what a "
        "cache of static length adds. Compile: seconds of tracing, lowering and XLA compilation in "
        "tfx's first call.",
        "",
        markdown_table(
            ["batch", "tfx tokens/s", "recompute tokens/s", "transformers tokens/s",
             "tfx / transformers (time)", "weight products tokens/s",
             "products / transformers", "tfx / products",
             "products + cache reads / transformers", "tfx compile s"],
            [[r["batch"], r["tfx_tokens_per_s"], r["recompute_tokens_per_s"],
              r["transformers_tokens_per_s"], r["time_vs_transformers"],
              r["products_tokens_per_s"], r["products_vs_transformers"], r["tfx_vs_products"],
              r["products_reads_vs_transformers"], r["compile_s"]]
             for r in batches]),
        "",
    ]
    for r in batches:
        match, rec = r["tokens_match_transformers"], r["tokens_match_recompute"]
        lines.append(
            f"- batch {r['batch']}: greedy tokens equal to transformers {match['equal']}/"
            f"{match['total']} ({match['equal_prefix']} before each row's first difference), "
            f"to recompute {rec['equal']}/{rec['total']}; XLA compilations in the first call "
            f"{r['compiles_on_first_call']} ({', '.join(r['first_call_compiled']) or '-'}), "
            f"in a warm call with prompt {PROMPT_LEN - 4} (same bucket) "
            f"{r['compiles_on_warm_call']} ({', '.join(r['warm_call_compiled']) or '-'}).")
    kv = results["kv_cache"]
    cache_batches = [k for k in kv[0] if k.startswith("batch_")]
    lines += ["", f"## KV cache bytes, `model.init_cache(batch, {kv[0]['cache_len']})`, "
                  "width 384, 6 query heads, 6 layers, float32", "",
              markdown_table(["attention", "KV heads",
                              *[f"batch {k.split('_')[1]} (bytes)" for k in cache_batches],
                              "saving vs MHA"],
                             [[r["attention"], r["num_kv_heads"], *[r[k] for k in cache_batches],
                               f"{r['saving_vs_mha']:.0f}x"] for r in kv])]
    return "\n".join(lines) + "\n"


def main() -> None:
    keep_freed_memory()  # as the tfx command does, before JAX starts
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int,
                        help="torch.set_num_threads before measuring (default: torch's own)")
    parser.add_argument("--quick", action="store_true", help="8 new tokens, 1 repeat")
    parser.add_argument("--json", help="write all results to this path")
    parser.add_argument("--markdown", help="write the report to this path")
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.repeats = 8, 1
    if not 1 <= args.new_tokens <= CONFIG.max_len - PROMPT_LEN:
        parser.error(f"--new-tokens must be in [1, {CONFIG.max_len - PROMPT_LEN}]")
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("torch and transformers are needed: pip install -e '.[bench]'")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    results = {**provenance("decode.py"), "repeats": args.repeats,
               "load_average_before": os.getloadavg()}
    model = build_model()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on generation settings
        hf_model = load_transformers(model, pathlib.Path(folder))
        for batch in args.batches:
            row = measure_batch(args, model, hf_model, batch)
            results[f"batch_{batch}"] = row
            print(_line(row), flush=True)
    results["compiles_on_warm_call"] = max(results[f"batch_{b}"]["compiles_on_warm_call"]
                                           for b in args.batches)
    results["load_average_after"] = os.getloadavg()
    results["kv_cache"] = kv_cache_bytes(args.batches)
    results["kv_cache_bytes"] = {r["attention"]: {k: v for k, v in r.items()
                                                  if k.startswith("batch_")}
                                 for r in results["kv_cache"]}
    publish(render(results), results, json_path=args.json, markdown_path=args.markdown)


if __name__ == "__main__":
    main()
