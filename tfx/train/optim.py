"""The optimiser: optax AdamW on a warmup + cosine schedule, with global-norm clipping and
weight decay on matrices only (not on norms' scales, biases or other vectors)."""

from __future__ import annotations

import jax
import optax

from tfx.train.config import OptimConfig

__all__ = ["learning_rate_schedule", "make_optimizer"]


def learning_rate_schedule(config: OptimConfig, steps: int) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then cosine decay to min_lr_ratio·peak at
    `steps` (warmup is capped below `steps` so short runs still decay)."""
    warmup = min(config.warmup_steps, max(steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1), end_value=config.learning_rate * config.min_lr_ratio)


def make_optimizer(config: OptimConfig, steps: int) -> optax.GradientTransformation:
    """optax chain: [clip_by_global_norm] -> adamw(schedule, decay on ndim >= 2 leaves)."""
    adamw = optax.adamw(learning_rate_schedule(config, steps), b1=config.b1, b2=config.b2,
                        weight_decay=config.weight_decay,
                        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    if config.grad_clip is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
