"""Per-GPU tuning files: ``configs/<DEVICE_NAME>.json``, validated with pydantic.

Only the tuner writes these files (``python -m hopperkern.tune``); ops read them through :func:`load_config`.

Lookup order for ``load_config(source=None)``:

1. ``HOPPERKERN_CONFIG`` (read at call time): a JSON file, or a folder holding ``<DEVICE_NAME>.json``;
2. the packaged ``configs/<DEVICE_NAME>.json`` (inside the wheel, or the checkout's top-level ``configs/``);
3. built-in defaults (each op's heuristics), with ONE warning naming the file looked for and the tuner command.

A malformed file raises :class:`TuningFileError` naming the file and the offending field.

Layout (GEMM letters ``block_m/n/k`` follow each kernel's docstring)::

    {"schema_version": 1, "device_name": "NVIDIA H200", "triton_version": "3.6.0",
     "lce": {"forward:bfloat16:H4096": {"8192": {"block_m": 128, "block_n": 256, ...}, ...}, ...},
     "moe": {"E128_H2048_I768_bfloat16": {"1": {"gemm1": {...}, "gemm2": {...}}, "64": {...}}}}

Both maps are keyed by token-count buckets; a lookup takes the nearest bucket on a log scale.
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from pathlib import Path
from typing import Dict, Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

__all__ = [
    "SCHEMA_VERSION",
    "TUNER_COMMAND",
    "KernelConfig",
    "MoeConfig",
    "TuningConfig",
    "TuningFileError",
    "config_search",
    "lce_key",
    "load_config",
    "moe_key",
]

SCHEMA_VERSION = 1
TUNER_COMMAND = "python -m hopperkern.tune --out configs/"
_WARPS = (1, 2, 4, 8, 16)


class TuningFileError(ValueError):
    """A tuning file that cannot be used; the message names the file and the field."""


def _pow2(v: int, name: str) -> int:
    if v <= 0 or v & (v - 1):
        raise ValueError(f"{name} must be a power of two, got {v}")
    return v


class KernelConfig(BaseModel):
    """Launch parameters of one Triton kernel."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    flatten: bool = False  # flatten an outer tile loop with the K loop so loads pipeline across tiles

    @field_validator("block_m", "block_n", "block_k")
    @classmethod
    def _tiles_pow2(cls, v, info):
        return _pow2(v, info.field_name)

    @field_validator("group_m")
    @classmethod
    def _group(cls, v):
        if not 1 <= v <= 64:
            raise ValueError(f"group_m must be in [1, 64], got {v}")
        return v

    @field_validator("num_warps")
    @classmethod
    def _warps(cls, v):
        if v not in _WARPS:
            raise ValueError(f"num_warps must be one of {_WARPS}, got {v}")
        return v

    @field_validator("num_stages")
    @classmethod
    def _stages(cls, v):
        if not 1 <= v <= 8:
            raise ValueError(f"num_stages must be in [1, 8], got {v}")
        return v


