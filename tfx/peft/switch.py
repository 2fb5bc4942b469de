"""The base model inside a LoRA-adapted one: `adapters_off(model)` computes exactly what the
model computed before LoRA was attached, for a frozen reference (DPO's π_ref) that costs no
second copy of the weights.

    reference = adapters_off(policy)          # inside jit / jax.grad as well
    ref_logits = jax.lax.stop_gradient(reference(ids))

The reference is a clone of the model's graph (`nnx.clone`: new Variable objects over the same
arrays, so nothing is copied) whose LoRA layers are put back to their plain form: it runs the
base forward itself, not x·W + scale·(x·a)·0. The model passed in is left as it was.
"""

from __future__ import annotations

from flax import nnx

from tfx.peft import lora
from tfx.peft.adapters import Adapter
from tfx.peft.core import PeftParam, find_modules, set_module
from tfx.peft.lora_modules import LoRAEmbedding, LoRALinear
from tfx.peft.prefix import PrefixEncoder, PrefixKV
from tfx.peft.prompt import Prompt

__all__ = ["adapters_off"]

# The PEFT parameters' holders of the methods that cannot be switched off here, with why.
_NOT_SWITCHABLE = (
    (Prompt, "SoftPrompt", "its vectors are positions the tokens attend to, zero or not"),
    (PrefixKV | PrefixEncoder, "Prefix",
     "its keys take a share of every softmax, zero or not"),
    (Adapter, "Adapters", "not handled here"),
)


def adapters_off(model: nnx.Module) -> nnx.Module:
    """`model` with every LoRA update switched off: the same graph over the same weight arrays,
    its LoRA layers (`LoRALinear`, `LoRAEmbedding`) back in their plain form, so it computes
    exactly as the model before `tfx.peft.LoRA.attach` (same logits, bit for bit). Works
    inside jit and jax.grad; its outputs still depend on the frozen weights, so wrap them in
    `jax.lax.stop_gradient` where they are used when differentiating those too.

    The returned model is a separate object (settings such as `.eval()` on it leave `model`
    alone); `model` keeps its factors.

    Raises:
      ValueError: for a model with PEFT parameters of another method, named (zero prefix keys
        still take a share of every softmax, zero prompt vectors are still positions attended
        to; bottleneck Adapters are not handled here), or with no LoRA at all (fully
        fine-tuned weights hold no base model).
    """
    others = sorted({_method(node) for _, node in _peft_holders(model)})
    if others:
        raise ValueError(f"adapters_off switches off LoRA only; the model also has PEFT "
                         f"parameters of {', '.join(others)}. Compute the reference from the "
                         f"model as it was before these were attached instead")
    if not find_modules(model, (LoRALinear, LoRAEmbedding)):
        raise ValueError("adapters_off: the model has no LoRA factors to switch off (attach "
                         "tfx.peft.LoRA first); fully fine-tuned weights hold no base model")
    reference = nnx.clone(model)  # new Variables, the same arrays
    # lora.detach's rewrite, without its check that every layer has one scale (the factors it
    # would return are dropped here).
    for path, module in find_modules(reference, (LoRALinear, LoRAEmbedding)):
        set_module(reference, path, lora._plain(module))
    return reference


def _method(node: nnx.Module) -> str:
    """The PEFT method whose parameters `node` holds, and why it cannot be switched off."""
    return next((f"{name} ({why})" for kind, name, why in _NOT_SWITCHABLE
                 if isinstance(node, kind)), type(node).__name__)


def _peft_holders(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    """(path, module) of each module of `model` that holds PEFT parameters itself, LoRA's
    layers excepted."""
    return [(path, node) for path, node in find_modules(model, nnx.Module)
            if not isinstance(node, LoRALinear | LoRAEmbedding)
            and any(isinstance(v, PeftParam) for v in vars(node).values())]
