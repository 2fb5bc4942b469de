"""The sub-configs of a model config, one per concern: frozen dataclasses, each validated in
`__post_init__` with messages that name the field by its dotted path in the model config
(`moe.num_experts`, `rope.theta`, ...). `tfx.models.config` assembles them.

One module per concern, each re-exported here: `positions` (`RopeConfig`, `T5BiasConfig`),
`attention` (`AttentionConfig`, `LatentConfig`, `LinearAttentionConfig`), `feed_forward`
(`MlpConfig`, `MoeConfig`), `norms` (`NormConfig`), `tokens` (`EmbeddingsConfig`,
`SpecialTokens`) and `compute` (`ComputeConfig`, the dtypes and remat policies by name); the
field checks they share (`positive_int`, `one_of`, `boolean`) are in `_checks`.

These modules import neither jax nor flax, so that `tfx train --help` starts quickly. The
choices of a field are `typing.Literal` types; the tables that give them their behaviour live
in tfx/nn and tfx/ops (`tfx.ops.activations.ACTIVATIONS`, `tfx.nn.norms.NORMS`, ...), and
tests/models/test_config_literals.py checks that the two agree.
"""

from __future__ import annotations

# The field checks, for the configs that tfx.models.config builds from these parts.
from tfx.models.parts._checks import boolean as boolean
from tfx.models.parts._checks import one_of as one_of
from tfx.models.parts._checks import positive_int as positive_int
from tfx.models.parts.attention import (
    AttentionConfig,
    AttentionImplementation,
    LatentConfig,
    LayerType,
    LinearAttentionConfig,
    QKNorm,
)
from tfx.models.parts.compute import (
    COMPUTE_DTYPES,
    REMAT_POLICIES,
    ComputeConfig,
    Dtype,
    RematPolicy,
)
from tfx.models.parts.feed_forward import (
    Activation,
    MlpConfig,
    MoeConfig,
    MoeDispatch,
    MoePolicy,
)
from tfx.models.parts.norms import NormConfig, NormKind
from tfx.models.parts.positions import RopeConfig, RopeLayout, T5BiasConfig
from tfx.models.parts.tokens import EmbeddingsConfig, SpecialTokens

__all__ = ["COMPUTE_DTYPES", "REMAT_POLICIES", "Activation", "AttentionConfig",
           "AttentionImplementation", "ComputeConfig", "Dtype", "EmbeddingsConfig",
           "LatentConfig", "LayerType", "LinearAttentionConfig", "MlpConfig", "MoeConfig",
           "MoeDispatch", "MoePolicy",
           "NormConfig", "NormKind", "QKNorm", "RematPolicy", "RopeConfig", "RopeLayout",
           "SpecialTokens", "T5BiasConfig"]