class MoeConfig(BaseModel):
    """Both grouped GEMMs of one fused_moe call. They share block_m: the alignment pads to it.

    ``fused_topk``: with a direct plan (tiny batches), sum each token's k experts inside the down GEMM instead
    of a separate top-k reduction (see :func:`hopperkern.moe.down`); ignored for sorted plans."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gemm1: KernelConfig
    gemm2: KernelConfig
    fused_topk: bool = False

    @model_validator(mode="after")
    def _same_block_m(self):
        if self.gemm1.block_m != self.gemm2.block_m:
            raise ValueError(f"gemm1.block_m ({self.gemm1.block_m}) must equal gemm2.block_m ({self.gemm2.block_m})")
        return self


def _check_buckets(table: dict) -> dict:
    for key, buckets in table.items():
        for b in buckets:
            if not (isinstance(b, str) and b.isdigit() and int(b) > 0):
                raise ValueError(f"{key}: token bucket must be a positive integer string, got {b!r}")
    return table


def _nearest(buckets: dict, tokens: int):
    if not buckets:
        return None
    t = max(int(tokens), 1)
    best = min(buckets, key=lambda b: (abs(math.log(int(b)) - math.log(t)), int(b)))
    return buckets[best]


def lce_key(phase: str, dtype, hidden: int) -> str:
    """Key of an LCE entry: ``"forward:bfloat16:H4096"`` (shape class = phase, dtype, hidden size)."""
    return f"{phase}:{str(dtype).replace('torch.', '')}:H{int(hidden)}"


def moe_key(E: int, H: int, I: int, dtype) -> str:  # noqa: E741 - I is the MoE intermediate size
    """Key of a MoE entry: ``"E128_H2048_I768_bfloat16"``."""
    return f"E{E}_H{H}_I{I}_{str(dtype).replace('torch.', '')}"


class TuningConfig(BaseModel):
    """One GPU's tuning file."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    device_name: str = ""
    triton_version: str = ""
    tuned_at: str = ""
    tuner: str = ""
    lce: Dict[str, Dict[str, KernelConfig]] = Field(default_factory=dict)
    moe: Dict[str, Dict[str, MoeConfig]] = Field(default_factory=dict)

    _origin: str = PrivateAttr(default="built-in defaults")
    _why: str = PrivateAttr(default="")

    @field_validator("schema_version")
    @classmethod
    def _schema(cls, v):
        if v != SCHEMA_VERSION:
            raise ValueError(f"schema_version must be {SCHEMA_VERSION}, got {v}")
        return v

    @field_validator("lce", "moe")
    @classmethod
    def _buckets(cls, v):
        return _check_buckets(v)

    @property
    def origin(self) -> str:
        """The file this config came from, or ``"built-in defaults"``."""
        return self._origin

    @property
    def why(self) -> str:
        """How the lookup reached this file (for ``python -m hopperkern.info``)."""
        return self._why

    @property
    def is_default(self) -> bool:
        return self._origin == "built-in defaults"

    def lce_config(self, phase: str, dtype, tokens: int, hidden: int) -> Optional[KernelConfig]:
        """Tuned LCE launch config for ``phase`` ("forward"/"backward"): the entry of the nearest hidden size
        (log scale) for this phase and dtype, then its nearest token bucket; None when there is none."""
        prefix = lce_key(phase, dtype, 0)[:-1]
        sizes = {int(k[len(prefix):]): k for k in self.lce if k.startswith(prefix) and k[len(prefix):].isdigit()}
        if not sizes:
            return None
        h = max(int(hidden), 1)
        best = min(sizes, key=lambda x: (abs(math.log(x) - math.log(h)), x))
        return _nearest(self.lce[sizes[best]], tokens)

    def moe_config(self, E: int, H: int, I: int, dtype, tokens: int) -> Optional[MoeConfig]:  # noqa: E741
        """Tuned fused_moe configs for this shape and the nearest token bucket, or None."""
        return _nearest(self.moe.get(moe_key(E, H, I, dtype), {}), tokens)

    def save(self, path) -> None:
        """Write this config as JSON (for the tuner)."""
        Path(path).write_text(json.dumps(self.model_dump(), indent=1, sort_keys=True) + "\n")


@functools.lru_cache(maxsize=1)
def _package_dir() -> Path:
    return Path(__file__).resolve().parent  # resolved once: load_config runs on every op call


def packaged_config_dirs() -> list[Path]:
    """Folders that may hold packaged tuning files: the wheel's ``hopperkern/configs`` and a checkout's
    top-level ``configs/``."""
    here = _package_dir()
    return [here / "configs", here.parent / "configs"]


