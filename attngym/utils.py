"""The seed's helper API, importable from one place as in attention-gym's `attn_gym.utils`.

Nothing is implemented here: each helper lives in the module of its kind (viz, bench, profiling,
device) next to the attngym functions built on the same code, and is re-exported under the seed's
name. Importing this module does not import matplotlib; the drawing functions do, when called.
"""

from attngym.bench import benchmark_cuda_function_in_microseconds, calculate_tflops
from attngym.device import get_flash_block_size
from attngym.profiling import cuda_kernel_profiler
from attngym.viz import create_score_mod, plot_attention_scores, visualize_attention_scores

__all__ = [
    "benchmark_cuda_function_in_microseconds",
    "calculate_tflops",
    "create_score_mod",
    "cuda_kernel_profiler",
    "get_flash_block_size",
    "plot_attention_scores",
    "visualize_attention_scores",
]
