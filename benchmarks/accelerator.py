"""tfx on whatever chip is present: attention, MoE, decoding and a training step in one table of
absolute times, TFLOP/s and the fraction of the chip's peak.

    bash benchmarks/accelerator.sh                  # installs what is missing, then runs this
    python benchmarks/accelerator.py                # full sizes: one GPU, well inside 10 minutes
    python benchmarks/accelerator.py --quick        # tiny shapes: a smoke run, on CPU too
    python benchmarks/accelerator.py --json r.json --markdown r.md   # keep the numbers

Rows (compute dtype: the platform's default, `tfx.models.config.compute_dtype`: bfloat16 on
GPU/TPU, float32 on CPU; parameters float32):
- matmul: [n, n] @ [n, n], the practical peak that "% matmul" divides by;
- attention: `tfx.ops.dot_product_attention(implementation=None)` (the kernel its platform
  dispatch picks is named) against `jax.nn.dot_product_attention` (implementation="cudnn" on
  GPU, XLA's elsewhere), [batch, seq, heads, head_dim] with batch * seq fixed, causal or not,
  forward ("fwd") and forward + backward ("fwd+bwd"). FLOPs: 4·B·H·T²·D, halved when causal;
  x3.5 with the backward (flash attention's count: the backward is 2.5 forwards);
- moe: `tfx.ops.moe.moe` forward + backward of a SwiGLU mixture, the platform's grouped matmul
  (implementation=None) against the one-hot dispatch. FLOPs: the routed experts' work only,
  3 · 2 · tokens · k · 3 · d_model · d_ff;
- decode: `tfx.generate`, greedy, new tokens of the whole batch per second. FLOPs: 2·N per token
  (N parameters; decoding is bound by memory bandwidth, so this fraction is small by nature);
- train: one `tfx.train.step.make_train_step` step of a GPT, tokens/s; FLOPs per token by
  `tfx.train.flops.training_flops_per_token` (6N + attention), so "% peak" is the MFU.
"% peak" divides by the datasheet's dense bfloat16 peak of the device kind (PEAKS; "-" when the
kind is unknown, as on CPUs). A failed cell (a kernel the chip refuses, out of memory) prints its
error instead of numbers and the run goes on; --quick re-raises it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import markdown_table, median_seconds, provenance, publish
from train import build_model, tfx_runner

import tfx
import tfx.ops
from tfx.models import AttentionConfig, DecoderConfig, EmbeddingsConfig, MlpConfig, NormConfig
from tfx.models.config import compute_dtype
from tfx.ops.attention import static_spec
from tfx.ops.backends import AttentionCase, select_attention
from tfx.ops.moe import ExpertWeights, moe, select_grouped_matmul
from tfx.train.flops import matmul_peak_flops, parameter_count, training_flops_per_token

# Dense bfloat16 peak FLOP/s by device kind (datasheets; SXM parts), matched by substring in
# this order, so that "TPU v5 lite" is not read as "TPU v5".
PEAKS = (("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("A100", 312e12),
         ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12),
         ("TPU v6 lite", 918e12))


@dataclasses.dataclass(frozen=True)
class Sizes:
    matmul: int
    seqs: tuple[int, ...]  # attention lengths, at attention_tokens = batch * seq
    attention_tokens: int
    heads: int
    head_dim: int
    moe: tuple[int, int, int, int, int]  # tokens, d_model, d_ff, experts, experts per token
    decode_model: DecoderConfig
    decode: tuple[int, int, int]  # batch, prompt length, new tokens
    train_model: DecoderConfig
    train: tuple[int, int]  # batch, sequence length
    repeats: int


def _gpt(vocab, d_model, layers, heads, kv_heads, max_len) -> DecoderConfig:
    """A LLaMA-shaped decoder (RoPE, RMSNorm, SwiGLU, untied head)."""
    return DecoderConfig(vocab_size=vocab, d_model=d_model, num_layers=layers, num_heads=heads,
                         d_ff=int(8 / 3 * d_model) // 64 * 64, max_len=max_len, position="rope",
                         attention=AttentionConfig(num_kv_heads=kv_heads),
                         norm=NormConfig(kind="rms"), mlp=MlpConfig(activation="silu", gated=True),
                         use_bias=False, embeddings=EmbeddingsConfig(tie=False))


FULL = Sizes(matmul=8192, seqs=(1024, 2048, 4096, 8192, 16384), attention_tokens=16384,
             heads=16, head_dim=128, moe=(16384, 2048, 8192, 8, 2),
             decode_model=_gpt(32000, 2048, 12, 16, 8, 512), decode=(16, 128, 256),
             train_model=_gpt(32000, 1024, 12, 16, 16, 2048), train=(8, 2048), repeats=5)
QUICK = Sizes(matmul=256, seqs=(256,), attention_tokens=256, heads=2, head_dim=64,
              moe=(256, 64, 128, 4, 2), decode_model=_gpt(256, 64, 2, 4, 2, 64),
              decode=(2, 16, 8), train_model=_gpt(256, 64, 2, 4, 4, 128), train=(2, 64),
              repeats=2)


def chip_peak(device_kind: str) -> float | None:
    """The datasheet's dense bfloat16 FLOP/s of `device_kind`, None when unknown."""
    return next((peak for name, peak in PEAKS if name in device_kind), None)


