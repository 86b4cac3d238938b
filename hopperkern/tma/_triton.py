"""``import triton``, or an ImportError that says why triton cannot load and what to do.

Triton's own error can be far from its cause: with ``TRITON_INTERPRET=1`` and no numpy, ``import triton`` fails
inside its interpreter's ``import numpy``. Every module that imports triton imports this module first
(``from ..tma import _triton  # noqa: F401``); the explanation comes from :mod:`hopperkern.tma.capability`.
"""

from .capability import require_triton

require_triton()
