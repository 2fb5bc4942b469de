"""The names of tfx's choices, one source for each table, importable without jax.

The config fields that take them (`typing.Literal`s in tfx.models.parts and tfx.train.config),
the command line's choices (tyro reads those Literals) and the tables that give each name its
behaviour (keyed by these names: `tfx.ops.activations.ACTIVATIONS`, `tfx.nn.norms`,
`tfx.train.objectives.OBJECTIVES`, ...) all start here, so adding a choice is one name here and
one entry in its table, which a test keeps equal (tests/models/test_config_literals.py,
tests/train/test_config_literals.py).
"""

__all__ = ["ACTIVATIONS", "MOE_DISPATCHES", "MOE_POLICIES", "NONFINITE_ACTIONS", "NORMS",
           "OBJECTIVES", "PREFERENCE_LOSSES", "QK_NORMS", "QUANT_TYPES", "ROPE_LAYOUTS", "TASKS"]

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
# tfx.quant.QTYPES: weight-only quantization types (LoRA's `quantize`; nf4 is QLoRA's).
QUANT_TYPES = ("int8", "int4", "nf4")
# tfx.train.objectives.OBJECTIVES: what a run trains for (`Experiment.objective`).
OBJECTIVES = ("causal_lm", "mlm", "seq2seq", "sft", "dpo")
# tfx.train.tasks.SyntheticTask: the synthetic seq2seq tasks (`data.task`).
TASKS = ("copy", "reverse", "sort", "addition", "addition_reversed")
# tfx.train.preference.preference_loss: the preference losses (`preference.loss`).
PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo")
# tfx.train.loop: what a step with a non-finite loss or gradient does (`train.nonfinite`).
NONFINITE_ACTIONS = ("stop", "skip")
