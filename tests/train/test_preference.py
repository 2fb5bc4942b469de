"""DPO / IPO / SimPO (tfx.train.preference) against TRL 1.16's own loss code on the same numbers,
completion log-probs against a per-token loop, the DPO loss of a small LoRA decoder (log 2 at
init, no gradient through the reference, a margin that training raises) and the batches of
PreferenceFeed."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tfx.models import DecoderConfig, create
from tfx.peft import LoRA, PeftParam
from tfx.train.preference import (
    METRICS,
    PreferenceFeed,
    completion_logps,
    dpo_loss,
    preference_loss,
    reference_logps,
    simpo_loss,
)
from tfx.train.step import init_train_state, make_eval_step, make_train_step

VOCAB, EOS = 24, 2
SMALL = DecoderConfig(vocab_size=VOCAB, d_model=16, num_heads=2, d_ff=32, num_layers=1,
                      max_len=32, position="rope", norm={"kind": "rms"}, use_bias=False)
TRL_NAMES = {"rewards_chosen": "rewards/chosen", "rewards_rejected": "rewards/rejected",
             "rewards_margin": "rewards/margins", "rewards_accuracy": "rewards/accuracies",
             "logps_chosen": "logps/chosen", "logps_rejected": "logps/rejected"}


@dataclasses.dataclass(frozen=True)
class Pair:  # the fields of tfx.train.instructions' preference pairs
    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


def _pairs(n: int, seed: int = 0) -> list[Pair]:
    """Synthetic preferences: answers of tokens from the upper half of the vocabulary are
    chosen over answers from the lower half; both end with EOS."""
    rng = np.random.default_rng(seed)
    half = (3 + VOCAB) // 2
    out = []
    for _ in range(n):
        prompt = np.asarray([1, *rng.integers(3, VOCAB, rng.integers(2, 5))], np.int32)
        length = rng.integers(1, 4)
        out.append(Pair(prompt, np.asarray([*rng.integers(half, VOCAB, length), EOS], np.int32),
                        np.asarray([*rng.integers(3, half, length), EOS], np.int32)))
    return out


class _Feed(PreferenceFeed):
    """PreferenceFeed over hand-made pairs and a stand-in tokenizer (no pad id: EOS pads)."""

    @classmethod
    def tokenizer_of(cls, experiment):
        return SimpleNamespace(pad_id=None, eos_id=EOS)

    def _read(self, experiment):
        return _pairs(40)


def _experiment(batch_size=4, seq_len=9, eval_batches=2, seed=0):
    return SimpleNamespace(
        train=SimpleNamespace(batch_size=batch_size, seq_len=seq_len, seed=seed,
                              eval_batches=eval_batches),
        data=SimpleNamespace(source="pairs.jsonl", tokenizer="tok", val_fraction=0.2,
                             skip_bad_lines=False))


def _lora_model(perturb: float = 0.0):
    """SMALL (seed 0) with LoRA; perturb > 0 moves every factor by that much noise (b is zero
    at init), as training would."""
    model = create(SMALL, rngs=nnx.Rngs(0))
    LoRA(rank=2, targets=("query", "value", "up", "down", "head")).attach(model, rngs=nnx.Rngs(1))
    if perturb:
        for i, (_, f) in enumerate(nnx.to_flat_state(nnx.state(model, PeftParam))):
            f[...] = f[...] + perturb * jax.random.normal(jax.random.key(i), f.shape)
    return model


# ---- TRL 1.16, called as it is: DPOTrainer._compute_loss and CPOTrainer.cpo_loss with a
# stand-in `self` holding the attributes they read, and stand-in models returning per-token
# log-probs as TRL's fused LM head does (zero where the label is -100).

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")


class _ScoredLM(torch.nn.Module):
    is_gradient_checkpointing = False

    def __init__(self, per_token):  # float [2B, T - 1]: log p of token t + 1 at t
        super().__init__()
        self.per_token = torch.as_tensor(np.asarray(per_token, np.float32))

    def forward(self, *, input_ids, attention_mask, labels, fused_lm_head, use_cache):
        mask = labels[:, 1:] != -100
        zeros = torch.zeros_like(self.per_token)
        return SimpleNamespace(log_probs=self.per_token.masked_fill(~mask, 0.0), entropy=zeros,
                               mean_logits=zeros, is_top1=zeros.bool(), aux_loss=None)


def _trl_dpo(policy, reference, rows, masks, *, beta, loss_type):
    """TRL's DPO loss and logged metrics for rows int [2B, T] (chosen then rejected) with
    completion masks [2B, T] and per-token log-probs [2B, T - 1] of policy and reference."""
    from trl import DPOTrainer

    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x,
                                  gather_for_metrics=lambda x: x, unwrap_model=lambda m: m)
    policy_model = _ScoredLM(policy)
    trainer = SimpleNamespace(
        model=policy_model, ref_model=_ScoredLM(reference), accelerator=accelerator,
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=False,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=0.0, use_weighting=False,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.as_tensor(np.asarray(rows, np.int64)),
              "attention_mask": torch.ones(np.shape(rows), dtype=torch.int64),
              "completion_mask": torch.as_tensor(np.asarray(masks, np.int64))}
    loss = DPOTrainer._compute_loss(trainer, policy_model, inputs, return_outputs=False)
    return float(loss), {k: v[0] for k, v in trainer._metrics["train"].items()}


def _trl_cpo(chosen, rejected, *, beta, loss_type, label_smoothing=0.0, gamma=0.0):
    from trl.experimental.cpo import CPOTrainer

    trainer = SimpleNamespace(alpha=0.0, beta=beta, loss_type=loss_type, simpo_gamma=gamma,
                              label_smoothing=label_smoothing,
                              accelerator=SimpleNamespace(device=torch.device("cpu")))
    out = CPOTrainer.cpo_loss(trainer, torch.as_tensor(np.asarray(chosen, np.float32)),
                              torch.as_tensor(np.asarray(rejected, np.float32)))
    return [t.numpy() for t in out]


def _random_case(pairs=5, width=9, seed=0):
    """Per-token log-probs of policy and reference [2B, width - 1], rows and completion masks
    [2B, width] whose first token is never a completion token (TRL's IPO counts the unshifted
    mask)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, VOCAB, (2 * pairs, width))
    starts = rng.integers(1, width - 1, 2 * pairs)[:, None]
    ends = np.minimum(starts + rng.integers(1, 5, 2 * pairs)[:, None], width)
    masks = (np.arange(width) >= starts) & (np.arange(width) < ends)
    policy, reference = (-rng.exponential(2.0, (2, 2 * pairs, width - 1))).astype(np.float32)
    return policy, reference, rows, masks


