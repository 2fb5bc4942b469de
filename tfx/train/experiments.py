"""Named experiments that `tfx train NAME` runs. Each is a complete `Experiment`; command-line
overrides change fields (`--model.num_layers=4`).

- gpt_char (the default): the char-gpt preset, a byte-level LLaMA-style GPT, trained on the
  embedded corpus (the Python standard library's source): 300 steps of 16 x 128 bytes take
  the validation loss from 5.5 to about 1.6 nats/byte, and the samples look like Python, in
  a few minutes on 2 CPU cores.
- bert_mlm: a small BERT pretrained with masked LM on the same bytes.
- seq2seq_reverse: a small encoder–decoder learning to reverse strings.
- seq2seq_addition: the same encoder–decoder learning to add numbers of 2 to 8 digits.
- moe_gpt: gpt_char with a mixture of 8 experts (top-2, dropless) in every layer, the same
  active parameters per token, and the load-balancing and router z losses in the loss.
- sft: supervised fine-tuning of a Hugging Face model (`--init-from FOLDER`, which gives the
  model and its tokenizer) on a JSONL file of prompt/completion pairs or chats, the loss on the
  answers only.
- dpo: preference tuning (DPO, IPO or SimPO: experiment.preference) of such a model on a JSONL
  file of prompt/chosen/rejected triples.
- posenc_<kind>: gpt_char at context 128 with each positional encoding, for comparisons on equal
  footing (learned, sinusoidal, rope, t5, xl, alibi, none); sinusoidal positions with token
  embeddings scaled by sqrt(d_model), as Vaswani et al. do.
"""

from __future__ import annotations

import dataclasses

from tfx.models.config import (
    POSITIONS,
    EmbeddingsConfig,
    EncoderConfig,
    EncoderDecoderConfig,
    MlpConfig,
    NormConfig,
    SpecialTokens,
)
from tfx.models.presets import PRESETS
from tfx.train.config import DataConfig, Experiment, OptimConfig, TrainConfig

__all__ = ["DEFAULT_EXPERIMENT", "EXPERIMENTS", "get_experiment"]

DEFAULT_EXPERIMENT = "gpt_char"

# Byte-level vocabularies: ids 0..255 are bytes, the special tokens follow
# (tfx.train.tokens.MLM_SPECIALS and SEQ2SEQ_SPECIALS; the feeds check the ids named here).

_GPT_CHAR = Experiment(
    name="gpt_char", objective="causal_lm", model=PRESETS["char-gpt"],
    train=TrainConfig(steps=300, batch_size=16, seq_len=128, eval_every=100,
                      checkpoint_every=100),
    optim=OptimConfig(learning_rate=2e-3, warmup_steps=40))

_BERT_MLM = Experiment(
    name="bert_mlm", objective="mlm",
    model=EncoderConfig(vocab_size=256 + 4, d_model=256, num_layers=4,
                        num_heads=4, d_ff=1024, max_len=128, position="learned",
                        norm=NormConfig(kind="layer", eps=1e-12, pre_norm=False),
                        mlp=MlpConfig(activation="gelu"), dropout=0.0,
                        special_tokens=SpecialTokens(pad_id=256, cls_id=257, sep_id=258,
                                                     mask_id=259)),
    train=TrainConfig(steps=400, batch_size=32, seq_len=128, eval_every=100,
                      checkpoint_every=100),
    optim=OptimConfig(learning_rate=1e-3, warmup_steps=40, b2=0.98))

_SEQ2SEQ_REVERSE = Experiment(
    name="seq2seq_reverse", objective="seq2seq",
    model=EncoderDecoderConfig(vocab_size=256 + 3, d_model=128,
                               num_layers=2, num_heads=4, d_ff=512, max_len=64,
                               position="sinusoidal", norm=NormConfig(kind="layer", eps=1e-6),
                               mlp=MlpConfig(activation="relu"), decoder_start_token_id=257,
                               embeddings=EmbeddingsConfig(scale=True)),
    data=DataConfig(task="reverse", min_len=4, max_len=16),
    train=TrainConfig(steps=600, batch_size=64, seq_len=32, eval_every=200,
                      checkpoint_every=200),
    optim=OptimConfig(learning_rate=1e-3, warmup_steps=50, weight_decay=0.01),
    label_smoothing=0.1)


_SEQ2SEQ_ADDITION = dataclasses.replace(
    _SEQ2SEQ_REVERSE, name="seq2seq_addition", data=DataConfig(task="addition", min_len=2,
                                                               max_len=8),
    train=dataclasses.replace(_SEQ2SEQ_REVERSE.train, steps=800))

_MOE_GPT = dataclasses.replace(_GPT_CHAR, name="moe_gpt", model=PRESETS["char-moe"])


# Fine-tuning a Hugging Face model (--init-from FOLDER gives the model and tokenizer; the
# llama-tiny shape is only the model trained from scratch without one). The learning rates are
# LoRA's usual ones; a full fine-tune wants about a tenth.
_SFT = Experiment(
    name="sft", objective="sft", model=PRESETS["llama-tiny"],
    train=TrainConfig(steps=200, batch_size=8, seq_len=256, eval_every=50, eval_batches=4,
                      checkpoint_every=50, log_every=5),
    optim=OptimConfig(learning_rate=2e-4, warmup_steps=10, weight_decay=0.0))

_DPO = dataclasses.replace(
    _SFT, name="dpo", objective="dpo",
    optim=dataclasses.replace(_SFT.optim, learning_rate=5e-5))


def _posenc(position: str) -> Experiment:
    # Sinusoidal positions come with embeddings scaled by sqrt(d_model), as in Vaswani et al.
    model = PRESETS["char-gpt"].replace(position=position, max_len=1024,
                                        embeddings={"scale": position == "sinusoidal"})
    return dataclasses.replace(
        _GPT_CHAR, name=f"posenc_{position}", model=model,
        train=dataclasses.replace(_GPT_CHAR.train, seq_len=128, batch_size=32))


EXPERIMENTS: dict[str, Experiment] = {
    e.name: e for e in (_GPT_CHAR, _MOE_GPT, _BERT_MLM, _SEQ2SEQ_REVERSE, _SEQ2SEQ_ADDITION,
                        _SFT, _DPO, *(_posenc(p) for p in POSITIONS))}


def get_experiment(name: str | None = None) -> Experiment:
    """The experiment called `name` (default: gpt_char)."""
    name = DEFAULT_EXPERIMENT if name is None else name
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; experiments: {sorted(EXPERIMENTS)}")
    return EXPERIMENTS[name]
