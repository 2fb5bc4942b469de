"""Quantized weights: a transform of a model, as fine-tuning is (the models know nothing of it).

    tfx.quant.quantize(model, "int8")     # weight-only int8, one scale per output channel
    tfx.generate(model, ids, max_new_tokens=32)          # model(...) and generation as before

    tfx.quant.quantize(model, "nf4")      # QLoRA: a frozen 4-bit NormalFloat base...
    tfx.peft.LoRA(rank=8, targets=("query", "value")).attach(model, rngs=nnx.Rngs(0))
    # ...whose LoRA factors train in float (tfx.peft.only_peft) and save alone (tfx.peft.save)

`quantize` replaces each chosen `nnx.Linear` by a `QuantizedLinear` (an `nnx.Linear` holding
codes and scales as `Quantized` variables, not `nnx.Param`s: frozen by construction) and
leaves embeddings, norms and a tied head float. It works on unstacked and scanned layers, on
models from `tfx.models.create` and `tfx.hf.load`, under `nnx.split`/`nnx.merge` and jit.

The numerics (absmax calibration, rounding, the NF4 code table, block-wise scales, the
`QArray` that holds codes and scales, dequantization) are Qwix's (`pip install
'nnx-transformers[quant]'`), Google's JAX quantization library, chosen over AQT (`aqtp`)
because it supports Flax NNX and ships NF4 (QLoRA's code table), which QLoRA needs. Its
`qwix.quantize_model` is not used: it intercepts `jax.lax.dot_general` inside one method of
the model (`__call__`), whereas `tfx.generate` runs `hidden_states` / `logits` and reads the
head as a matrix, and failed on a tfx decoder; a rewrite of the module tree, as `tfx.peft`
does, keeps every method working.
"""

from tfx.quant.linear import Quantized, QuantizedLinear
from tfx.quant.quantize import BLOCK_SIZES, QTYPES, quantize

__all__ = ["BLOCK_SIZES", "QTYPES", "Quantized", "QuantizedLinear", "quantize"]
