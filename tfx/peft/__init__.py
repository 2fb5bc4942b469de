"""Parameter-efficient fine-tuning as transforms of a model and its `nnx.split` state: LoRA,
soft prompts, prefix tuning and adapters. Every method is a frozen settings dataclass whose
`attach(model, rngs=)` adds `PeftParam` variables in place (the frozen weights keep their
paths); `nnx.split(model, PeftParam, ...)` then separates what fine-tuning trains.

The exports load on first use (PEP 562), so the settings alone (`tfx.peft.settings`, which
the command line's configs build on) import no jax."""

from typing import TYPE_CHECKING

from tfx._lazy import lazy_exports

if TYPE_CHECKING:
    from tfx.peft import lora, multi_lora, settings
    from tfx.peft.adapters import Adapters
    from tfx.peft.core import PeftParam
    from tfx.peft.lora import LoRA
    from tfx.peft.multi_lora import MultiLoRALinear, attach_many
    from tfx.peft.params import count, load, only_peft, save
    from tfx.peft.prefix import Prefix
    from tfx.peft.prompt import SoftPrompt
    from tfx.peft.switch import adapters_off

__all__ = ["Adapters", "LoRA", "MultiLoRALinear", "PeftParam", "Prefix", "SoftPrompt",
           "adapters_off", "attach_many", "count", "load", "lora", "multi_lora", "only_peft",
           "save", "settings"]

__getattr__, __dir__ = lazy_exports(__name__, {
    **{name: f"tfx.peft.{name}" for name in ("lora", "multi_lora", "settings")},
    "Adapters": "tfx.peft.adapters:Adapters", "PeftParam": "tfx.peft.core:PeftParam",
    "LoRA": "tfx.peft.lora:LoRA", "MultiLoRALinear": "tfx.peft.multi_lora:MultiLoRALinear",
    "attach_many": "tfx.peft.multi_lora:attach_many",
    **{name: f"tfx.peft.params:{name}" for name in ("count", "load", "only_peft", "save")},
    "Prefix": "tfx.peft.prefix:Prefix", "SoftPrompt": "tfx.peft.prompt:SoftPrompt",
    "adapters_off": "tfx.peft.switch:adapters_off"})
