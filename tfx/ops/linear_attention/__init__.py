"""Linear attention: token mixers whose memory is a fixed-size recurrent state instead of a
KV cache. `delta_rule`: the gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5), chunked
and token by token; `short_conv`: the short causal convolution before it, with its state."""

from tfx.ops.linear_attention.delta_rule import gated_delta_recurrent, gated_delta_rule
from tfx.ops.linear_attention.short_conv import causal_conv1d

__all__ = ["causal_conv1d", "gated_delta_recurrent", "gated_delta_rule"]
