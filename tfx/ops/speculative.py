"""Speculative sampling's accept/reject rule on plain arrays (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling").

A cheap draft model proposes tokens x_1..x_k, drawn from its distributions q_1..q_k; the target
model scores them all at once, giving p_1..p_{k+1}. Draft token x_i is accepted with
probability min(1, p_i(x_i) / q_i(x_i)), in order, up to the first rejection; a rejected one is
replaced by a draw from normalize(max(0, p_i - q_i)), and when all k are accepted a bonus token
is drawn from p_{k+1}. Each emitted token is then distributed exactly as the target alone would
draw it. Greedy decoding is the same rule with one-hot distributions (`token_probs` at
temperature 0): a draft token is accepted exactly when it is the target's argmax, and the
replacement is the target's argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfx.ops.sampling import filter_logits

__all__ = ["draw", "token_probs", "verify_draft"]


@jax.jit
def token_probs(logits: jax.Array, *, temperature: jax.Array, top_k: jax.Array | None = None,
                top_p: jax.Array | None = None) -> jax.Array:
    """The distribution `tfx.ops.sampling.sample_logits` draws from, as probabilities.

    Args:
      logits: float [..., vocab].
      temperature: float scalar >= 0; 0 gives the one-hot of the argmax (greedy).
      top_k: as in `tfx.ops.sampling.filter_logits` (None: off); applied after the
        temperature, as the sampler does.
      top_p: as in `tfx.ops.sampling.filter_logits` (None: off), after top_k.
    Returns:
      float32 [..., vocab]: softmax(filter(logits / temperature)), or one-hot at temperature 0.
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab).astype(jnp.float32)
    greedy = jax.nn.one_hot(jnp.argmax(flat, axis=-1), vocab, dtype=jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    scaled = flat / jnp.where(temperature > 0, temperature, 1.0)
    sampled = jax.nn.softmax(filter_logits(scaled, top_k=top_k, top_p=top_p), axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).reshape(logits.shape)


def draw(rng: jax.Array | None, probs: jax.Array) -> jax.Array:
    """A token from probabilities float [batch, vocab] -> int32 [batch] (zero-probability
    tokens are never drawn, so a one-hot gives its token); rng None: the most likely token
    (greedy decoding, with no random numbers to generate)."""
    if rng is None:
        return jnp.argmax(probs, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, jnp.log(probs), axis=-1).astype(jnp.int32)


@jax.jit
def verify_draft(target_probs: jax.Array, draft_probs: jax.Array, draft_tokens: jax.Array,
                 limit: jax.Array, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Judge draft tokens against the target's distributions.

    Args:
      target_probs: float [batch, k + 1, vocab], p_1..p_{k+1}: the target's distribution for
        each draft position and the one after the last.
      draft_probs: float [batch, k, vocab], q_1..q_k, from which the draft tokens were drawn.
      draft_tokens: int [batch, k], x_1..x_k.
      limit: int [batch] in [0, k]: only x_1..x_limit are judged (the rest are never accepted).
      rng: a jax.random key; or None for one-hot (greedy) distributions: x_i is then accepted
        when p_i(x_i) >= q_i(x_i), i.e. when it is the target's argmax, and the next token is
        the argmax of what the rule draws from (the rule's deterministic limit, exact for
        one-hot p and q).
    Returns:
      accepted: int32 [batch] in [0, limit], the number of leading draft tokens accepted.
      next_token: int32 [batch], the token after them: drawn from normalize(max(0, p - q)) at
        position accepted + 1 when a judged token was rejected, else from p there (the bonus
        token; with accepted = limit < k its p is the caller's to trust).
    """
    batch, k = draft_tokens.shape
    p = jnp.take_along_axis(target_probs[:, :k], draft_tokens[..., None], axis=-1)[..., 0]
    q = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    judged = jnp.arange(k)[None, :] < limit[:, None]
    if rng is None:
        ok, residual_key = (q <= p) & judged, None
    else:  # u < p / q without dividing; q(x) > 0 since x was drawn from q
        uniform_key, residual_key = jax.random.split(rng)
        ok = (jax.random.uniform(uniform_key, (batch, k)) * q < p) & judged
    accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1, dtype=jnp.int32)
    rows = jnp.arange(batch)
    # Unjudged positions (and the bonus one) subtract nothing: their residual is p itself.
    q_padded = jnp.pad(jnp.where(judged[..., None], draft_probs, 0.0), ((0, 0), (0, 1), (0, 0)))
    residual = jnp.maximum(target_probs[rows, accepted] - q_padded[rows, accepted], 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    # p == q leaves no residual; a rejection then only comes from rounding: draw from p.
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0),
                         target_probs[rows, accepted])
    return accepted, draw(residual_key, residual)