@pytest.mark.parametrize("loss_type, beta", [("sigmoid", 0.1), ("sigmoid", 0.7), ("ipo", 0.1),
                                             ("ipo", 0.5)])
def test_preference_loss_is_trls(loss_type, beta):
    policy, reference, rows, masks = _random_case()
    want, metrics = _trl_dpo(policy, reference, rows, masks, beta=beta, loss_type=loss_type)
    targets = masks[:, 1:]
    (pc, pr), (rc, rr), (cc, cr) = (np.split((x * targets).sum(-1), 2) for x in
                                    (policy, reference, np.ones_like(policy)))
    losses, chosen, rejected = preference_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type,
                                               chosen_count=cc, rejected_count=cr)
    np.testing.assert_allclose(float(losses.mean()), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(chosen.mean()), metrics["rewards/chosen"], rtol=1e-6)
    np.testing.assert_allclose(float(rejected.mean()), metrics["rewards/rejected"], rtol=1e-6)


def test_conservative_dpo_and_simpo_are_trls():
    # TRL 1.16's DPO "sigmoid" no longer reads label_smoothing; its CPO keeps the conservative
    # form -(1-ε)·log σ(βx) - ε·log σ(-βx), with x = the policy's log-ratio: given the log-ratios
    # against the reference, that is conservative DPO.
    rng = np.random.default_rng(1)
    pc, pr, rc, rr = -rng.exponential(3.0, (4, 6)).astype(np.float32)
    losses, chosen, rejected = preference_loss(pc, pr, rc, rr, beta=0.3, label_smoothing=0.2)
    want, want_chosen, want_rejected = _trl_cpo(pc - rc, pr - rr, beta=0.3, loss_type="sigmoid",
                                                label_smoothing=0.2)
    for got, ref in ((losses, want), (chosen, want_chosen), (rejected, want_rejected)):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    losses, chosen, rejected = simpo_loss(pc / 3, pr / 5, beta=2.0, gamma=0.5)
    for got, ref in zip((losses, chosen, rejected),
                        _trl_cpo(pc / 3, pr / 5, beta=2.0, loss_type="simpo", gamma=0.5),
                        strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_of_a_lora_model_is_trls(loss_type):
    feed = _Feed(_experiment(batch_size=5))
    batch = feed.train(0)
    model = _lora_model(perturb=0.3)
    rows = np.concatenate([batch["chosen"], batch["rejected"]])
    masks = np.concatenate([batch["chosen_mask"], batch["rejected_mask"]])

    def per_token(logits):
        logps = jax.nn.log_softmax(np.asarray(logits, np.float32), -1)
        return np.take_along_axis(np.asarray(logps), rows[:, 1:, None], -1)[..., 0]

    policy = per_token(model(rows[:, :-1]))
    reference = per_token(create(SMALL, rngs=nnx.Rngs(0))(rows[:, :-1]))  # before LoRA
    want, metrics = _trl_dpo(policy, reference, rows, masks, beta=0.5, loss_type=loss_type)
    total, count, sums = dpo_loss(model, batch, None, beta=0.5, loss_type=loss_type)
    assert float(count) == 5 and float(sums["pairs"]) == 5
    np.testing.assert_allclose(float(total) / 5, want, rtol=1e-5, atol=1e-6)
    for name in METRICS:
        np.testing.assert_allclose(float(sums[name]) / 5, metrics[TRL_NAMES[name]],
                                   rtol=1e-5, atol=1e-5, err_msg=name)


def test_completion_logps_is_the_per_token_sum():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 5, 7)).astype(np.float32) * 3
    labels, mask = rng.integers(0, 7, (3, 5)), rng.random((3, 5)) < 0.6
    total, count = completion_logps(jnp.asarray(logits, jnp.bfloat16), labels, mask)
    total32, _ = completion_logps(logits, labels, mask)
    for b in range(3):
        want = 0.0
        for t in range(5):
            if mask[b, t]:
                row = logits[b, t].astype(np.float64)
                want += row[labels[b, t]] - math.log(np.exp(row).sum())
        np.testing.assert_allclose(float(total32[b]), want, rtol=1e-5)
        np.testing.assert_allclose(float(total[b]), want, rtol=0.05, atol=0.1)  # bf16 input
        assert float(count[b]) == mask[b].sum()
    assert total.dtype == jnp.float32


