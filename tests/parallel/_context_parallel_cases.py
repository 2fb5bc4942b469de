"""The cases of the context-parallel tests, shared by _context_parallel_worker.py (which runs
them on 8 devices) and test_context_parallel.py (which checks them); importing this module
touches no jax flags."""

import numpy as np

from tfx.ops.sparse import Causal, SlidingWindow

BATCH, SEQ, HEAD_DIM = 2, 64, 8
# Packed documents: two in row 0, three in row 1, starting at different places.
SEGMENTS = np.stack([np.repeat([1, 2], [24, 40]), np.repeat([1, 2, 3], [9, 45, 10])])
# Row 1 pads its last 10 keys: all of segment 3's, whose queries then see no key at all.
KEY_MASK = np.arange(SEQ)[None, :] < np.array([[SEQ], [SEQ - 10]])

# name -> (mesh axes, spec, heads (query, key/value), segments, key mask, exchange, dtype)
CASES = {
    "full_ring8": (dict(data=1, sequence=8), None, (4, 4), False, False, "ring", "float32"),
    "causal_ring8": (dict(data=1, sequence=8), Causal(), (4, 4), False, False, "ring",
                     "float32"),
    "causal_gather8": (dict(data=1, sequence=8), Causal(), (4, 4), False, False, "all_gather",
                       "float32"),
    "causal_gqa_data2_ring4": (dict(data=2, sequence=4), Causal(), (4, 2), False, False,
                               "ring", "float32"),
    "causal_mqa_ring4_tensor2": (dict(data=1, sequence=4, tensor=2), Causal(), (4, 1), False,
                                 False, "ring", "float32"),
    "gqa_ring4_tensor2": (dict(data=1, sequence=4, tensor=2), Causal(), (4, 2), False, False,
                          "ring", "float32"),
    "window_ring8": (dict(data=1, sequence=8), SlidingWindow(6), (4, 2), False, False, "ring",
                     "float32"),
    "window_gather4": (dict(data=2, sequence=4), SlidingWindow(20), (4, 2), False, False,
                       "all_gather", "float32"),
    "causal_segments_ring4": (dict(data=2, sequence=4), Causal(), (4, 2), True, False, "ring",
                              "float32"),
    "segments_gather8": (dict(data=1, sequence=8), None, (4, 4), True, False, "all_gather",
                         "float32"),
    "causal_padding_ring4": (dict(data=2, sequence=4), Causal(), (4, 2), True, True, "ring",
                             "float32"),
    "causal_bfloat16_ring8": (dict(data=1, sequence=8), Causal(), (4, 2), False, False, "ring",
                              "bfloat16"),
}
