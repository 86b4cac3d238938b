"""The model shapes the tuner sweeps and the benchmarks time: one list, so a benchmark measures what was tuned."""

from __future__ import annotations

__all__ = ["MOE_SHAPES"]

# name: (E experts, top_k, H hidden, I intermediate per expert), bf16 inference; tensor-parallel slices where
# the name says so (TP8: I / 8).
MOE_SHAPES = {
    "qwen3-30B-A3B": (128, 8, 2048, 768),
    "deepseek-V3-TP8": (256, 8, 7168, 256),
    "mixtral-8x7B": (8, 2, 4096, 14336),
    "qwen3-235B-TP4": (128, 8, 4096, 384),
    "gpt-oss-120B": (128, 4, 2880, 2880),
}
