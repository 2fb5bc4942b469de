"""Worker for test_expert_parallel.py (run as a script): expert_parallel_moe on meshes of 8 CPU
devices against single-device references, each case's outcome ("ok" or the failure) written to
OUT.json.

    python _expert_parallel_worker.py OUT

References: dropless, the layer is `moe` on all tokens at once (outputs, routing and the
gradients of sum(out · ct) + router_z_loss; the z-loss is a mean over equal groups, so the mean
of the group means is the global one). With a capacity, it is `moe` applied to each group (the
tokens of one device, in mesh order) separately, outputs concatenated and the losses averaged;
there the gradients of sum(out · ct) + load_balancing_loss + router_z_loss are compared.
"""

import os

# Before jax starts: 8 CPU devices, beside the test session's XLA flags (tests/conftest.py:
# the cheapest compiles; the cases are tiny).
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                           + os.environ.get("XLA_FLAGS", ""))
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses
import json
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tfx.nn.moe import MoE
from tfx.ops.moe import ExpertWeights, expert_parallel_moe, moe
from tfx.parallel import make_mesh, param_specs

TOKENS, D_MODEL, EXPERTS, D_FF = 32, 8, 8, 16
TOL = dict(rtol=1e-5, atol=1e-6)


def inputs(gated: bool, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (TOKENS, D_MODEL))
    router = jax.random.normal(keys[1], (D_MODEL, EXPERTS))
    weights = ExpertWeights(
        gate=jax.random.normal(keys[2], (EXPERTS, D_MODEL, D_FF)) * 0.3 if gated else None,
        up=jax.random.normal(keys[3], (EXPERTS, D_MODEL, D_FF)) * 0.3,
        down=jax.random.normal(keys[4], (EXPERTS, D_FF, D_MODEL)) * 0.3)
    cotangent = jax.random.normal(keys[5], (TOKENS, D_MODEL))
    return x, router, weights, cotangent


def per_group_moe(x, router, weights, groups: int, rng=None, **kwargs):
    """`moe` on each group of tokens alone (rng folded with the group index): outputs and
    routing fields concatenated, losses averaged."""
    keys = None if rng is None else jax.vmap(lambda g: jax.random.fold_in(rng, g))(
        jnp.arange(groups))
    out, routing = jax.vmap(lambda xg, key: moe(xg, router, weights, rng=key,
                                                implementation="onehot", **kwargs))(
        x.reshape(groups, -1, x.shape[-1]), keys)
    fields = {name: getattr(routing, name).reshape(x.shape[0], -1)
              for name in ("expert_ids", "weights", "kept", "slot")}
    losses = {name: jnp.mean(getattr(routing, name))
              for name in ("load_balancing_loss", "router_z_loss")}
    return out.reshape(x.shape), {**fields, **losses}, routing.capacity


def routing_dict(routing):
    return {name: getattr(routing, name) for name in (
        "expert_ids", "weights", "kept", "slot", "load_balancing_loss", "router_z_loss")}


