"""Stored experiment configs across tfx versions: `migrate` brings a stored dict (a workdir's
checkpoints/config.json, `Experiment.to_dict`) to the current layout, version by version.

Version 1 (no "version" key): flat model configs (`rope_theta`, `num_kv_heads`, `norm_eps`,
`num_experts`, ...) holding the MoE training weights too. Version 2: model configs nested by
concern (`rope`, `t5`, `attention`, `mlp`, `norm`, `moe`, `embeddings`, `compute`,
`special_tokens`), the MoE training weights in `train`. Version 3: `peft` one dataclass per
fine-tuning method with only its settings (`FullTuning`, `LoraTuning`, ...; see
tfx.train.finetuning) instead of a `PeftConfig` with a `method` string and every method's
settings.
"""

from __future__ import annotations

import copy

__all__ = ["CONFIG_VERSION", "migrate"]

CONFIG_VERSION = 3

# Version 1's flat model fields -> (sub-config, its class, field) in version 2.
_V1_PARTS = {
    "rope_theta": ("rope", "RopeConfig", "theta"),
    "rope_layout": ("rope", "RopeConfig", "layout"),
    "rope_scaling": ("rope", "RopeConfig", "scaling"),
    "rope_fraction": ("rope", "RopeConfig", "fraction"),
    "t5_num_buckets": ("t5", "T5BiasConfig", "num_buckets"),
    "t5_max_distance": ("t5", "T5BiasConfig", "max_distance"),
    "num_kv_heads": ("attention", "AttentionConfig", "num_kv_heads"),
    "head_dim": ("attention", "AttentionConfig", "head_dim"),
    "attention_scale": ("attention", "AttentionConfig", "scale"),
    "implementation": ("attention", "AttentionConfig", "implementation"),
    "sliding_window": ("attention", "AttentionConfig", "sliding_window"),
    "attention_pattern": ("attention", "AttentionConfig", "pattern"),
    "activation": ("mlp", "MlpConfig", "activation"),
    "gated_mlp": ("mlp", "MlpConfig", "gated"),
    "norm": ("norm", "NormConfig", "kind"),
    "norm_eps": ("norm", "NormConfig", "eps"),
    "pre_norm": ("norm", "NormConfig", "pre_norm"),
    "num_experts": ("moe", "MoeConfig", "num_experts"),
    "experts_per_token": ("moe", "MoeConfig", "experts_per_token"),
    "moe_every": ("moe", "MoeConfig", "every"),
    "moe_d_ff": ("moe", "MoeConfig", "d_ff"),
    "capacity_factor": ("moe", "MoeConfig", "capacity_factor"),
    "router_policy": ("moe", "MoeConfig", "policy"),
    "router_jitter": ("moe", "MoeConfig", "jitter"),
    "moe_dispatch": ("moe", "MoeConfig", "dispatch"),
    "moe_shared_experts": ("moe", "MoeConfig", "shared_experts"),
    "tie_embeddings": ("embeddings", "EmbeddingsConfig", "tie"),
    "scale_embeddings": ("embeddings", "EmbeddingsConfig", "scale"),
    "dtype": ("compute", "ComputeConfig", "dtype"),
    "param_dtype": ("compute", "ComputeConfig", "param_dtype"),
    "remat": ("compute", "ComputeConfig", "remat"),
    "scan_layers": ("compute", "ComputeConfig", "scan_layers"),
    "pad_token_id": ("special_tokens", "SpecialTokens", "pad_id"),
    "cls_token_id": ("special_tokens", "SpecialTokens", "cls_id"),
    "sep_token_id": ("special_tokens", "SpecialTokens", "sep_id"),
    "mask_token_id": ("special_tokens", "SpecialTokens", "mask_id"),
}
# Version 1's model fields that version 2 keeps in the training config.
_V1_TRAINING = ("router_bias_rate", "load_balancing_weight", "router_z_weight")
# Version 2's PeftConfig.method -> (version 3's class, {its field: version 2's field}).
_V2_PEFT = {
    "full": ("FullTuning", {}),
    "lora": ("LoraTuning", {name: name for name in
                            ("rank", "alpha", "targets", "init_style", "rslora")}),
    "prompt": ("PromptTuning", {"num_tokens": "num_tokens", "init": "prompt_init"}),
    "prefix": ("PrefixTuning", {"num_tokens": "num_tokens", "projection": "prefix_projection"}),
    "adapter": ("AdapterTuning", {"size": "adapter_size", "placement": "adapter_placement"}),
}


def migrate(stored: dict) -> dict:
    """A stored experiment dict in the current layout (version CONFIG_VERSION); the input is
    not changed. Raises ValueError for a version this tfx does not know (a newer one)."""
    if not isinstance(stored, dict):
        raise TypeError(f"a stored experiment must be a dict, got {type(stored).__name__}")
    version = stored.get("version", 1)
    if version not in _STEPS and version != CONFIG_VERSION:
        raise ValueError(f"this stored experiment has config version {version!r}, which this "
                         f"tfx (version {CONFIG_VERSION}) cannot read: it was written by a "
                         f"newer tfx; upgrade tfx, or train in a new workdir")
    out = copy.deepcopy(stored)
    while out.get("version", 1) != CONFIG_VERSION:
        out = _STEPS[out.get("version", 1)](out)
    return out


def _v1_to_v2(stored: dict) -> dict:
    """Nest the flat version-1 model config by concern; move its training weights to train."""
    model = stored.get("model")
    if not isinstance(model, dict):
        return {**stored, "version": 2}
    flat, nested = dict(model), {}
    for old, (part, kind, field) in _V1_PARTS.items():
        if old in flat:
            nested.setdefault(part, {"__type__": kind})[field] = flat.pop(old)
    training = {name: flat.pop(name) for name in _V1_TRAINING if name in flat}
    position = flat.get("position", "learned")
    for part, kind in (("rope", "rope"), ("t5", "t5")):
        if position != kind:  # version 1 kept these settings for every position
            nested.pop(part, None)
    if nested.get("moe", {}).get("num_experts", 0) == 0:
        nested.pop("moe", None)  # version 1's num_experts=0: dense, no MoE settings
    train = {"__type__": "TrainConfig", **stored.get("train", {}), **training}
    return {**stored, "version": 2, "model": {**flat, **nested}, "train": train}


def _v2_to_v3(stored: dict) -> dict:
    """One dataclass per fine-tuning method, holding only its settings."""
    peft = stored.get("peft")
    if not isinstance(peft, dict):  # stored before fine-tuning existed: the default (full)
        return {**stored, "version": 3}
    method = peft.get("method", "full")
    if method not in _V2_PEFT:
        raise ValueError(f"peft.method must be one of {tuple(_V2_PEFT)}, got {method!r}")
    kind, fields = _V2_PEFT[method]
    settings = {new: peft[old] for new, old in fields.items() if old in peft}
    return {**stored, "version": 3, "peft": {"__type__": kind, **settings}}


# The step from each older version to the next.
_STEPS = {1: _v1_to_v2, 2: _v2_to_v3}
