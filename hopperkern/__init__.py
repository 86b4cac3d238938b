"""hopperkern: Triton kernels for NVIDIA Hopper — fused linear cross-entropy (``lce``) and MoE (``moe``).

Importing is cheap: no GPU query, no Triton compile and no environment read happen at import time.
Submodules load on first attribute access (``hopperkern.lce``) or explicit import.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["__version__", "errors", "info", "lce", "matmul", "moe", "tma", "tune", "tuning"]


def __getattr__(name):
    if name in ("errors", "info", "lce", "matmul", "moe", "tma", "tune", "tuning"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