def test_dpo_loss_is_log_2_at_init_and_the_reference_gets_no_gradient():
    batch = _Feed(_experiment()).train(3)
    total, count, sums = dpo_loss(_lora_model(), batch, None)
    assert float(total) / float(count) == pytest.approx(math.log(2), abs=1e-7)
    for name in ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy"):
        assert float(sums[name]) == 0.0
    # With trained factors: the gradient over every parameter, frozen weights included, is
    # the one with the reference's log-probs given as constants.
    model = _lora_model(perturb=0.3)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_chosen, ref_rejected = reference_logps(create(SMALL, rngs=nnx.Rngs(0)), batch)
    given = {**batch, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}

    @jax.jit
    def grads(b):
        return jax.grad(lambda p: dpo_loss(nnx.merge(graphdef, p, rest), b, None)[0])(params)

    for g, h in zip(jax.tree.leaves(grads(batch)), jax.tree.leaves(grads(given)), strict=True):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-7)


def test_full_fine_tuning_needs_precomputed_reference_log_probs():
    feed = _Feed(_experiment())
    model = create(SMALL, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"ref_chosen_logps.*no LoRA"):
        dpo_loss(model, feed.train(0), None)
    model.eval()
    feed.precompute_reference(jax.jit(lambda b: reference_logps(model, b)))
    for batch in (feed.train(0), *feed.validation()):
        total, count, _ = dpo_loss(model, batch, None)
        assert float(total) / float(count) == pytest.approx(math.log(2), abs=1e-5)
    # SimPO needs no reference at all
    total, _, _ = dpo_loss(model, _Feed(_experiment()).train(0), None, loss_type="simpo")
    assert np.isfinite(float(total))


def test_training_with_the_house_step_raises_the_margin():
    feed = _Feed(_experiment(batch_size=8))
    model = _lora_model()
    optimizer, loss = optax.adam(3e-2), functools.partial(dpo_loss, beta=1.0)
    graphdef, rest, state = init_train_state(model, optimizer, seed=0, trainable=PeftParam)
    frozen = jax.tree.map(np.asarray, state.frozen)
    step = make_train_step(graphdef, rest, optimizer, loss, grad_accum=2)
    evaluate = make_eval_step(graphdef, rest, loss)

    def margin():
        sums = [evaluate(state, batch, jax.random.key(0))[2] for batch in feed.validation()]
        return sum(float(s["rewards_margin"]) for s in sums) / sum(float(s["pairs"])
                                                                   for s in sums)

    assert margin() == 0.0
    losses = []
    for k in range(12):
        state, metrics = step(state, feed.train(k))
        losses.append(float(metrics["loss"]))
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
    assert np.mean(losses[-4:]) < 0.6
    assert margin() > 0.15  # on held-out pairs: the preference generalises
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(state.frozen), strict=True):
        np.testing.assert_array_equal(a, b)


