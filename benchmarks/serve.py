"""OpenAI-compatible serving over HTTP: `tfx serve` vs `transformers serve`, same folder, same
requests, streamed through the `openai` client.

    python benchmarks/serve.py                     # 64 requests at concurrency 1, 4 and 16
    python benchmarks/serve.py --quick             # 16 requests, concurrency 1 and 16: a smoke run
    python benchmarks/serve.py --only transformers # one side (tfx: `tfx serve` must exist)
    python benchmarks/serve.py --json benchmarks/results/serve.json   # also writes .md

One checkpoint: the tiny random LLaMA of experiments/tiny_chat_model.py (`chat_model_folder`: 2
layers, width 64, 4 heads with 2 KV heads, untied head, a ~400-token byte-level BPE and a ChatML
template), rewritten with max_position_embeddings 1024 and the head rows of every special token
set to zero: their logits are exactly 0 while the largest of ~400 random logits is positive, so
greedy decoding never picks EOS and each request produces its max_tokens (both sides report
`usage.completion_tokens`, which is what is counted). Four LoRA adapters of that model made by
peft (r 8, alpha 16, q_proj and v_proj, lora_B drawn from N(0, 0.02) with seeds 1-4,
`save_pretrained`).

Each server is a child process on a free loopback port, ready when GET /health answers 200:
- tfx: `python -m tfx serve FOLDER --host 127.0.0.1 --port P --max-batch 16` (paged KV cache,
  continuous batching), with `--adapter aI=DIR` for the adapter rows;
- transformers: `transformers serve FOLDER --continuous-batching --device cpu --dtype float32`
  (its paged continuous batching; --no-hf-cb for its default one-request-at-a-time path).

Load: --requests chat requests from a fixed seed, each one user turn of 2 to --max-prompt words
(prompt tokens are reported) and max_tokens uniform in 8..--max-new, temperature 0, streamed
(`stream_options.include_usage`). At each concurrency C, C client tasks take the requests in
order (an `asyncio.Semaphore`); requests/s and output tokens/s are over the wall time of the
whole set, TTFT runs from sending a request to its first content chunk. Before timing, each
server answers --warmup requests of every shape bucket (tfx compiles then). Every figure is the
median of --repeats passes of the whole set. "tfx / transformers" divides output tokens/s at the
same concurrency (issue goal at 16: >= 3); TTFT p95 is compared beside it.
Adapters: the tfx server started with 4 adapters runs the same set at concurrency 16 twice per
repeat: every request to a0, and the requests spread round-robin over a0-a3 (goal: spread /
one >= 0.8).
The benchmark process runs the client on the same 2 CPU cores as the server: both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
from timing import add_output_arguments, markdown_path, markdown_table, provenance, publish

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "experiments"))
MAX_POSITIONS, MAX_BATCH, ADAPTERS = 1024, 16, 4
SIDES = ("tfx", "transformers")
# --model small: serving.py's char-gpt shape, so that the model's work outweighs HTTP and the
# client's parsing (tiny: tiny_chat_model's own fields).
SIZES = {"tiny": {}, "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2)}


# --- inputs -------------------------------------------------------------------------------


def write_checkpoint(root: pathlib.Path, size: str) -> dict:
    """The chat folder (EOS never greedy, 1024 positions) and 4 peft LoRA adapters of it."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from tiny_chat_model import SPECIALS, chat_model_folder

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    folder = chat_model_folder(torch, transformers, root / "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if size == "tiny":
        model = transformers.LlamaForCausalLM.from_pretrained(folder)
    else:  # the same tokenizer and template, a wider model
        config = transformers.LlamaConfig.from_pretrained(folder)
        for field, value in SIZES[size].items():
            setattr(config, field, value)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    model.config.max_position_embeddings = MAX_POSITIONS
    with torch.no_grad():
        for token in SPECIALS:
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(token)] = 0.0
    model.save_pretrained(folder)
    adapters = {}
    for i in range(ADAPTERS):
        base = transformers.LlamaForCausalLM.from_pretrained(folder)
        peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16,
                                                     target_modules=["q_proj", "v_proj"]))
        torch.manual_seed(i + 1)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(param, std=0.02)
        adapters[f"a{i}"] = root / f"a{i}"
        peft_model.save_pretrained(adapters[f"a{i}"])
    return {"folder": folder, "adapters": adapters}


