"""Every catalogue variant with parameters that fit a 32-token sequence (natten: an 8 x 4 canvas),
for the CPU parity tests of the context-parallel algorithms."""

HEADS = 4  # alibi's num_heads must equal the query heads

PARAMS = {
    "alibi": {"num_heads": HEADS},
    "bidirectional_sliding_window": {"window_size": 5},
    "block_diffusion": {"clean_length": 16, "block_size": 4},
    "causal": {},
    "chunked_causal": {"chunk_size": 8},
    "dilated_sliding_window": {"window_size": 8, "dilation": 2},
    "document": {"doc_lengths": [10, 14, 8]},
    "full": {},
    "gemma2": {"window_size": 6, "soft_cap": 5.0},
    "global_sliding_window": {"window_size": 3, "global_tokens": [0, 17]},
    "natten": {"canvas_w": 8, "canvas_h": 4, "kernel_w": 3, "kernel_h": 3},
    "prefix_lm": {"prefix_length": 7},
    "relative_position": {},
    "shared_prefix": {"doc_lengths": [8, 4, 4, 6, 5, 5], "prefix_of": [0, 0, 0, 3, 3, 3]},
    "sliding_window": {"window_size": 6},
    "sliding_window_sinks": {"window_size": 6, "num_sinks": 2},
    "softcap": {"soft_cap": 5.0},
}