class Table:
    """Rows of the one table; `measure` times a cell and keeps its error when it fails."""

    def __init__(self, peak: float | None, strict: bool):
        self.rows, self.peak, self.matmul, self.strict = [], peak, None, strict

    def measure(self, bench: str, case: str, implementation: str, make_run, flops: float,
                repeats: int, tokens: float | None = None) -> float | None:
        """make_run() -> a blocking callable; flops (and tokens) per call. Returns seconds."""
        row = {"benchmark": bench, "case": case, "implementation": implementation}
        try:
            seconds = median_seconds(make_run(), repeats=repeats)
        except Exception as error:  # one refused kernel must not end a run on rented hardware
            if self.strict:
                raise
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
            self._progress(row)
            return None
        rate = flops / seconds
        row.update(ms=1e3 * seconds, tflops=rate / 1e12,
                   peak_pct=None if self.peak is None else 100 * rate / self.peak,
                   matmul_pct=None if self.matmul is None else 100 * rate / self.matmul,
                   tokens_per_s=None if tokens is None else tokens / seconds)
        self._progress(row)
        return seconds

    def _progress(self, row: dict) -> None:
        """Keep the row and say so on stderr: a run stopped at its time limit shows how far it
        got."""
        self.rows.append(row)
        result = row.get("error") or f"{row['ms']:.3g} ms"
        print(f"{row['benchmark']} | {row['case']} | {row['implementation']}: {result}",
              file=sys.stderr, flush=True)


def _ready(fn, *args):
    return lambda: jax.block_until_ready(fn(*args))


def matmul_rows(table: Table, sizes: Sizes, dtype) -> None:
    n = sizes.matmul
    table.matmul = matmul_peak_flops(n, dtype, repeats=sizes.repeats)
    table.rows.append({"benchmark": "matmul", "case": f"{n}x{n}x{n}",
                       "implementation": "jnp.matmul", "tflops": table.matmul / 1e12,
                       "peak_pct": None if table.peak is None else 100 * table.matmul / table.peak,
                       "matmul_pct": 100.0})


def attention_rows(table: Table, sizes: Sizes, dtype, platform: str) -> None:
    baseline = "cudnn" if platform == "gpu" else None
    for seq in sizes.seqs:
        batch = max(1, sizes.attention_tokens // seq)
        shape = (batch, seq, sizes.heads, sizes.head_dim)
        q, k, v = (jax.random.normal(key, shape, dtype)
                   for key in jax.random.split(jax.random.key(0), 3))
        for causal in (False, True):
            case = AttentionCase(dtype=np.dtype(dtype), q_len=seq, kv_len=seq,
                                 num_heads=sizes.heads, num_kv_heads=sizes.heads,
                                 head_dim=sizes.head_dim, value_dim=sizes.head_dim,
                                 spec=static_spec(causal, None))
            chosen = select_attention(platform, case)
            forward = 4.0 * batch * sizes.heads * seq * seq * sizes.head_dim / (2 if causal else 1)
            sides = {
                f"tfx auto ({chosen})": lambda q, k, v, c=causal: tfx.ops.dot_product_attention(
                    q, k, v, is_causal=c),
                f"jax.nn ({baseline or 'xla'})": lambda q, k, v, c=causal: (
                    jax.nn.dot_product_attention(q, k, v, is_causal=c,
                                                 implementation=baseline)),
            }
            for mode, factor in (("fwd", 1.0), ("fwd+bwd", 3.5)):
                label = f"b{batch} s{seq} {'causal' if causal else 'full'} {mode}"
                for name, attend in sides.items():
                    table.measure("attention", label, name,
                                  lambda a=attend, m=mode, x=(q, k, v): _attention_run(a, m, *x),
                                  factor * forward, sizes.repeats)


def _attention_run(attend, mode: str, q, k, v):
    if mode == "fwd":
        return _ready(jax.jit(attend), q, k, v)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)),
                            argnums=(0, 1, 2)))
    return _ready(grad, q, k, v)


