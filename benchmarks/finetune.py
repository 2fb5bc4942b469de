"""LoRA fine-tuning step throughput: tfx's sft and dpo training steps vs TRL + peft (PyTorch).

    python benchmarks/finetune.py                     # sft and dpo, batch 4 x 256, 3 repeats
    python benchmarks/finetune.py --quick             # 1 repeat of 2 timed steps: a smoke run
    python benchmarks/finetune.py --json benchmarks/results/finetune.json   # also writes .md

One model: a LLaMA (4 layers, width 256, MLP 688, 8 heads, 4 KV heads, untied head, random
weights) written by transformers' save_pretrained beside a byte-level BPE tokenizer (vocab 4096,
ChatML template). One data set: chats generated from a fixed seed (sft: {"prompt": [user],
"completion": [assistant]}; dpo: {"prompt", "chosen", "rejected"} as messages), each at most
--seq-len tokens. Both sides: LoRA rank 8, alpha 16, no dropout, on q, k, v, o, gate, up, down;
AdamW (lr 2e-4, betas 0.9 / 0.999, no decay), cosine schedule, clipping at norm 1; float32, no
activation checkpointing (TRL's defaults, bf16 and gradient_checkpointing, are turned off); loss
on the completions only; no packing: rows padded to --seq-len (TRL: max_length =
pad_to_multiple_of = seq-len), so both read batch x seq-len tokens a step (dpo: 2 x that).

- tfx: `from_pretrained(folder, "sft" | "dpo", peft=LoraTuning(...))`, `Trainer`, and per step
  `feed.train(k)`, `_device`, the jitted `train_step` (state donated), `block_until_ready`.
- TRL: `SFTTrainer` / `DPOTrainer` (beta 0.1, sigmoid) with peft's `LoraConfig`, SDPA
  attention, `torch.set_num_threads(--threads)`. TRL's fused LM head projects only the positions
  that have a label (completion tokens); tfx's head projects every position. SFT also computes
  entropy and top-1 accuracy each step. dpo on both sides: one forward of the 2B chosen and
  rejected rows with gradient, and one without, the adapters off (the reference).

Each (objective, side, repeat) is one child process: build, --warmup steps (the first compiles
tfx's step: "tfx compiles" counts the compiles of every step, one since the starting state is
committed to the device), --steps timed steps. A step's time runs from the previous step's end
to its own (TRL: `TrainerCallback.on_step_end`), so batching and per-step bookkeeping count on
both sides. A side's figure is the median over --repeats children of each child's median step;
the sides alternate, the order flipped every repeat. Peak RSS: the child's `ru_maxrss` at the
end (the whole process: interpreter, libraries, model, data, compiled programs). tfx children
call `keep_freed_memory()` as the tfx command does; TRL children keep glibc's defaults.
Measure on a quiet machine: with other processes busy, PyTorch's threads wait on each other at
every operator (a 0.3 s TRL step took 3 to 8 s at load average 3 on 2 cores, 0.5 s with one
thread) while XLA's steps slow down about 2x; each child's load average is recorded, and the
ratio of the fastest children is given beside the ratio of the medians.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from timing import (
    add_output_arguments,
    markdown_path,
    markdown_table,
    provenance,
    publish,
    run_child,
)

from tfx.train.host_memory import keep_freed_memory

MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, tie_word_embeddings=False)
VOCAB = 4096
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TARGETS = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "o_proj",
           "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # tfx name: peft name
RANK, ALPHA, LR, BETA = 8, 16.0, 2e-4, 0.1
OBJECTIVES, SIDES = ("sft", "dpo"), ("tfx", "trl")


def rss_mib() -> float:
    """This process's resident set now, in MiB."""
    return int(pathlib.Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def write_inputs(root: pathlib.Path, seq_len: int) -> dict:
    """The model folder and the sft and dpo JSONL files, under `root`: their paths, and the
    vocabulary size."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = rng.permutation(sorted({"".join(rng.choice(syllables, rng.integers(1, 4)))
                                    for _ in range(5000)}))
    zipf = 1.0 / np.arange(1, len(words) + 1)

    def text(lo: int, hi: int) -> str:
        picked = rng.choice(words, rng.integers(lo, hi + 1), p=zipf / zipf.sum())
        return " ".join(picked).capitalize() + "."

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text(20, 80) for _ in range(4000)], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = root / "llama"
    folder.mkdir(parents=True)
    bpe.save(str(folder / "tokenizer.json"))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), bos_token="<s>", eos_token="<|im_end|>",
        pad_token="<pad>", chat_template=CHATML)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **MODEL, vocab_size=len(tokenizer), max_position_embeddings=max(seq_len, 256),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)).save_pretrained(folder)

    def fits(*chats) -> bool:  # the whole rendering, as TRL tokenizes it
        return all(len(tokenizer(tokenizer.apply_chat_template(chat, tokenize=False),
                                 add_special_tokens=False)["input_ids"]) <= seq_len
                   for chat in chats)

    paths, scale = {"folder": str(folder), "vocab": len(tokenizer)}, seq_len / 256
    for objective, count, fields in (  # words per turn: rows of 1/4 to all of seq_len tokens
            ("sft", 400, {"prompt": ("user", 10, 60), "completion": ("assistant", 20, 150)}),
            ("dpo", 200, {"prompt": ("user", 10, 50), "chosen": ("assistant", 10, 90),
                          "rejected": ("assistant", 10, 90)})):
        lines = []
        while len(lines) < count:
            line = {k: [{"role": role, "content": text(int(lo * scale), int(hi * scale))}]
                    for k, (role, lo, hi) in fields.items()}
            if fits(*(line["prompt"] + line[k] for k in line if k != "prompt")):
                lines.append(json.dumps(line) + "\n")
        paths[objective] = str(root / f"{objective}.jsonl")
        pathlib.Path(paths[objective]).write_text("".join(lines))
    return paths


def tfx_child(args) -> dict:
    """Step seconds of tfx's Trainer, the XLA compilations during the steps, the batch."""
    import jax

    from tfx.train.finetuning import LoraTuning
    from tfx.train.loop import Trainer
    from tfx.train.pretrained import from_pretrained

    after_imports = rss_mib()
    sections = {"train": {"steps": args.warmup + args.steps, "batch_size": args.batch,
                          "seq_len": args.seq_len, "seed": 0},
                "optim": {"learning_rate": LR, "warmup_steps": 0, "min_lr_ratio": 0.0,
                          "weight_decay": 0.0, "b1": 0.9, "b2": 0.999, "grad_clip": 1.0}}
    if args.objective == "dpo":
        sections["preference"] = {"beta": BETA, "loss": "sigmoid"}
    experiment = from_pretrained(args.folder, args.objective, data=args.data, peft=LoraTuning(
        rank=RANK, alpha=ALPHA, targets=tuple(TARGETS)), **sections)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compiles.append(seconds)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(experiment, workdir)
        first = trainer.feed.train(0)
        del compiles[:]  # building the model compiles its initialisers: only the steps count
        state, ends, losses = trainer.state, [], []
        for step in range(args.warmup + args.steps):
            state, metrics = trainer.train_step(state, trainer._device(trainer.feed.train(step)))
            jax.block_until_ready(metrics)
            ends.append(time.perf_counter())
            losses.append(float(metrics["loss"]))
        trainer.close()
    return {"step_s": np.diff(ends)[args.warmup - 1:].tolist(), "compiles": len(compiles),
            "compile_s": sum(compiles), "batch_shape": {k: list(v.shape) for k, v in
                                                        first.items()},
            "loss_token_share": float(np.mean([v[:, 1:] for k, v in first.items()
                                               if k.endswith("mask")])),
            "mean_loss": float(np.mean(losses)), "rss_after_imports_mib": after_imports}


def trl_child(args) -> dict:
    """Step seconds of TRL's SFTTrainer or DPOTrainer, its precision, the batch."""
    import datasets
    import torch
    import transformers
    import trl
    from peft import LoraConfig

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    after_imports, ends = rss_mib(), []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as workdir:
        common = dict(
            output_dir=workdir, max_steps=args.warmup + args.steps, seed=0,
            per_device_train_batch_size=args.batch, max_length=args.seq_len,
            pad_to_multiple_of=args.seq_len, padding_free=False, learning_rate=LR,
            lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
            adam_beta2=0.999, max_grad_norm=1.0, optim="adamw_torch", use_cpu=True,
            bf16=False, fp16=False, gradient_checkpointing=False, report_to="none",
            eval_strategy="no", save_strategy="no", logging_strategy="no",
            dataloader_num_workers=0, disable_tqdm=True)
        if args.objective == "sft":
            config = trl.SFTConfig(**common, packing=False, completion_only_loss=True)
        else:
            config = trl.DPOConfig(**common, beta=BETA, loss_type=["sigmoid"],
                                   precompute_ref_log_probs=False)
        trainer = (trl.SFTTrainer if args.objective == "sft" else trl.DPOTrainer)(
            model=transformers.AutoModelForCausalLM.from_pretrained(
                args.folder, dtype=torch.float32, attn_implementation="sdpa"),
            args=config, processing_class=transformers.AutoTokenizer.from_pretrained(args.folder),
            train_dataset=datasets.load_dataset("json", data_files=args.data, split="train"),
            peft_config=LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                   target_modules=list(TARGETS.values()), task_type="CAUSAL_LM"),
            callbacks=[Clock()])
        batch = next(iter(trainer.get_train_dataloader()))
        mean_loss = trainer.train().training_loss
    return {"step_s": np.diff(ends)[args.warmup - 1:].tolist(),
            "batch_shape": {k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")},
            "mixed_precision": trainer.accelerator.mixed_precision,  # "no": float32
            "mean_loss": mean_loss, "rss_after_imports_mib": after_imports,
            "torch_threads": torch.get_num_threads()}


def measure(objective: str, inputs: dict, args) -> dict:
    runs, loads = {side: [] for side in SIDES}, {side: [] for side in SIDES}
    for i in range(args.repeats):
        for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
            settings = (f"--{name}={getattr(args, name.replace('-', '_'))}"
                        for name in ("batch", "seq-len", "warmup", "steps", "threads"))
            loads[side].append(os.getloadavg()[0])
            try:
                runs[side].append(run_child([__file__, "--child", side, "--objective", objective,
                                             "--folder", inputs["folder"], "--data",
                                             inputs[objective], *settings]))
            except subprocess.CalledProcessError as error:
                sys.exit(f"the {side} {objective} child failed:\n{error.stderr[-4000:]}")
            print(f"{objective} {side} repeat {i + 1}: median step "
                  f"{statistics.median(runs[side][-1]['step_s']):.3f} s (load average "
                  f"{loads[side][-1]:.1f} before)", flush=True)
    tokens = args.batch * args.seq_len * (2 if objective == "dpo" else 1)
    row = {"objective": objective, "tokens_per_step": tokens, "batch": args.batch,
           "seq_len": args.seq_len, "warmup": args.warmup, "timed_steps": args.steps,
           "tfx_compiles": max(c["compiles"] for c in runs["tfx"]),
           "tfx_compile_s": statistics.median(c["compile_s"] for c in runs["tfx"]),
           "loss_token_share": runs["tfx"][0]["loss_token_share"],
           "trl_mixed_precision": runs["trl"][0]["mixed_precision"],
           "torch_threads": runs["trl"][0]["torch_threads"]}
    for side, children in runs.items():
        medians = [statistics.median(c["step_s"]) for c in children]
        row.update({f"{side}_step_s": statistics.median(medians),
                    f"{side}_step_s_repeats": medians, f"{side}_load_before": loads[side],
                    f"{side}_tokens_per_s": tokens / statistics.median(medians),
                    f"{side}_peak_rss_mib": max(c["peak_rss_mib"] for c in children),
                    f"{side}_rss_after_imports_mib": max(c["rss_after_imports_mib"]
                                                         for c in children),
                    f"{side}_batch_shape": children[0]["batch_shape"],
                    f"{side}_mean_loss": [c["mean_loss"] for c in children]})
    row["vs_trl"] = row["tfx_tokens_per_s"] / row["trl_tokens_per_s"]
    row["vs_trl_fastest"] = min(row["trl_step_s_repeats"]) / min(row["tfx_step_s_repeats"])
    return row


def render(results: dict) -> str:
    """The markdown report of a results dict (as written by --json)."""
    rows = list(results["objectives"].values())
    first = rows[0]
    lines = [
        f"Command: `{results['command']}` at revision `{results['revision']}` "
        f"({results['date']}); jax {results['jax']}, flax {results['flax']}, torch "
        f"{results['torch']}, transformers {results['transformers']}, trl {results['trl']}, "
        f"peft {results['peft']}; {results['cpus']} CPUs ({results['cpus_usable']} usable), "
        "torch threads "
        f"{first['torch_threads']}, XLA's default; load average (1 min) "
        f"{results['load_average_before'][0]:.1f} before, "
        f"{results['load_average_after'][0]:.1f} after.",
        "",
        f"## LoRA fine-tuning step, batch {first['batch']} x {first['seq_len']}, float32",
        "",
        f"LLaMA 4 x 256 (MLP 688, 8 heads, 4 KV), vocab {results['vocab']}; LoRA rank {RANK}, "
        f"alpha {ALPHA:g} on q, k, v, o, gate, up, down; loss on the completions; rows padded "
        "to the sequence length, no packing (dpo: chosen and rejected rows). Medians over "
        f"{results['repeats']} alternating child processes per side of each one's median of "
        f"{first['timed_steps']} steps after {first['warmup']} warmup steps (\"fastest "
        "children\": tfx / TRL of each side's fastest child). Peak RSS: the "
        "child's ru_maxrss (after imports in brackets). Goal: tfx / TRL >= 1.2.",
        "",
        markdown_table(
            ["objective", "tokens/step", "tfx tokens/s", "TRL tokens/s", "tfx / TRL",
             "fastest children", "tfx step s", "TRL step s", "tfx peak RSS MiB", "TRL peak RSS MiB",
             "tfx compiles"],
            [[r["objective"], r["tokens_per_step"], r["tfx_tokens_per_s"],
              r["trl_tokens_per_s"], r["vs_trl"], r["vs_trl_fastest"], r["tfx_step_s"],
              r["trl_step_s"],
              f"{r['tfx_peak_rss_mib']:.0f} ({r['tfx_rss_after_imports_mib']:.0f})",
              f"{r['trl_peak_rss_mib']:.0f} ({r['trl_rss_after_imports_mib']:.0f})",
              f"{r['tfx_compiles']} ({r['tfx_compile_s']:.1f} s)"] for r in rows]),
        "",
    ]
    for r in rows:
        lines.append(
            f"- {r['objective']}: step seconds per child, tfx "
            f"{', '.join(f'{s:.3f}' for s in r['tfx_step_s_repeats'])}; TRL "
            f"{', '.join(f'{s:.3f}' for s in r['trl_step_s_repeats'])} (load average before "
            f"each: tfx {', '.join(f'{x:.1f}' for x in r['tfx_load_before'])}; TRL "
            f"{', '.join(f'{x:.1f}' for x in r['trl_load_before'])}). Loss tokens "
            f"{r['loss_token_share']:.0%} of the positions. Batches: tfx {r['tfx_batch_shape']}"
            f", TRL {r['trl_batch_shape']} (mixed precision: {r['trl_mixed_precision']}).")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=OBJECTIVES)
    parser.add_argument("--batch", type=int, default=4, help="rows (dpo: pairs) per step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per child (>= 1: the first compiles)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per child")
    parser.add_argument("--repeats", type=int, default=3, help="child processes per side")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch.set_num_threads in the TRL children (default: the CPUs this "
                             "process may use, as XLA takes them)")
    parser.add_argument("--quick", action="store_true", help="1 repeat, 2 warmup, 2 steps")
    add_output_arguments(parser)
    for name in ("--child", "--objective", "--folder", "--data"):  # a child's own arguments
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child != "trl":
        keep_freed_memory()  # as the tfx command does, before JAX starts
    if args.child:
        result = (tfx_child if args.child == "tfx" else trl_child)(args)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        print(json.dumps({**result, "peak_rss_mib": peak}))
        return
    if args.quick:
        args.repeats, args.warmup, args.steps = 1, 2, 2
    for name in ("batch", "seq_len", "warmup", "steps", "repeats", "threads"):
        if getattr(args, name) < (2 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} must be >= {2 if name == 'warmup' else 1}")
    versions = {name: importlib.metadata.version(name) for name in ("flax", "trl", "peft")}
    results = {**provenance("finetune.py"), **versions, "repeats": args.repeats,
               "cpus_usable": len(os.sched_getaffinity(0)),
               "load_average_before": os.getloadavg(), "objectives": {}}
    with tempfile.TemporaryDirectory() as root:
        inputs = write_inputs(pathlib.Path(root), args.seq_len)
        results["vocab"] = inputs["vocab"]
        for objective in args.objectives:
            row = results["objectives"][objective] = measure(objective, inputs, args)
            print(f"{objective}: tfx {row['tfx_tokens_per_s']:.0f} tokens/s, TRL "
                  f"{row['trl_tokens_per_s']:.0f} tokens/s, tfx / TRL {row['vs_trl']:.2f}",
                  flush=True)
    results["load_average_after"] = os.getloadavg()
    publish(render(results), results, json_path=args.json, markdown_path=markdown_path(args))


if __name__ == "__main__":
    main()