def test_feed_batches():
    experiment = _experiment(batch_size=6, seq_len=9)
    feed = _Feed(experiment)
    assert len(feed.pairs["val"]) == 8 and len(feed.pairs["train"]) == 32
    assert feed.tokens_per_batch == 2 * 6 * 9
    first, again = feed.train(5), _Feed(experiment).train(5)
    assert set(first) == {"chosen", "chosen_mask", "rejected", "rejected_mask"}
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
        assert first[key].shape == (6, 10)
    assert first["chosen"].dtype == np.int32 and first["chosen_mask"].dtype == bool
    assert not np.array_equal(first["chosen"], feed.train(6)["chosen"])
    other_seed = _Feed(_experiment(batch_size=6, seq_len=9, seed=1)).train(5)
    assert not np.array_equal(first["chosen"], other_seed["chosen"])
    for side in ("chosen", "rejected"):
        for row, mask in zip(first[side], first[f"{side}_mask"], strict=True):
            prompt, completion, padding = _parts(row, mask)
            assert any(np.array_equal(prompt, p.prompt)
                       and np.array_equal(completion, getattr(p, side))
                       for p in feed.pairs["train"])
            assert (padding == EOS).all()  # the tokenizer has no pad id: EOS pads
    validation = feed.validation()
    assert len(validation) == 2
    for a, b in zip(validation, feed.validation(), strict=True):
        np.testing.assert_array_equal(a["rejected"], b["rejected"])
    held_out = {tuple(p.prompt) for p in feed.pairs["val"]}
    assert all(tuple(_parts(row, mask)[0]) in held_out for batch in validation
               for row, mask in zip(batch["chosen"], batch["chosen_mask"], strict=True))


def _parts(row, mask):
    """(prompt, completion, padding) of a row whose mask must mark one contiguous span."""
    marked = np.flatnonzero(mask)
    start, end = marked[0], marked[-1] + 1
    assert (marked == np.arange(start, end)).all()
    return row[:start], row[start:end], row[end:]


def test_bad_settings_are_named():
    x = jnp.zeros(2)
    with pytest.raises(ValueError, match="beta"):
        preference_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        preference_loss(x, x, x, x, beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="loss_type"):
        preference_loss(x, x, x, x, beta=0.1, loss_type="hinge")
    with pytest.raises(ValueError, match="chosen_count"):
        preference_loss(x, x, x, x, beta=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match="gamma"):
        simpo_loss(x, x, beta=0.1, gamma=-1.0)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(None, {}, None, loss_type="kto")
    long = Pair(np.arange(3, 9, dtype=np.int32), np.full(5, 4, np.int32), np.full(2, 5, np.int32))

    feed = _Feed(_experiment(seq_len=9))
    feed.pairs = {"train": [long], "val": [long]}
    with pytest.raises(ValueError, match="seq_len"):
        feed.train(0)


def test_a_jsonl_file_through_the_dpo_objective(tmp_path):
    """The whole path: JSONL pairs -> read_preference -> PreferenceFeed -> the objective's loss
    (log 2 for a LoRA model at init)."""
    transformers = pytest.importorskip("transformers")
    from hf_folders import CHATML, chat_tokenizer

    from tfx.train.config import DataConfig, Experiment, TrainConfig
    from tfx.train.objectives import get_objective

    chat_tokenizer(transformers, tmp_path / "tokenizer", CHATML)
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"what is {i}?", "chosen": f"it is {i}",
                                          "rejected": "no idea"}) + "\n" for i in range(12)))
    experiment = Experiment(
        name="dpo", objective="dpo", model=SMALL.replace(vocab_size=512),
        train=TrainConfig(batch_size=3, seq_len=40, eval_batches=1),
        data=DataConfig(source=str(source), tokenizer=str(tmp_path / "tokenizer")))
    objective = get_objective("dpo")
    feed = objective.batches(experiment)
    batch = feed.train(0)
    eos = feed.tokenizer.eos_id
    for side in ("chosen", "rejected"):
        for row, mask in zip(batch[side], batch[f"{side}_mask"], strict=True):
            _, completion, padding = _parts(row, mask)
            assert completion[-1] == eos and (padding == feed.pad_id).all()
            answer = feed.tokenizer.decode(completion[:-1]).strip()
            assert answer.startswith("it is ") if side == "chosen" else answer == "no idea"
    model = create(experiment.model, rngs=nnx.Rngs(0))
    LoRA(rank=2).attach(model, rngs=nnx.Rngs(1))
    total, count, _ = objective.loss(experiment)(model, batch, None)
    assert float(total) / float(count) == pytest.approx(math.log(2), abs=1e-6)
