"""BERT's masked-language-model corruption (Devlin et al., 2019, §3.1), in pure JAX.

Call it inside the jitted train step with a fresh key per step, so the masks cost no host time
and differ between epochs over the same text.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["mask_tokens"]


def mask_tokens(rng: jax.Array, input_ids: jax.Array, *, mask_token_id: int, vocab_size: int,
                special_ids: tuple[int, ...], probability: float = 0.15,
                ) -> tuple[jax.Array, jax.Array]:
    """Choose tokens to predict and corrupt them the BERT way.

    Each token whose id is not in `special_ids` (pad, CLS, SEP, ...; `mask_token_id` always
    counts as special) is chosen independently with `probability`. Of the chosen, 80% become
    `mask_token_id`, 10% a random token drawn uniformly from the non-special ids in
    [0, vocab_size) (it may equal the original, as in BERT), and 10% stay unchanged.

    The keyword arguments are Python values (static under `jax.jit`).

    Args:
      rng: a PRNG key.
      input_ids: int [B, T].
    Returns:
      (masked_input_ids: [B, T] with input_ids' dtype, targets_mask: bool [B, T] True where chosen,
      i.e. where the loss predicts the original token).
    """
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must be in (0, 1), got {probability}")
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask_token_id must be in [0, vocab_size={vocab_size}), got "
                         f"{mask_token_id}")
    special = sorted({*special_ids, mask_token_id})
    if special[0] < 0 or special[-1] >= vocab_size:
        raise ValueError(f"special_ids must be in [0, vocab_size={vocab_size}), got {special_ids}")
    if len(special) == vocab_size:
        raise ValueError(f"special_ids leave no ordinary token in vocab_size={vocab_size}")
    input_ids = jnp.asarray(input_ids)
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise TypeError(f"input_ids must be integers, got dtype {input_ids.dtype}")

    ordinary = np.setdiff1d(np.arange(vocab_size), special)  # the random-token vocabulary
    choose_key, action_key, token_key = jax.random.split(rng, 3)
    eligible = ~jnp.isin(input_ids, jnp.asarray(special))
    chosen = eligible & (jax.random.uniform(choose_key, input_ids.shape) < probability)
    action = jax.random.uniform(action_key, input_ids.shape)
    random_ids = jnp.asarray(ordinary, input_ids.dtype)[
        jax.random.randint(token_key, input_ids.shape, 0, len(ordinary))]
    masked = jnp.where(action < 0.8, jnp.asarray(mask_token_id, input_ids.dtype),
                       jnp.where(action < 0.9, random_ids, input_ids))
    return jnp.where(chosen, masked, input_ids), chosen
