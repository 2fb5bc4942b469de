"""Weight-only int8 (`tfx.quant.quantize`) against float32 and bfloat16: decoding speed,
parameter memory and logit error, same model, same run.

    python benchmarks/quant.py                        # prompt 16 + 64 new tokens, batch 1
    python benchmarks/quant.py --quick                # 8 new tokens, 1 repeat: a smoke run
    python benchmarks/quant.py --json benchmarks/results/quant.json   # keep the numbers

A LLaMA-shaped byte-level decoder (6 layers, width 384, 6 heads / 2 KV heads, SwiGLU 1536,
untied head, RoPE; 13.2 M parameters of which the linear kernels are 99 %) with random
weights, in three forms made from the same float32 weights:
- float32: as created;
- bfloat16: parameters and compute in bfloat16 (`compute.dtype` / `param_dtype`);
- int8: `tfx.quant.quantize(float32 model, "int8")`: int8 kernels with one float32 scale per
  output column, dequantized to float32 in every matmul (embeddings and norms float32).
Each form decodes greedily with `tfx.generate` (warm: compiled once before timing); the forms
alternate and times are medians of --repeats runs. tokens/s counts new tokens. Memory is the
bytes of each model's whole `nnx.split` state. Logit error: ||logits - float32's|| / ||float32's||
over a [2, 64] batch, and the share of positions whose argmax agrees with float32's.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import decoding_arguments, markdown_path, markdown_table, provenance, publish

import tfx
from tfx.models import DecoderConfig, create

CONFIG = DecoderConfig(vocab_size=256, d_model=384, num_layers=6, num_heads=6,
                       attention={"num_kv_heads": 2}, d_ff=1536, max_len=256, position="rope",
                       norm={"kind": "rms"}, mlp={"activation": "silu", "gated": True},
                       use_bias=False, embeddings={"tie": False})
PROMPT_LEN = 16


def forms() -> dict:
    """{name: model}: float32, bfloat16 (the same weights rounded) and int8 weight-only."""
    float32 = create(CONFIG, rngs=nnx.Rngs(0))
    bfloat16 = create(CONFIG, compute={"dtype": "bfloat16", "param_dtype": "bfloat16"},
                      rngs=nnx.Rngs(0))
    nnx.update(bfloat16, jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                      nnx.state(float32, nnx.Param)))
    return {"float32": float32, "bfloat16": bfloat16,
            "int8": tfx.quant.quantize(nnx.clone(float32), "int8")}


def state_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))


def logit_error(model, reference: np.ndarray, ids) -> tuple[float, float]:
    """(relative L2 error of the logits, share of argmax agreement) against `reference`."""
    logits = np.asarray(model(ids), np.float32)
    error = np.linalg.norm(logits - reference) / np.linalg.norm(reference)
    return float(error), float(np.mean(logits.argmax(-1) == reference.argmax(-1)))


def decode_seconds(models: dict, new_tokens: int, repeats: int) -> dict:
    """Median seconds of one greedy tfx.generate call per form, forms alternating."""
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, PROMPT_LEN)), jnp.int32)

    def run(model):
        return tfx.generate(model, prompt, max_new_tokens=new_tokens, temperature=0.0)

    for model in models.values():  # compile
        jax.block_until_ready(run(model))
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            jax.block_until_ready(run(model))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(new_tokens: int, repeats: int) -> dict:
    models = forms()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 64)), jnp.int32)
    reference = np.asarray(models["float32"](ids))
    seconds = decode_seconds(models, new_tokens, repeats)
    rows = {}
    for name, model in models.items():
        error, agree = logit_error(model, reference, ids)
        rows[name] = {"tokens_per_s": new_tokens / seconds[name], "seconds": seconds[name],
                      "time_vs_float32": seconds[name] / seconds["float32"],
                      "param_mib": state_bytes(model) / 2**20,
                      "memory_vs_float32": state_bytes(model) / state_bytes(models["float32"]),
                      "logit_rel_error": error, "argmax_agreement": agree}
    return rows


def render(results: dict) -> str:
    rows = [[name, r["tokens_per_s"], r["time_vs_float32"], r["param_mib"],
             r["memory_vs_float32"], r["logit_rel_error"], r["argmax_agreement"]]
            for name, r in results["forms"].items()]
    return "\n".join([
        "# Weight-only int8 vs float32 and bfloat16 (benchmarks/quant.py)", "",
        f"Command: `{results['command']}`, revision {results['revision']}, {results['date']}, "
        f"jax {results['jax']}, {results['cpus']} CPUs, load average at start "
        f"{results['load_average']} (a machine shared with other jobs).", "",
        f"Greedy decoding, batch 1, prompt {PROMPT_LEN} + {results['new_tokens']} new tokens, "
        f"medians of {results['repeats']} runs; memory is the whole model state.", "",
        markdown_table(["form", "tokens/s", "time / float32", "params MiB",
                        "memory / float32", "logit rel. error", "argmax agrees"], rows)])


def main() -> None:
    summary = " ".join(__doc__.split("\n\n")[0].split())  # the docstring's first paragraph
    new_tokens, repeats, args = decoding_arguments(summary, repeats=9)
    load = os.getloadavg()
    results = {**provenance("quant.py"), "load_average": [round(x, 1) for x in load],
               "platform": jax.default_backend(), "new_tokens": new_tokens, "repeats": repeats,
               "forms": measure(new_tokens, repeats)}
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