def _parse_file(path: Path) -> TuningConfig:
    try:
        text = path.read_text()
    except OSError as exc:
        raise TuningFileError(f"{path}: cannot read tuning file: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TuningFileError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TuningFileError(f"{path}: top level must be a JSON object, got {type(data).__name__}")
    try:
        return TuningConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise TuningFileError(f"{path}: field '{loc}': {first['msg']} ({exc.error_count()} error(s) in all)") from exc


@functools.lru_cache(maxsize=64)
def _load_cached(path: str, mtime_ns: int, why: str) -> TuningConfig:
    cfg = _parse_file(Path(path))
    cfg._origin = path
    cfg._why = why
    return cfg


def _load_path(path: Path, why: str) -> TuningConfig:
    # Parsed once per (file, modification time, lookup reason); every op call looks its config up, so the
    # steady state is one stat and a cache hit. The object is shared between calls: treat it as read-only.
    return _load_cached(str(path), path.stat().st_mtime_ns, why)


def _current_device_name() -> Optional[str]:
    from .tma.capability import capability

    return capability().config_name


def config_search(source=None) -> tuple[Optional[Path], list[str], str]:
    """Resolve ``source`` to (file found or None, files looked for, why). Never reads a file's content."""
    from .tma.capability import normalize_device_name

    looked: list[str] = []
    if source is not None:
        p = Path(source)
        if isinstance(source, Path) or str(source).endswith(".json") or os.sep in str(source):
            return p, [str(p)], "path given by the caller"
        stem = normalize_device_name(str(source))
        why_dev = f"device name {source!r} given by the caller"
    else:
        stem = _current_device_name()
        why_dev = "current GPU" if stem else "no GPU: no device file to look for"
    env = os.environ.get("HOPPERKERN_CONFIG")
    if env:
        ep = Path(env)
        if ep.is_dir():
            if stem:
                cand = ep / f"{stem}.json"
                looked.append(str(cand))
                if cand.is_file():
                    return cand, looked, f"HOPPERKERN_CONFIG folder, {why_dev}"
        else:
            return ep, [str(ep)], "HOPPERKERN_CONFIG file"
    if stem:
        for d in packaged_config_dirs():
            cand = d / f"{stem}.json"
            looked.append(str(cand))
            if cand.is_file():
                return cand, looked, f"packaged file, {why_dev}"
    return None, looked, why_dev


_WARNED: set = set()
_FOUND: dict = {}  # (source, HOPPERKERN_CONFIG, current GPU) -> (file, why) of a search that found a file


def load_config(source=None) -> TuningConfig:
    """The tuning config for ``source``: None (current GPU), a device name (``"NVIDIA H200"``) or a path.

    The returned config is shared between calls (treat it as read-only). Falls back to built-in defaults with one
    warning per missing file. Raises :class:`TuningFileError` for a
    malformed file and ``FileNotFoundError`` for an explicit path (argument or ``HOPPERKERN_CONFIG``) that does
    not exist.
    """
    # Steady state of an op call: one dict lookup and one stat. Where a file was found for this (source,
    # HOPPERKERN_CONFIG, current GPU), the search is not repeated; the stat sees an edited file (new mtime) and
    # a removed one (the search runs again). A changed HOPPERKERN_CONFIG is a different key.
    memo_key = (source if source is None or isinstance(source, str) else str(source),
                os.environ.get("HOPPERKERN_CONFIG"), _current_device_name() if source is None else None)
    hit = _FOUND.get(memo_key)
    if hit is not None:
        try:
            return _load_cached(hit[0], os.stat(hit[0]).st_mtime_ns, hit[1])
        except FileNotFoundError:
            _FOUND.pop(memo_key, None)
    path, looked, why = config_search(source)
    if path is not None:
        if not path.is_file():
            raise FileNotFoundError(f"tuning file {path} ({why}) does not exist")
        cfg = _load_path(path, why)
        if looked == [str(path)]:  # the first place searched: no file can appear before it in the order
            if len(_FOUND) >= 256:
                _FOUND.clear()
            _FOUND[memo_key] = (str(path), why)
        return cfg
    cfg = TuningConfig()
    cfg._why = why
    key = tuple(looked) or (why,)
    if key not in _WARNED and looked:
        _WARNED.add(key)
        warnings.warn(
            f"hopperkern: no tuning file found (looked for {', '.join(looked)}); using built-in defaults. "
            f"Tune this GPU with: {TUNER_COMMAND}",
            stacklevel=2,
        )
    return cfg
