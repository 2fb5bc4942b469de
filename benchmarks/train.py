"""Training-step throughput and MFU: tfx's real training step vs the same model in PyTorch.

    python benchmarks/train.py                        # both models, batch 16 x 256, 7 repeats
    python benchmarks/train.py --quick                # 1 warmup step, 2 repeats: a smoke run
    python benchmarks/train.py --json benchmarks/results/train.json   # also writes train.md

Two byte-vocabulary (256) decoders, float32, batch 16, sequence 256:
- char-gpt: `tfx.models.PRESETS["char-gpt"]` (RoPE, RMSNorm, SwiGLU, GQA 4/2 heads, 4 layers,
  width 256), compared with transformers' LlamaForCausalLM;
- gpt-6x384: a GPT-2 (learned positions, LayerNorm, GELU tanh, biases, tied embeddings; 6
  layers, width 384, 6 heads, context 256), compared with transformers' GPT2LMHeadModel.
Both sides start from the same weights (N(0, 0.02) matrices, unit norm scales, zero biases;
exported with `tfx.hf.save`) and train on the same random byte batch, so their first losses
agree (printed as a check).

tfx runs the real training path: `tfx.train.optim.make_optimizer(OptimConfig(), steps)` (AdamW,
warmup-cosine, global-norm clipping, decay on matrices), `tfx.train.step.init_train_state` and
`make_train_step(..., tfx.train.objectives.causal_lm)` (jitted, state donated). PyTorch runs
`attn_implementation="sdpa"`, dropout 0, `torch.optim.AdamW` with the same hyperparameters,
schedule and decay groups, `clip_grad_norm_` and `F.cross_entropy`.

Each config: one first step on each side (tfx's includes compilation), `--warmup` steps, then
`--repeats` timed steps alternating between the two sides (the order flips every repeat, so
neither always runs right after the other library). tokens/s = batch * seq / median step time.
MFU = model FLOPs per token (6N + 12·L·H·Q·T, PaLM appendix B; `tfx.train.flops`) * tokens/s /
the float32 matmul peak of this machine, measured in this run (best 2048^3 product of jnp and
torch, before and after the timed steps).
"""

from __future__ import annotations

import argparse
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

import tfx.hf
from tfx.models import PRESETS, DecoderConfig, MlpConfig, NormConfig, create
from tfx.ops.attention import BLOCKED_MIN_SCORES
from tfx.train.config import OptimConfig
from tfx.train.flops import matmul_peak_flops, parameter_count, training_flops_per_token
from tfx.train.host_memory import keep_freed_memory
from tfx.train.objectives import causal_lm
from tfx.train.optim import learning_rate_schedule, make_optimizer
from tfx.train.step import init_train_state, make_train_step

SEQ_LEN = 256
CONFIGS = {
    "char-gpt": (PRESETS["char-gpt"].replace(max_len=SEQ_LEN), "LlamaForCausalLM"),
    "gpt-6x384": (DecoderConfig(vocab_size=256, d_model=384, num_layers=6, num_heads=6,
                                d_ff=4 * 384, max_len=SEQ_LEN, position="learned",
                                norm=NormConfig(kind="layer", eps=1e-5),
                                mlp=MlpConfig(activation="gelu_tanh"), use_bias=True),
                  "GPT2LMHeadModel"),
}
HEADLINE = "gpt-6x384"  # the config whose ratio and MFU are the JSON's `vs_torch` and `mfu`


def build_model(config: DecoderConfig) -> nnx.Module:
    """A tfx Decoder with GPT-2 style initial weights: matrices (and the embedding tables)
    N(0, 0.02), norm scales 1, biases 0. Drawn with numpy: initialising eagerly in JAX compiles
    every initialiser on its own."""
    abstract = nnx.eval_shape(lambda: create(config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    rng = np.random.default_rng(0)

    def draw(path, x):
        if jax.tree_util.keystr(path).endswith("['scale'].value"):
            return jnp.ones(x.shape, x.dtype)
        if x.ndim < 2:
            return jnp.zeros(x.shape, x.dtype)
        return jnp.asarray(rng.normal(0.0, 0.02, x.shape).astype(x.dtype))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, params), rest)


def torch_model(model: nnx.Module, architecture: str):
    """The same weights in transformers' `architecture`, training mode, SDPA attention."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cls = getattr(transformers, architecture)
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tfx.hf.save(model, folder, architecture=architecture)
        hf_model = cls.from_pretrained(folder, attn_implementation="sdpa")
    hf_model.train()
    return hf_model


def tfx_runner(model: nnx.Module, tokens: np.ndarray, steps: int):
    """(step() -> loss of that step) on tfx's training path, and the parameter count."""
    optimizer = make_optimizer(OptimConfig(), steps)
    graphdef, rest, state = init_train_state(model, optimizer, seed=0)
    num_params = parameter_count(state.params)
    train_step = make_train_step(graphdef, rest, optimizer, causal_lm)
    batch = {"tokens": jnp.asarray(tokens, jnp.int32)}
    box = [state]

    def step() -> float:
        box[0], metrics = train_step(box[0], batch)
        return float(jax.block_until_ready(metrics["loss"]))

    return step, num_params