def workload(count: int, max_prompt: int, max_new: int, seed: int = 0):
    """`count` (user text of 2..max_prompt words, max_tokens 8..max_new) pairs."""
    from tiny_chat_model import CORPUS

    words = " ".join(CORPUS).split()
    rng = np.random.default_rng(seed)
    return [(" ".join(rng.choice(words, rng.integers(2, max_prompt + 1))),
             int(rng.integers(8, max_new + 1))) for _ in range(count)]


# --- servers ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(side: str, folder: pathlib.Path, port: int, adapters: dict,
                   hf_cb: bool) -> list[str]:
    if side == "tfx":
        command = [sys.executable, "-m", "tfx", "serve", str(folder), "--host", "127.0.0.1",
                   "--port", str(port), "--max-batch", str(MAX_BATCH)]
        for name, path in adapters.items():
            command += ["--adapter", f"{name}={path}"]
        return command
    return ["transformers", "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", "--dtype", "float32", "--log-level", "warning",
            "--continuous-batching" if hf_cb else "--no-continuous-batching"]


@contextlib.contextmanager
def server(command: list[str], port: int, log: pathlib.Path, timeout: float = 300.0):
    """Start `command` (its own process group), wait until /health answers 200, yield its base
    URL; always stop it: SIGTERM to its group, then SIGKILL after 15 seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env=env, start_new_session=True)
    start = time.perf_counter()
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[:4]} exited ({process.returncode}):\n"
                                   + log.read_text()[-3000:])
            with (contextlib.suppress(OSError),
                  urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r):
                if r.status == 200:
                    break
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"{command[:4]} not ready after {timeout:.0f} s:\n"
                                   + log.read_text()[-3000:])
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1", time.perf_counter() - start
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# --- load ---------------------------------------------------------------------------------


async def one_request(client, model: str, text: str, max_tokens: int) -> dict:
    sent = time.perf_counter()
    first, chunks, usage = None, 0, None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
        temperature=0.0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            if first is None:
                first = time.perf_counter()
    done = time.perf_counter()
    return {"ttft": (first or done) - sent, "seconds": done - sent,
            "completion_tokens": usage.completion_tokens if usage else chunks,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "max_tokens": max_tokens, "chunks": chunks}


async def run_load(base_url: str, models: list[str], requests, concurrency: int) -> dict:
    """Every request, `concurrency` at a time (request i to models[i % len(models)])."""
    import openai

    limit = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0,
                                  timeout=600) as client:
        async def limited(i, text, max_tokens):
            async with limit:
                return await one_request(client, models[i % len(models)], text, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i, text, new)
                                         for i, (text, new) in enumerate(requests)))
        seconds = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results)
    tokens = sum(r["completion_tokens"] for r in results)
    return {"seconds": seconds, "requests_per_s": len(results) / seconds,
            "tokens_per_s": tokens / seconds, "completion_tokens": tokens,
            "requested_tokens": sum(r["max_tokens"] for r in results),
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in results),
            "ttft_median": statistics.median(ttfts),
            "ttft_p95": float(np.percentile(ttfts, 95))}


def first_model(base_url: str) -> str:
    import json

    with urllib.request.urlopen(f"{base_url}/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def summarise(passes: list[dict]) -> dict:
    """The median of each figure over the passes, and the passes themselves."""
    keys = ("seconds", "requests_per_s", "tokens_per_s", "ttft_median", "ttft_p95")
    return {**{k: statistics.median(p[k] for p in passes) for k in keys},
            "completion_tokens": passes[0]["completion_tokens"],
            "requested_tokens": passes[0]["requested_tokens"],
            "prompt_tokens": passes[0]["prompt_tokens"], "passes": passes}


def warm(base_url: str, models: list[str], requests, warmup: int) -> None:
    """`warmup` requests at once (the longest prompts and outputs first, so most of the shapes
    a server compiles are met), then one at a time."""
    order = sorted(requests, key=lambda r: (-len(r[0]), -r[1]))[:warmup]
    asyncio.run(run_load(base_url, models, order, len(order)))
    asyncio.run(run_load(base_url, models, order[:2], 1))


def shown(command: list[str], tmp: pathlib.Path) -> str:
    """The command line as reported: the temporary folder as $TMP, python as python."""
    return " ".join(["python", *command[1:]] if command[0] == sys.executable else command
                    ).replace(str(tmp), "$TMP")


def measure_side(side: str, inputs: dict, requests, args, tmp: pathlib.Path) -> dict:
    port = free_port()
    command = server_command(side, inputs["folder"], port, {}, args.hf_cb)
    print(f"{side}: {' '.join(command)}", flush=True)
    out = {"command": shown(command, tmp), "concurrency": {}}
    with server(command, port, tmp / f"{side}.log") as (base_url, ready_s):
        out["ready_s"] = ready_s
        model = first_model(base_url)
        out["model"] = model
        start = time.perf_counter()
        warm(base_url, [model], requests, args.warmup)
        out["warmup_s"] = time.perf_counter() - start
        print(f"  ready in {ready_s:.1f} s, warm in {out['warmup_s']:.1f} s", flush=True)
        for concurrency in args.concurrency:
            passes = [asyncio.run(run_load(base_url, [model], requests, concurrency))
                      for _ in range(args.repeats)]
            out["concurrency"][str(concurrency)] = summary = summarise(passes)
            print(f"  concurrency {concurrency}: {summary['tokens_per_s']:.0f} tokens/s, "
                  f"{summary['requests_per_s']:.2f} requests/s, TTFT median "
                  f"{summary['ttft_median'] * 1e3:.0f} ms, p95 {summary['ttft_p95'] * 1e3:.0f} ms",
                  flush=True)
    return out


def measure_adapters(inputs: dict, requests, args, tmp: pathlib.Path) -> dict:
    port = free_port()
    command = server_command("tfx", inputs["folder"], port, inputs["adapters"], args.hf_cb)
    print(f"tfx adapters: {' '.join(command)}", flush=True)
    names = list(inputs["adapters"])
    out = {"command": shown(command, tmp), "concurrency": MAX_BATCH}
    with server(command, port, tmp / "tfx_adapters.log") as (base_url, ready_s):
        out["ready_s"] = ready_s
        warm(base_url, names[:1], requests, args.warmup)
        warm(base_url, names, requests, args.warmup)
        passes = {"one": [], "spread": []}
        for repeat in range(args.repeats):
            for mode in ("one", "spread") if repeat % 2 == 0 else ("spread", "one"):
                models = names[:1] if mode == "one" else names
                passes[mode].append(asyncio.run(run_load(base_url, models, requests,
                                                         MAX_BATCH)))
        for mode, runs in passes.items():
            out[mode] = summarise(runs)
            print(f"  {mode}: {out[mode]['tokens_per_s']:.0f} tokens/s", flush=True)
    out["spread_over_one"] = out["spread"]["tokens_per_s"] / out["one"]["tokens_per_s"]
    return out


# --- report -------------------------------------------------------------------------------


MODEL_NOTE = {"tiny": "experiments/tiny_chat_model.py: width 64, 2 layers",
              "small": "tiny_chat_model's tokenizer, width 256, 4 layers, MLP 688"}


def render(results: dict) -> str:
    sides = results["sides"]
    levels = results["concurrency_levels"]
    dirty = " with uncommitted changes to tfx/" if results["uncommitted"] else ""
    rows = []
    for level in map(str, levels):
        for side in SIDES:
            if side not in sides:
                continue
            s = sides[side]["concurrency"][level]
            ratio = None
            if side == "tfx" and "transformers" in sides:
                ratio = s["tokens_per_s"] / sides["transformers"]["concurrency"][level][
                    "tokens_per_s"]
            rows.append([level, side, s["tokens_per_s"], s["requests_per_s"],
                         s["ttft_median"] * 1e3, s["ttft_p95"] * 1e3, s["completion_tokens"],
                         ratio])
    lines = [
        "# Serving over HTTP: tfx serve vs transformers serve", "",
        f"`{results['command']}` at revision {results['revision']}{dirty} ({results['date']}), jax "
        f"{results['jax']}, torch {results.get('torch')}, transformers "
        f"{results.get('transformers')}, {results['cpus']} CPUs (load average "
        f"{results['load_average_before'][0]:.1f} before, "
        f"{results['load_average_after'][0]:.1f} after).", "",
        f"{results['requests']} streamed chat requests (prompts of 2-{results['max_prompt']} "
        f"words, max_tokens 8-{results['max_new']}, temperature 0, EOS never greedy), "
        f"{results['model']} LLaMA ({MODEL_NOTE[results['model']]}), float32; median of "
        f"{results['repeats']} passes of the whole set at each concurrency.", ""]
    for side in SIDES:
        if side in sides:
            s = sides[side]
            lines.append(f"- {side}: `{s['command']}` (ready in {s['ready_s']:.0f} s, warm-up "
                         f"{s['warmup_s']:.0f} s)")
    lines += ["", markdown_table(["concurrency", "server", "output tokens/s", "requests/s",
                                  "TTFT median ms", "TTFT p95 ms", "output tokens",
                                  "tfx / transformers"], rows), ""]
    if "tfx" in sides and "transformers" in sides:
        top = str(max(levels))
        t, h = sides["tfx"]["concurrency"][top], sides["transformers"]["concurrency"][top]
        lines += [f"At concurrency {top}: tfx / transformers output tokens/s "
                  f"{t['tokens_per_s'] / h['tokens_per_s']:.2f}x (goal >= 3); TTFT p95 "
                  f"{t['ttft_p95'] * 1e3:.0f} ms vs {h['ttft_p95'] * 1e3:.0f} ms.", ""]
    if "adapters" in results:
        a = results["adapters"]
        lines += [f"tfx serve with {ADAPTERS} LoRA adapters, concurrency {a['concurrency']}:", "",
                  markdown_table(["requests to", "output tokens/s", "requests/s",
                                  "TTFT median ms", "TTFT p95 ms", "/ one adapter"], [
                      [label, a[mode]["tokens_per_s"], a[mode]["requests_per_s"],
                       a[mode]["ttft_median"] * 1e3, a[mode]["ttft_p95"] * 1e3,
                       a[mode]["tokens_per_s"] / a["one"]["tokens_per_s"]]
                      for mode, label in (("one", "a0 only"),
                                          ("spread", f"a0-a{ADAPTERS - 1} round-robin"))]),
                  "", f"spread / one: {a['spread_over_one']:.2f} (goal >= 0.8)", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=120, help="words of the user turn")
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--model", choices=SIZES, default="tiny",
                        help="tiny: tiny_chat_model's fields; small: width 256, 4 layers")
    parser.add_argument("--only", choices=SIDES, help="measure one side only")
    parser.add_argument("--no-adapters", action="store_true", help="skip the adapter runs")
    parser.add_argument("--no-hf-cb", dest="hf_cb", action="store_false",
                        help="transformers serve without --continuous-batching")
    parser.add_argument("--quick", action="store_true",
                        help="16 requests, max_tokens <= 32, concurrency 1 and 16, 1 pass")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_new, args.repeats, args.concurrency = 16, 32, 1, [1, 16]
        args.warmup = 4
    sides = [args.only] if args.only else list(SIDES)
    results = {**provenance("serve.py"), "load_average_before": os.getloadavg(),
               "requests": args.requests, "max_prompt": args.max_prompt,
               "max_new": args.max_new, "repeats": args.repeats, "model": args.model,
               "concurrency_levels": args.concurrency, "sides": {},
               "uncommitted": subprocess.run(  # tfx serve may be measured before it is committed
                   ["git", "status", "--porcelain", "--", "tfx"], capture_output=True, text=True,
                   cwd=ROOT).stdout.splitlines()}
    requests = workload(args.requests, args.max_prompt, args.max_new)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        inputs = write_checkpoint(tmp, args.model)
        for side in sides:
            results["sides"][side] = measure_side(side, inputs, requests, args, tmp)
        if "tfx" in sides and not args.no_adapters:
            results["adapters"] = measure_adapters(inputs, requests, args, tmp)
    results["load_average_after"] = os.getloadavg()
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
