"""A tiny Hugging Face chat model and data to fine-tune it on, made here (nothing downloaded):
the whole fine-tuning path of docs/finetuning.md on a fresh machine, in minutes.

    python experiments/tiny_chat_model.py runs/tiny [--architecture Qwen2ForCausalLM]

writes into runs/tiny:
- model/: a small random causal LM written by transformers' `save_pretrained` beside its
  tokenizer (`tokenizer.json`, `tokenizer_config.json` with special tokens, the chat template)
  written by `PreTrainedTokenizerFast.save_pretrained` (needs torch and transformers: the
  parity extra);
- chats.jsonl (sft lines, {"messages": ...}), heldout.jsonl (more of them), prefs.jsonl
  ({"prompt", "chosen", "rejected"}) and tasks/ (a local lm-evaluation-harness task: a YAML and
  its data).
The tests make their folders with the same functions (`chat_model_folder(torch, transformers,
folder)`).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

# A ChatML template (Qwen 2.5's shape: a default system turn, <|im_start|> role lines, an
# optional generation prompt) and a LLaMA-3-like one that starts with the BOS token.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
SPECIALS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>")
CORPUS = ["the quick brown fox jumps over the lazy dog", "What is two plus two? It is four.",
          "You are a helpful assistant.", "system user assistant", "Hello! How can I help?",
          "def add(a, b):\n    return a + b\n"]
# Small, but with every piece a LLaMA-family model has: GQA, RoPE, SwiGLU, untied head.
MODEL_FIELDS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    tie_word_embeddings=False)


def tokenizer_file(folder: pathlib.Path) -> pathlib.Path:
    """A byte-level BPE `tokenizers` file (vocabulary about 400, SPECIALS first) in `folder`."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def chat_tokenizer(transformers, folder: pathlib.Path, template: str = CHATML):
    """transformers' fast tokenizer over `tokenizer_file`, with BOS <s>, EOS <|im_end|> (ChatML)
    or <|eot_id|> (LLAMA3), PAD <pad> and the chat template; saved into `folder`."""
    eos = "<|eot_id|>" if template == LLAMA3 else "<|im_end|>"
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file(folder)), bos_token="<s>", eos_token=eos,
        pad_token="<pad>", chat_template=template)
    tokenizer.save_pretrained(folder)
    return tokenizer


def chat_model_folder(torch, transformers, folder: pathlib.Path,
                      architecture: str = "LlamaForCausalLM", *, template: str = CHATML,
                      seed: int = 0) -> pathlib.Path:
    """`folder` holding a tiny random `architecture` (LlamaForCausalLM, Qwen2ForCausalLM, ...)
    and its chat tokenizer, as save_pretrained writes them; vocab, BOS, EOS and PAD ids from
    the tokenizer."""
    tokenizer = chat_tokenizer(transformers, folder, template)
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(**MODEL_FIELDS, vocab_size=len(tokenizer),
                          bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # norms are ones at init: perturb every weight so that all matter
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    return folder


QUESTIONS = [("What is two plus two?", "It is four."), ("Hello!", "Hello! How can I help?"),
             ("Who jumps over the dog?", "The quick brown fox."),
             ("What is one plus one?", "It is two."), ("Write add.", "def add(a, b):\n    "
                                                                   "return a + b")]
TASK = """task: tiny_qa
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_data(out: pathlib.Path) -> None:
    """chats.jsonl, heldout.jsonl, prefs.jsonl and tasks/ (see the module docstring)."""
    def chat(q, a):
        return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}

    def lines(records):
        return "".join(json.dumps(r) + "\n" for r in records)

    (out / "chats.jsonl").write_text(lines(chat(q, a) for q, a in QUESTIONS * 8))
    (out / "heldout.jsonl").write_text(lines(chat(q, a) for q, a in QUESTIONS))
    (out / "prefs.jsonl").write_text(lines(
        {"prompt": [{"role": "user", "content": q}],
         "chosen": [{"role": "assistant", "content": a}],
         "rejected": [{"role": "assistant", "content": "the lazy dog"}]}
        for q, a in QUESTIONS * 4))
    tasks = out / "tasks"
    tasks.mkdir(exist_ok=True)
    answers = [a for _, a in QUESTIONS]
    (tasks / "tiny_qa.jsonl").write_text(lines(
        {"question": q, "choices": answers, "answer": i} for i, (q, _) in enumerate(QUESTIONS)))
    (tasks / "tiny_qa.yaml").write_text(TASK.format(data=(tasks / "tiny_qa.jsonl").resolve()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=pathlib.Path, help="the folder to write")
    parser.add_argument("--architecture", default="LlamaForCausalLM",
                        help="LlamaForCausalLM, Qwen2ForCausalLM, ... (a transformers class)")
    args = parser.parse_args()
    import torch
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    template = LLAMA3 if args.architecture == "LlamaForCausalLM" else CHATML
    chat_model_folder(torch, transformers, args.out / "model", args.architecture,
                      template=template)
    write_data(args.out)
    print(f"wrote {args.out}/model ({args.architecture}), chats.jsonl, heldout.jsonl, "
          "prefs.jsonl and tasks/")


if __name__ == "__main__":
    main()
