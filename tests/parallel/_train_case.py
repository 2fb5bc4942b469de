"""The tiny training run shared by the parallel tests and their worker scripts: a 2-layer
char-gpt with grouped-query attention (4 heads, 2 key/value heads), d_model 64, trained for
STEPS AdamW steps on fixed random batches, on one device or sharded over a mesh."""

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import tfx.models
from tfx.nn.paths import path_name
from tfx.parallel import batch_sharding, global_batch, process_rows, shard, state_shardings
from tfx.train.config import OptimConfig
from tfx.train.objectives import causal_lm
from tfx.train.optim import make_optimizer
from tfx.train.step import init_train_state, make_train_step

MODEL = dict(num_layers=2, d_model=64, num_heads=4, attention={"num_kv_heads": 2}, d_ff=128)
# The same with 4 experts (top-2) in every layer. Each device of an expert-parallel mesh routes
# its own tokens, so the load-balancing loss is a mean over groups there: weight 0 in `train`,
# so that the runs compute the same thing (the layer itself is compared with losses in
# test_expert_parallel.py).
MOE_MODEL = dict(MODEL, moe={"num_experts": 4, "experts_per_token": 2, "d_ff": 64})
BATCH, SEQ, STEPS, LEARNING_RATE = 16, 32, 3, 1e-3


def batches() -> list[np.ndarray]:
    """STEPS global batches of tokens, int32 [BATCH, SEQ + 1], the same in every process."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (BATCH, SEQ + 1), dtype=np.int32) for _ in range(STEPS)]


def setup(model: dict = MODEL):
    """(graphdef, rest, TrainState at step 0, optimizer) of char-gpt with `model`'s fields."""
    optimizer = make_optimizer(OptimConfig(learning_rate=LEARNING_RATE, warmup_steps=0), STEPS)
    model = tfx.models.create("char-gpt", rngs=nnx.Rngs(0), **model)
    return (*init_train_state(model, optimizer, seed=0), optimizer)


def abstract_state():
    """The TrainState's shapes and dtypes, computing nothing."""
    return jax.eval_shape(lambda: setup()[2])


def train(mesh=None, *, grad_accum: int = 1, model: dict = MODEL) -> dict:
    """Train on one device (mesh None) or sharded over `mesh`, each process feeding only its
    rows of every batch. Returns {"losses": [STEPS], "params": {path: array} (gathered),
    "specs": {path: str(PartitionSpec)} of every state leaf (sharded runs only),
    "shards": {path: shape of the first local shard}}."""
    graphdef, rest, state, optimizer = setup(model)
    shardings = None
    if mesh is not None:
        shardings = state_shardings(state, mesh)
        state = shard(state, shardings)
    step = make_train_step(graphdef, rest, optimizer, causal_lm, grad_accum=grad_accum,
                           state_sharding=shardings, mesh=mesh, load_balancing_weight=0.0)
    losses = []
    for tokens in batches():
        batch = {"tokens": tokens}
        if mesh is not None:
            rows = batch_sharding(mesh)
            batch = global_batch(process_rows(batch, rows), rows)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    leaves = jax.tree.leaves_with_path(state)
    return {
        "losses": losses,
        "params": {path_name(p): np.asarray(multihost_utils.process_allgather(x, tiled=True))
                   for p, x in jax.tree.leaves_with_path(state.params)},
        "specs": {path_name(p): str(x.sharding.spec) for p, x in leaves} if mesh else {},
        "shards": {path_name(p): list(x.addressable_shards[0].data.shape) for p, x in leaves},
    }


def assert_same_training(losses, params, ref_losses, ref_params, *,
                          learning_rate: float = LEARNING_RATE) -> None:
    """Sharded training computed what one device computes, up to float32 summation order.

    Losses agree to 1e-5 relative. Parameters: AdamW's first steps move each element by about
    ±learning_rate whatever its gradient's size, so an element whose gradient is at rounding
    level (a sum that cancels) may move a few percent of a step differently when the sum runs
    in another order; all others agree to 1e-6. A real fault (wrong rows, a missing all-reduce)
    moves nearly every element by O(learning_rate).
    """
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert params.keys() == ref_params.keys()
    diff = np.concatenate([np.abs(params[k] - ref_params[k]).ravel() for k in ref_params])
    assert diff.max() < 0.05 * learning_rate, diff.max()
    assert np.mean(diff > 1e-6) < 1e-4, np.sort(diff)[-10:]
