"""The package's exceptions, importable from every layer (this module imports nothing of the package).

``UnsupportedError`` is also ``hopperkern.tma.UnsupportedError`` and ``TuningFileError`` is also
``hopperkern.tuning.TuningFileError``: the same classes.
"""

__all__ = ["TuningFileError", "UnsupportedError"]


class UnsupportedError(NotImplementedError):
    """The inputs are valid, but this machine or this operand cannot run the requested path.

    The message lists every reason and ends with a pointer to ``python -m hopperkern.info``.
    """

    def __init__(self, what: str, reasons: list[str] | tuple[str, ...]):
        self.what = what
        self.reasons = tuple(reasons)
        lines = "\n".join(f"  - {r}" for r in self.reasons) or "  - (no reason recorded)"
        super().__init__(f"{what}:\n{lines}\nsee: python -m hopperkern.info")


class TuningFileError(ValueError):
    """A tuning file that cannot be used; the message names the file and the field."""
