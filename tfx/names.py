"""The names of tfx's choices, one source for each table, importable without jax.

The config fields that take them (`typing.Literal`s in tfx.models.parts), the command line's
choices (tyro reads those Literals) and the tables that give each name its behaviour (keyed by
these names: `tfx.ops.activations.ACTIVATIONS`, `tfx.nn.norms`, ...) all start here, so adding a
choice is one name here and one entry in its table, which a test keeps equal
(tests/models/test_config_literals.py).
"""

__all__ = ["ACTIVATIONS", "MOE_DISPATCHES", "MOE_POLICIES", "NORMS", "QK_NORMS", "ROPE_LAYOUTS"]

# tfx.ops.activations.ACTIVATIONS: the MLP's nonlinearity.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
# tfx.nn.norms.make_norm: LayerNorm or RMSNorm.
NORMS = ("layer", "rms")
# tfx.ops.positional.apply_rope: which features rotate together (the first half with the
# second, or neighbours).
ROPE_LAYOUTS = ("half", "interleaved")
# tfx.ops.moe.route: how tokens choose experts.
MOE_POLICIES = ("topk", "gshard", "deepseek")
# tfx.ops.moe.dispatch: how tokens reach their experts' weights.
MOE_DISPATCHES = ("sorted", "onehot", "ragged", "megablox")
# tfx.nn.Attention's qk_norm: each head's features, or all heads' at once.
QK_NORMS = ("per_head", "across_heads")
