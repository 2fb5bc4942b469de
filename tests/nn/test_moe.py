"""tfx.nn.MoE against transformers' DeepseekV3MoE (group-limited sigmoid routing with the
score-correction bias, routed_scaling_factor and shared experts) and Qwen3MoeSparseMoeBlock
(softmax top-k without renormalisation), with the same random weights; and the routing
keywords checked at construction."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tfx.nn.moe import MoE

D_MODEL, D_FF, EXPERTS = 8, 6, 8


def _randomise(module, torch, seed):
    """Fill every parameter and buffer of a transformers module with N(0, 0.5²) (its experts
    start as torch.empty, its bias as zeros)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(0.5 * torch.randn(tensor.shape, generator=generator))


def _load(moe: MoE, hf) -> MoE:
    """Copy a transformers MoE block's router, experts (gate_up_proj [E, 2F, D] with gate
    first, down_proj [E, D, F]) and, where present, its score-correction bias and shared
    experts into `moe`; returns it."""
    def array(tensor, transpose=(1, 0)):
        return jnp.asarray(tensor.detach().numpy()).transpose(transpose)

    moe.router.kernel[...] = array(hf.gate.weight)
    gate_up = array(hf.experts.gate_up_proj, (0, 2, 1))  # [E, D, 2F]
    moe.experts.gate[...], moe.experts.up[...] = jnp.split(gate_up, 2, axis=-1)
    moe.experts.down[...] = array(hf.experts.down_proj, (0, 2, 1))
    if moe.selection_bias is not None:
        moe.selection_bias[...] = array(hf.gate.e_score_correction_bias, (0,))
    if moe.shared is not None:
        for ours, theirs in [(moe.shared.gate, hf.shared_experts.gate_proj),
                             (moe.shared.up, hf.shared_experts.up_proj),
                             (moe.shared.down, hf.shared_experts.down_proj)]:
            ours.kernel[...] = array(theirs.weight)
    return moe


def _compare(moe: MoE, hf, torch, differs: MoE):
    """moe(x) = hf(x) on random x [2, 6, D_MODEL]; `differs`, loaded alike, must not match."""
    x = torch.randn(2, 6, D_MODEL, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf(x).numpy()
    ours = moe(jnp.asarray(x.numpy()))
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(_load(differs, hf)(jnp.asarray(x.numpy()))) - expected).max() > 1e-3
    assert np.isfinite(float(moe.load_balancing_loss[...]))  # train mode records it
    return ours


def test_deepseek_v3_moe():
    torch = pytest.importorskip("torch")
    deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    config = deepseek.DeepseekV3Config(
        hidden_size=D_MODEL, moe_intermediate_size=D_FF, n_routed_experts=EXPERTS,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, hidden_act="silu")
    config._experts_implementation = "eager"  # the loop, as a standalone block has none set
    hf = deepseek.DeepseekV3MoE(config)
    _randomise(hf, torch, 0)

    def make(num_groups, groups_per_token):
        return MoE(D_MODEL, D_FF, num_experts=EXPERTS, experts_per_token=2, policy="deepseek",
                   shared_experts=2, renormalize=True, num_groups=num_groups,
                   groups_per_token=groups_per_token, routed_scale=2.5, rngs=nnx.Rngs(0))

    moe = _load(make(4, 2), hf)
    _compare(moe, hf, torch, differs=make(1, 1))  # the group limit matters on these inputs
    np.testing.assert_allclose(moe.expert_load[...].sum(), 1.0, rtol=1e-6)


def test_qwen3_moe_sparse_block():
    torch = pytest.importorskip("torch")
    qwen = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    config = qwen.Qwen3MoeConfig(hidden_size=D_MODEL, moe_intermediate_size=D_FF,
                                 num_experts=EXPERTS, num_experts_per_tok=3,
                                 norm_topk_prob=False, hidden_act="silu")
    config._experts_implementation = "eager"
    hf = qwen.Qwen3MoeSparseMoeBlock(config)
    _randomise(hf, torch, 1)

    def make(renormalize):
        return MoE(D_MODEL, D_FF, num_experts=EXPERTS, experts_per_token=3,
                   renormalize=renormalize, rngs=nnx.Rngs(0))

    _compare(_load(make(False), hf), hf, torch, differs=make(None))


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_groups=3), r"num_groups \(3\) must divide num_experts \(8\)"),
    (dict(num_groups=4, groups_per_token=5), r"groups_per_token \(5\) must be <= num_groups"),
    (dict(num_groups=4, groups_per_token=1, experts_per_token=3), r"num_selected \(3\)"),
    (dict(num_groups=2, policy="topk"), "policy 'deepseek'"),
    (dict(routed_scale=0.0), "routed_scale"),
])
def test_bad_routing_options_fail_at_construction(kwargs, message):
    kwargs = dict(dict(num_experts=EXPERTS, experts_per_token=2, policy="deepseek"), **kwargs)
    with pytest.raises(ValueError, match=message):
        MoE(D_MODEL, D_FF, rngs=nnx.Rngs(0), **kwargs)
