"""Parameter-efficient fine-tuning as transforms of a model and its `nnx.split` state: LoRA,
soft prompts, prefix tuning and adapters. Every method is a frozen settings dataclass whose
`attach(model, rngs=)` adds `PeftParam` variables in place (the frozen weights keep their
paths); `nnx.split(model, PeftParam, ...)` then separates what fine-tuning trains."""

from tfx.peft import lora, multi_lora
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
           "save"]
