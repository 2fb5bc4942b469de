"""Linear attention: token mixers whose memory is a fixed-size recurrent state instead of a
KV cache. `delta_rule`: the gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5), chunked
and token by token; `short_conv`: the short causal convolution before it, with its state;
`state`: the memory a decoder's cache keeps per layer (`DeltaState`), rewindable with a
`DeltaHistory`."""

from tfx.ops.linear_attention.delta_rule import gated_delta_recurrent, gated_delta_rule
from tfx.ops.linear_attention.short_conv import causal_conv1d
from tfx.ops.linear_attention.state import (
    DeltaHistory,
    DeltaState,
    empty_state,
    record,
    rewind_state,
)

__all__ = ["DeltaHistory", "DeltaState", "causal_conv1d", "empty_state",
           "gated_delta_recurrent", "gated_delta_rule", "record", "rewind_state"]