def torch_runner(hf_model, tokens: np.ndarray, steps: int):
    """step() -> loss: AdamW (OptimConfig's hyperparameters, schedule and decay on matrices
    only) after clip_grad_norm_, on F.cross_entropy of the next-token logits."""
    import torch

    config = OptimConfig()
    matrices = [p for p in hf_model.parameters() if p.ndim >= 2]
    vectors = [p for p in hf_model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": config.weight_decay},
         {"params": vectors, "weight_decay": 0.0}],
        lr=config.learning_rate, betas=(config.b1, config.b2))
    schedule = np.asarray(jax.vmap(learning_rate_schedule(config, steps))(jnp.arange(steps)))
    ids = torch.from_numpy(tokens.astype(np.int64))
    inputs, targets = ids[:, :-1], ids[:, 1:].reshape(-1)
    count = [0]

    def step() -> float:
        for group in optimizer.param_groups:
            group["lr"] = float(schedule[min(count[0], steps - 1)])
        logits = hf_model(inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), config.grad_clip)
        optimizer.step()
        count[0] += 1
        return float(loss.detach())

    return step


def torch_matmul_peak_flops(size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a torch float32 [size, size] @ [size, size] product, best of `repeats`."""
    import torch

    a = torch.randn(size, size)
    a @ a
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def measure_peak() -> dict:
    return {"jnp": matmul_peak_flops(), "torch": torch_matmul_peak_flops()}


def alternate(runs: dict, repeats: int) -> dict:
    """Seconds of each run per repeat, the order reversed every other repeat."""
    times = {name: [] for name in runs}
    for i in range(repeats):
        for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return times


def measure_config(name: str, args) -> dict:
    import torch

    config, architecture = CONFIGS[name]
    if args.implementation:
        config = config.replace(attention={"implementation": args.implementation})
    tokens = np.random.default_rng(1).integers(0, config.vocab_size,
                                               (args.batch, args.seq_len + 1))
    steps = 2 + args.warmup + args.repeats  # first, warmup, timed, last
    model = build_model(config)
    hf_model = torch_model(model, architecture)  # before tfx's first step donates the weights
    tfx_step, num_params = tfx_runner(model, tokens, steps)
    torch_step = torch_runner(hf_model, tokens, steps)
    start = time.perf_counter()
    first = {"tfx": tfx_step()}
    first_call_s = time.perf_counter() - start
    first["torch"] = torch_step()
    for _ in range(args.warmup):
        tfx_step(), torch_step()
    times = alternate({"tfx": tfx_step, "torch": torch_step}, args.repeats)
    tokens_per_step = args.batch * args.seq_len
    flops_per_token = training_flops_per_token(config, num_params, args.seq_len)
    row = {"config": name, "torch_architecture": architecture, "batch": args.batch,
           "seq_len": args.seq_len, "steps": steps, "num_layers": config.num_layers,
           "d_model": config.d_model, "num_heads": config.num_heads,
           "num_kv_heads": config.kv_heads,
           "parameters": num_params, "flops_per_token": flops_per_token,
           "attention_implementation": config.attention.implementation or "auto ({})".format(
               "blocked" if args.seq_len**2 >= BLOCKED_MIN_SCORES else "reference"),
           "tfx_first_call_s": first_call_s, "first_loss_tfx": first["tfx"],
           "first_loss_torch": first["torch"], "last_loss_tfx": tfx_step(),
           "last_loss_torch": torch_step(), "torch_threads": torch.get_num_threads()}
    for side, seconds in times.items():
        median = statistics.median(seconds)
        row[f"{side}_step_s"] = median
        row[f"{side}_step_s_all"] = seconds
        row[f"{side}_tokens_per_s"] = tokens_per_step / median
        row[f"{side}_model_flops_per_s"] = flops_per_token * tokens_per_step / median
    row["vs_torch"] = row["tfx_tokens_per_s"] / row["torch_tokens_per_s"]
    return row


def render(results: dict) -> str:
    """The markdown report of a results dict (as written by --json)."""
    rows = [results["configs"][name] for name in results["configs"]]
    peak = results["peak_flops"]
    lines = [
        f"Command: `{results['command']}` at revision `{results['revision']}` "
        f"({results['date']}); jax {results['jax']}, torch {results['torch']}, transformers "
        f"{results['transformers']}, {results['cpus']} CPUs, torch threads "
        f"{rows[0]['torch_threads']}; load average (1 min) "
        f"{results['load_average_before'][0]:.1f} before, "
        f"{results['load_average_after'][0]:.1f} after; XLA_FLAGS "
        f"`{results['xla_flags'] or '(unset)'}`.",
        "",
        f"## Training step, batch {rows[0]['batch']} x {rows[0]['seq_len']} tokens, float32",
        "",
        f"Medians of {results['repeats']} alternating steps after {results['warmup']} warmup "
        "step(s); same weights and batch on both sides. tfx: make_optimizer + init_train_state "
        "+ make_train_step(causal_lm); PyTorch: transformers (SDPA) + AdamW + clip_grad_norm_ "
        f"+ cross_entropy. Peak: float32 2048^3 matmul, {peak['best'] / 1e9:.0f} GFLOP/s (jnp "
        f"{peak['jnp'] / 1e9:.0f}, torch {peak['torch'] / 1e9:.0f}). MFU = (6N + 12·L·H·Q·T) "
        "FLOPs/token * tokens/s / peak. Goals: tfx / PyTorch >= 1.1, tfx MFU >= 60% on "
        "gpt-6x384.",
        "",
        markdown_table(
            ["config", "PyTorch peer", "params", "tfx tokens/s", "PyTorch tokens/s",
             "tfx / PyTorch", "tfx MFU", "PyTorch MFU", "tfx GFLOP/s", "first loss tfx / PyTorch"],
            [[r["config"], r["torch_architecture"], f"{r['parameters'] / 1e6:.2f}M",
              r["tfx_tokens_per_s"], r["torch_tokens_per_s"], r["vs_torch"],
              f"{r['tfx_mfu']:.0%}", f"{r['torch_mfu']:.0%}",
              r["tfx_model_flops_per_s"] / 1e9,
              f"{r['first_loss_tfx']:.4f} / {r['first_loss_torch']:.4f}"] for r in rows]),
        "",
    ]
    for r in rows:
        lines.append(
            f"- {r['config']}: {r['num_layers']} layers, width {r['d_model']}, "
            f"{r['num_heads']} heads ({r['num_kv_heads']} KV), "
            f"{r['flops_per_token'] / 1e6:.1f} MFLOP/token; attention "
            f"{r['attention_implementation']}; tfx first call (compile + step) "
            f"{r['tfx_first_call_s']:.1f} s; loss of step {r['steps']} (after "
            f"{r['steps'] - 1} updates) tfx {r['last_loss_tfx']:.4f}, PyTorch "
            f"{r['last_loss_torch']:.4f}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    keep_freed_memory()  # as the tfx command does, before JAX starts
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS),
                        help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--implementation", choices=["reference", "blocked"],
                        help="tfx attention kernel (default: the config's, automatic)")
    parser.add_argument("--torch-threads", type=int,
                        help="torch.set_num_threads before measuring (default: torch's own)")
    parser.add_argument("--quick", action="store_true", help="1 warmup step, 2 repeats")
    parser.add_argument("--json", help="write all results to this path")
    parser.add_argument("--markdown",
                        help="write the report to this path (default with --json: its .md)")
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.repeats = 1, 2
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    if not 1 <= args.seq_len <= SEQ_LEN:
        parser.error(f"--seq-len must be in [1, {SEQ_LEN}] (the models' context)")
    for name in ("batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("torch and transformers are needed: pip install -e '.[bench]'")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    markdown = args.markdown or (str(pathlib.Path(args.json).with_suffix(".md"))
                                 if args.json else None)
    results = {**provenance("train.py"), "warmup": args.warmup, "repeats": args.repeats,
               "load_average_before": os.getloadavg()}
    peaks = [measure_peak()]
    results["configs"] = {}
    for name in args.configs:
        row = measure_config(name, args)
        results["configs"][name] = row
        print(f"{name}: tfx {row['tfx_tokens_per_s']:.0f} tokens/s, PyTorch "
              f"{row['torch_tokens_per_s']:.0f} tokens/s, tfx / PyTorch {row['vs_torch']:.2f}; "
              f"first loss {row['first_loss_tfx']:.4f} / {row['first_loss_torch']:.4f}",
              flush=True)
    peaks.append(measure_peak())
    results["load_average_after"] = os.getloadavg()
    peak = {side: max(p[side] for p in peaks) for side in ("jnp", "torch")}
    peak["best"] = max(peak.values())
    results["peak_flops"] = peak
    for row in results["configs"].values():
        for side in ("tfx", "torch"):
            row[f"{side}_mfu"] = row[f"{side}_model_flops_per_s"] / peak["best"]
    headline = results["configs"].get(HEADLINE) or next(iter(results["configs"].values()))
    results["headline_config"] = headline["config"]
    results["vs_torch"], results["mfu"] = headline["vs_torch"], headline["tfx_mfu"]
    publish(render(results), results, json_path=args.json, markdown_path=markdown)


if __name__ == "__main__":
    main()