def moe_rows(table: Table, sizes: Sizes, dtype, platform: str) -> None:
    tokens, d_model, d_ff, experts, k = sizes.moe
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (tokens, d_model), dtype)
    router = jax.random.normal(keys[1], (d_model, experts), jnp.float32) * d_model**-0.5
    gate, up = (jax.random.normal(key, (experts, d_model, d_ff), dtype) * d_model**-0.5
                for key in keys[2:4])
    down = jax.random.normal(keys[4], (experts, d_ff, d_model), dtype) * d_ff**-0.5
    weights = ExpertWeights(gate=gate, up=up, down=down)
    flops = 3 * 2.0 * tokens * k * 3 * d_model * d_ff
    case = f"{tokens} tokens d{d_model} ff{d_ff} E{experts} k{k} fwd+bwd"
    for name, implementation in ((f"tfx auto ({select_grouped_matmul(platform)})", None),
                                 ("one-hot", "onehot")):
        def loss(x, weights, implementation=implementation):
            out, _ = moe(x, router, weights, num_selected=k, implementation=implementation)
            return jnp.sum(out.astype(jnp.float32))

        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        table.measure("moe", case, name, lambda s=step: _ready(s, x, weights), flops,
                      sizes.repeats, tokens=tokens)


def decode_rows(table: Table, sizes: Sizes) -> None:
    batch, prompt, new = sizes.decode
    model = build_model(sizes.decode_model)
    model.eval()
    num_params = parameter_count(nnx.state(model, nnx.Param))
    ids = np.random.default_rng(2).integers(0, sizes.decode_model.vocab_size, (batch, prompt))
    config = sizes.decode_model
    case = (f"{num_params / 1e6:.3g}M params ({config.num_layers}x{config.d_model}), "
            f"batch {batch}, prompt {prompt} + {new}")
    table.measure("decode", case, "tfx.generate greedy",
                  lambda: _ready(lambda: tfx.generate(model, ids, max_new_tokens=new,
                                                      temperature=0.0)),
                  2.0 * num_params * batch * new, sizes.repeats, tokens=batch * new)


def train_rows(table: Table, sizes: Sizes) -> None:
    batch, seq = sizes.train
    config = sizes.train_model
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, (batch, seq + 1))
    step, num_params = tfx_runner(build_model(config), tokens, steps=2 + 2 * sizes.repeats)
    flops = training_flops_per_token(config, num_params, seq) * batch * seq
    case = (f"{num_params / 1e6:.3g}M params ({config.num_layers}x{config.d_model}), "
            f"batch {batch} x {seq}")
    table.measure("train", case, "make_train_step (AdamW)", lambda: step, flops, sizes.repeats,
                  tokens=batch * seq)


def render(results: dict) -> str:
    env = results["environment"]
    peak = env["peak_tflops"]
    head = (f"# tfx on {env['device_kind']} ({env['platform']}), compute dtype "
            f"{env['compute_dtype']}, datasheet peak "
            f"{'unknown' if peak is None else f'{peak:.0f} TFLOP/s'}")
    rows = [(r["benchmark"], r["case"], r["implementation"], r.get("ms"), r.get("tflops"),
             r.get("peak_pct"), r.get("matmul_pct"), r.get("tokens_per_s"), r.get("error"))
            for r in results["rows"]]
    table = markdown_table(["benchmark", "case", "implementation", "ms", "TFLOP/s", "% peak",
                            "% matmul", "tokens/s", "error"], rows)
    return f"{head}\n\n{table}\n\nWall time {results['wall_s']:.0f} s."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    start = time.perf_counter()
    sizes = QUICK if args.quick else FULL
    device = jax.devices()[0]
    platform = jax.default_backend()
    dtype = compute_dtype(None, platform) or jnp.dtype(jnp.float32)
    peak = chip_peak(device.device_kind)
    table = Table(peak, strict=args.quick)
    matmul_rows(table, sizes, dtype)
    attention_rows(table, sizes, dtype, platform)
    moe_rows(table, sizes, dtype, platform)
    decode_rows(table, sizes)
    train_rows(table, sizes)
    results = {"environment": {"platform": platform, "device_kind": device.device_kind,
                               "compute_dtype": str(dtype),
                               "peak_tflops": None if peak is None else peak / 1e12,
                               **provenance("accelerator.py")},
               "quick": args.quick, "rows": table.rows, "wall_s": time.perf_counter() - start}
    publish(render(results), results, json_path=args.json, markdown_path=args.markdown)


if __name__ == "__main__":
    main()