def assert_close(actual, expected, what):
    for (path, a), b in zip(jax.tree.leaves_with_path(actual), jax.tree.leaves(expected),
                            strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")


def value_and_grads(layer, with_balance: bool, cotangent, *args):
    """(out, routing dict) of `layer` and the gradients of sum(out · cotangent) +
    router_z_loss (+ load_balancing_loss) w.r.t. x, router kernel and expert weights."""
    def loss(*args):
        out, routing = layer(*args)
        total = jnp.sum(out * cotangent) + routing["router_z_loss"]
        return total + (routing["load_balancing_loss"] if with_balance else 0.0), (out, routing)

    (_, aux), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
    return aux, grads


def check_against_reference(mesh, *, num_selected, gated, activation, capacity_factor,
                            policy="topk", rng=None, jitter=0.0):
    x, router, weights, cotangent = inputs(gated)
    groups = mesh.shape["data"] * mesh.shape["expert"]
    kwargs = dict(num_selected=num_selected, policy=policy, capacity_factor=capacity_factor,
                  jitter=jitter, activation=activation)
    dropless = capacity_factor is None
    traced = {}  # the per-group capacity (a static int), seen while the reference is traced

    def parallel(x, router, weights):
        out, routing = expert_parallel_moe(x, router, weights, mesh=mesh, rng=rng, **kwargs)
        return out, routing_dict(routing)

    def reference(x, router, weights):
        if dropless:  # all tokens at once
            out, routing = moe(x, router, weights, rng=rng, implementation="onehot", **kwargs)
            return out, routing_dict(routing)
        out, fields, traced["capacity"] = per_group_moe(x, router, weights, groups, rng=rng,
                                                        **kwargs)
        return out, fields

    (out, routing), grads = value_and_grads(parallel, not dropless, cotangent, x, router,
                                            weights)
    (ref_out, ref_routing), ref_grads = value_and_grads(reference, not dropless, cotangent, x,
                                                        router, weights)
    assert_close(out, ref_out, "out")
    # Dropless, the queue slots and the balance loss are per group, unlike moe's on all tokens.
    compared = ("expert_ids", "weights", "kept", "router_z_loss") if dropless else routing
    assert_close({k: routing[k] for k in compared}, {k: ref_routing[k] for k in compared},
                 "routing")
    assert_close(grads, ref_grads, "grad")
    if not dropless:
        assert not bool(routing["kept"].all()), "the capacity should drop some assignments"
        assert bool(routing["kept"].any())
    out, routing = expert_parallel_moe(x, router, weights, mesh=mesh, rng=rng, **kwargs)
    token_spec = ("data", "expert") if mesh.shape["data"] > 1 else "expert"
    assert out.sharding.spec == routing.slot.sharding.spec == PartitionSpec(token_spec)
    assert routing.capacity == (None if dropless else traced["capacity"])


def check_jit_inside_set_mesh():
    """As the MoE module calls it: in a jitted function under jax.set_mesh, inputs placed by
    the parameter rules (experts over "expert", d_ff over "tensor"), the abstract mesh of the
    context, a token mask, and a "tensor" axis that computes redundantly."""
    mesh = make_mesh(data=2, expert=2, tensor=2)
    x, router, weights, cotangent = inputs(gated=True, seed=1)
    mask = jnp.arange(TOKENS) % 5 != 3
    experts = {k: v for k, v in dataclasses.asdict(weights).items() if v is not None}  # no biases
    params = {"mlp": {"router": {"kernel": router}, "experts": experts}}
    layer = nnx.eval_shape(lambda: MoE(D_MODEL, D_FF, num_experts=EXPERTS, experts_per_token=2,
                                       rngs=nnx.Rngs(0)))  # the specs its parameters declare
    specs = {"mlp": param_specs(nnx.state(layer, nnx.Param), mesh).to_pure_dict()}
    assert specs["mlp"]["experts"]["up"] == PartitionSpec("expert", None, "tensor")
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "expert"))))
    kwargs = dict(num_selected=2, activation="silu")

    @jax.jit
    def layer(x, params, mask):
        weights = ExpertWeights(**params["mlp"]["experts"])
        out, routing = expert_parallel_moe(x, params["mlp"]["router"]["kernel"], weights,
                                           mesh=jax.sharding.get_abstract_mesh(),
                                           token_mask=mask, **kwargs)
        return out, routing.kept

    with jax.set_mesh(mesh):
        out, kept = layer(x, params, mask)
        grads = jax.jit(jax.grad(lambda x, p: jnp.sum(layer(x, p, mask)[0] * cotangent),
                                 argnums=(0, 1)))(x, params)
    ref_out, ref_routing = moe(x, router, weights, token_mask=mask, **kwargs)
    assert_close(out, ref_out, "out")
    assert_close(kept, ref_routing.kept, "kept")
    assert not bool(out[3].any()), "a masked token gets no expert output"
    ref_grads = jax.grad(lambda x, r, w: jnp.sum(
        moe(x, r, w, token_mask=mask, **kwargs)[0] * cotangent), argnums=(0, 1, 2))(
        x, router, weights)
    assert_close(grads[0], ref_grads[0], "grad x")
    assert_close(grads[1]["mlp"]["router"]["kernel"], ref_grads[1], "grad router")
    assert_close(grads[1]["mlp"]["experts"], dataclasses.asdict(ref_grads[2]), "grad experts")


def check_nan_token_stays_local(capacity_factor):
    """One NaN token: every other token's output (and routing) is the single-device layer's on
    the same input, finite; the NaN stays in its own row."""
    mesh = make_mesh(data=2, expert=4)
    x, router, weights, _ = inputs(gated=True, seed=2)
    x = x.at[3, 0].set(jnp.nan)
    kwargs = dict(num_selected=2, activation="silu", capacity_factor=capacity_factor)
    out, routing = expert_parallel_moe(x, router, weights, mesh=mesh, **kwargs)
    if capacity_factor is None:
        ref_out = moe(x, router, weights, implementation="onehot", **kwargs)[0]
    else:
        ref_out = per_group_moe(x, router, weights, 8, **kwargs)[0]
    others = jnp.arange(TOKENS) != 3
    assert bool(jnp.isfinite(out[others]).all()), "a NaN token reached other tokens"
    assert_close(out[others], ref_out[others], "out")
    assert bool(jnp.isfinite(routing.weights).all()), "routing weights must stay finite"


MESHES = {"expert8": dict(data=1, expert=8), "data2_expert4": dict(data=2, expert=4)}
EXPERTS_KINDS = {"k1_plain_gelu": dict(num_selected=1, gated=False, activation="gelu"),
                 "k2_gated_silu": dict(num_selected=2, gated=True, activation="silu")}
CAPACITIES = {"dropless": None, "capacity": 1.0}


def cases():
    for mesh_name, axes in MESHES.items():
        for kind, expert_kwargs in EXPERTS_KINDS.items():
            for cap_name, capacity_factor in CAPACITIES.items():
                yield (f"{mesh_name}-{kind}-{cap_name}",
                       lambda axes=axes, e=expert_kwargs, cf=capacity_factor:
                       check_against_reference(make_mesh(**axes), capacity_factor=cf, **e))
    yield ("data2_expert4-gshard_rng_jitter-capacity",
           lambda: check_against_reference(
               make_mesh(data=2, expert=4), num_selected=2, gated=True, activation="silu",
               capacity_factor=2.0, policy="gshard", rng=jax.random.key(7), jitter=0.1))
    yield "jit_inside_set_mesh", check_jit_inside_set_mesh
    for cap_name, capacity_factor in CAPACITIES.items():
        yield (f"nan_token_stays_local-{cap_name}",
               lambda cf=capacity_factor: check_nan_token_stays_local(cf))


def run_and_report(named_checks, path: str) -> None:
    """Run every (name, check) and write {name: "ok" or the traceback} to path + ".json"."""
    report = {}
    for name, check in named_checks:
        try:
            check()
            report[name] = "ok"
        except Exception:  # every case reports, whatever fails
            report[name] = traceback.format_exc()
        print(name, report[name][:2000], flush=True)
    with open(path + ".json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    run_and_report(cases(), sys.argv[1])
