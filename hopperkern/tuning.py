"""Per-GPU tuning files: ``configs/<DEVICE_NAME>.json``, validated with pydantic.

Only the tuner writes these files (``python -m hopperkern.tune``); ops read them through :func:`load_config`.
A file is named after its GPU (:func:`hopperkern.tma.normalize_device_name`: ``NVIDIA H200`` ->
``NVIDIA_H200.json``) and its ``device_name`` must say the same.

Lookup order for ``load_config(source=None)``:

1. ``HOPPERKERN_CONFIG`` (read at call time): a JSON file, or a folder holding ``<DEVICE_NAME>.json``;
2. the packaged ``configs/<DEVICE_NAME>.json`` (inside the wheel, or the checkout's top-level ``configs/``);
3. the closest file of the same architecture in those folders (an H100 PCIe or NVL or an H800 without a file of
   its own takes the H100 SXM's, an H20 or a GH200 the H200's; :func:`hopperkern.tma.capability.closest_devices`
   says which is closest), with ONE warning naming the file looked for and the file used;
4. built-in defaults (each op's heuristics), with ONE warning naming the file looked for and the tuner command.

A file tuned with another Triton version than the running one is used, with one warning. A malformed file raises
:class:`TuningFileError` naming the file and the offending field or entry key.

Layout (GEMM letters ``block_m/n/k`` follow each kernel's docstring), as the tuner writes it (:meth:`save`:
entries in numeric order, one kernel config a line)::

    {
      "schema_version": 1,
      "device_name": "NVIDIA H200",
      "triton_version": "3.6.0",
      "tuned_at": "2026-11-30T15:24:23+00:00",
      "tuner": "python -m hopperkern.tune",
      "lce": {
        "forward:bfloat16:H4096": {
          "2048": {"block_m": 128, "block_n": 256, "block_k": 64, ...},
          "16384": {...}
        }
      },
      "moe": {
        "E128_H2048_I768_bfloat16": {
          "1": {"gemm1": {...}, "gemm2": {...}, "fused_topk": false}
        }
      }
    }

Entry keys: LCE ``<phase>:<dtype>:H<hidden>`` (phase ``forward`` or ``backward``), MoE
``E<experts>_H<hidden>_I<intermediate>_<dtype>``, dtype ``float16``, ``bfloat16`` or ``float32``. Both maps are
keyed by token-count buckets; a lookup takes the nearest bucket on a log scale.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Dict, NamedTuple, Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from .errors import TuningFileError

__all__ = [
    "SCHEMA_VERSION",
    "device_config",
    "file_stamp",
    "stamp_current",
    "stamp_fresh",
    "TUNER_COMMAND",
    "KernelConfig",
    "MoeConfig",
    "TuningConfig",
    "ConfigSearch",
    "TuningFileError",
    "config_search",
    "lce_key",
    "load_config",
    "moe_key",
    "triton_mismatch",
]

SCHEMA_VERSION = 1
TUNER_COMMAND = "python -m hopperkern.tune --out configs/"
_WARPS = (1, 2, 4, 8, 16)


MIN_TILE = 16  # the least tile dim of a KernelConfig: Triton's tl.dot takes K >= 16 on NVIDIA GPUs


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
        v = _pow2(v, info.field_name)
        if v < MIN_TILE:  # every tile dim is some kernel's tl.dot dim (K >= 16 on the GPU) or MoE row block
            raise ValueError(f"{info.field_name} must be >= {MIN_TILE}, got {v}")
        return v

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
    of a separate top-k reduction (see :func:`hopperkern.moe.down`); ignored for sorted plans.

    ``sorted_rows``: with a sorted plan, one launch first copies the token rows into the plan's sorted order, and
    the gate/up GEMM reads that copy with 2-D TMA instead of gathering token rows with pointer loads (TMA gathers
    need sm_100). It pays where I is large (the GEMM's work per copied row grows with I; on the H200, gpt-oss-120B
    and mixtral-8x7B from 4096 tokens); ignored for direct plans and where TMA is off.

    ``fused_mlp``: with a direct plan, one kernel runs both GEMMs, one program per (slot, slice of
    ``gemm1.block_n`` columns of I), and a second launch adds each token's partial rows in a fixed order
    (deterministic). ``gemm1.block_k`` is the gate/up step over H, ``gemm2.block_n`` the down GEMM's chunk of H and
    ``gemm2.block_k`` its step over the slice, so it must equal ``gemm1.block_n``; each GEMM's ``num_stages``
    pipelines its loop, and the two share ``num_warps``. Ignored for sorted plans (they run the two GEMMs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gemm1: KernelConfig
    gemm2: KernelConfig
    fused_topk: bool = False
    sorted_rows: bool = False
    fused_mlp: bool = False

    @model_validator(mode="after")
    def _same_block_m(self):
        if self.gemm1.block_m != self.gemm2.block_m:
            raise ValueError(f"gemm1.block_m ({self.gemm1.block_m}) must equal gemm2.block_m ({self.gemm2.block_m})")
        if self.fused_mlp:
            if self.fused_topk:
                raise ValueError("fused_mlp and fused_topk exclude each other (fused_mlp sums the top-k itself)")
            if self.gemm2.block_k != self.gemm1.block_n:
                raise ValueError(f"fused_mlp: gemm2.block_k ({self.gemm2.block_k}) must equal gemm1.block_n "
                                 f"({self.gemm1.block_n}), the slice of I both GEMMs of a program share")
            if self.gemm2.num_warps != self.gemm1.num_warps:
                raise ValueError(f"fused_mlp: gemm2.num_warps ({self.gemm2.num_warps}) must equal gemm1.num_warps "
                                 f"({self.gemm1.num_warps}): both GEMMs run in one kernel")
        return self


_DTYPES = ("float16", "bfloat16", "float32")
_LCE_KEY = re.compile(r"(forward|backward):(float16|bfloat16|float32):H([1-9][0-9]*)")
_MOE_KEY = re.compile(r"E([1-9][0-9]*)_H([1-9][0-9]*)_I([1-9][0-9]*)_(float16|bfloat16|float32)")
_KEY_FORMS = {
    "lce": (_LCE_KEY, "'<forward|backward>:<dtype>:H<hidden>'", "forward:bfloat16:H4096"),
    "moe": (_MOE_KEY, "'E<experts>_H<hidden>_I<intermediate>_<dtype>'", "E128_H2048_I768_bfloat16"),
}


def _check_buckets(table: dict, section: str) -> dict:
    pattern, form, example = _KEY_FORMS[section]
    for key, buckets in table.items():
        if not pattern.fullmatch(key):
            raise ValueError(f"entry key must be {form} with dtype {', '.join(_DTYPES)} (e.g. {example!r}), "
                             f"got {key!r}")
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
    _stamp: tuple = PrivateAttr(default=(None, None))  # (file, modification time) it was parsed from

    @field_validator("schema_version")
    @classmethod
    def _schema(cls, v):
        if v != SCHEMA_VERSION:
            raise ValueError(f"schema_version must be {SCHEMA_VERSION}, got {v}")
        return v

    @field_validator("lce", "moe")
    @classmethod
    def _buckets(cls, v, info):
        return _check_buckets(v, info.field_name)

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

    def canonical_json(self) -> str:
        """This config as the tuner writes it: fields in schema order; LCE entries by phase (forward first),
        dtype and hidden size, MoE entries by dtype, E, H and I, token buckets by size (all as numbers); every
        kernel config on one line."""
        data = self.model_dump()
        data["lce"] = {k: _by_bucket(data["lce"][k]) for k in sorted(data["lce"], key=_lce_order)}
        data["moe"] = {k: _by_bucket(data["moe"][k]) for k in sorted(data["moe"], key=_moe_order)}
        return _format(data) + "\n"

    def save(self, path) -> None:
        """Write this config to ``path`` in its canonical form (:meth:`canonical_json`)."""
        Path(path).write_text(self.canonical_json())


def _lce_order(key: str):
    phase, dtype, hidden = _LCE_KEY.fullmatch(key).groups()
    return ("forward", "backward").index(phase), _DTYPES.index(dtype), int(hidden)


def _moe_order(key: str):
    E, H, I, dtype = _MOE_KEY.fullmatch(key).groups()  # noqa: E741
    return _DTYPES.index(dtype), int(E), int(H), int(I)


def _by_bucket(buckets: dict) -> dict:
    return {b: buckets[b] for b in sorted(buckets, key=int)}


def _format(value, depth: int = 0) -> str:
    """JSON with objects that hold objects spread over lines (2-space indent) and flat objects on one line."""
    if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()):
        pad = "  " * (depth + 1)
        items = ",\n".join(f"{pad}{json.dumps(k)}: {_format(v, depth + 1)}" for k, v in value.items())
        return "{\n" + items + "\n" + "  " * depth + "}"
    return json.dumps(value)


@functools.lru_cache(maxsize=1)
def _package_dir() -> Path:
    return Path(__file__).resolve().parent  # resolved once: load_config runs on every op call


def packaged_config_dirs() -> list[Path]:
    """Folders that may hold packaged tuning files: the wheel's ``hopperkern/configs`` and a checkout's
    top-level ``configs/``."""
    here = _package_dir()
    dirs = [here / "configs"]
    if (here.parent / "pyproject.toml").is_file():  # a source checkout; in a wheel install here.parent is
        dirs.append(here.parent / "configs")          # site-packages, whose configs/ may belong to anything
    return dirs


def _parse_file(path: Path, named: bool) -> TuningConfig:
    """Read and validate ``path``; ``named``: the file was found by its name, so its ``device_name`` must match."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TuningFileError(f"{path}: cannot read tuning file: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise TuningFileError(f"{path}: not UTF-8 text (a tuning file is UTF-8 JSON): {exc}") from exc
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, and the parser's other limits
        raise TuningFileError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TuningFileError(f"{path}: top level must be a JSON object, got {type(data).__name__}")
    try:
        # strict: a file's values are JSON's own types ("128", 128.0, true for a tile and "yes" for a flag are
        # refused, not coerced), as the tuner writes them
        cfg = TuningConfig.model_validate(data, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise TuningFileError(f"{path}: field '{loc}': {first['msg']} ({exc.error_count()} error(s) in all)") from exc
    if named:
        from .tma.capability import normalize_device_name

        if normalize_device_name(cfg.device_name) != path.stem:
            raise TuningFileError(
                f"{path}: field 'device_name' must be the name of the GPU the file is named after "
                f"({path.stem}.json holds the GPU whose name normalizes to {path.stem!r}), got {cfg.device_name!r}; "
                f"a file tuned on another GPU keeps that GPU's name: see {TUNER_COMMAND}")
    return cfg


@functools.lru_cache(maxsize=64)
def _load_cached(path: str, mtime_ns: int, why: str, named: bool = False) -> TuningConfig:
    cfg = _parse_file(Path(path), named)
    cfg._origin = path
    cfg._why = why
    cfg._stamp = (path, mtime_ns)
    return cfg


def file_stamp(cfg: TuningConfig) -> tuple:
    """``(file, modification time)`` ``cfg`` was parsed from, ``(None, None)`` for built-in defaults: what a cached
    launch plan keeps to tell, per call, whether its tuning file changed (:func:`stamp_current`)."""
    return cfg._stamp


def stamp_current(stamp: tuple) -> bool:
    """Whether the file of ``stamp`` (:func:`file_stamp`) still has that modification time (one ``stat``); True for
    built-in defaults. Cached launch plans check this on every call, so an edited tuning file takes effect on the
    next call."""
    path, mtime = stamp
    return path is None or _mtime(path) == mtime


def stamp_fresh(cfg: TuningConfig) -> bool:
    """:func:`stamp_current` of ``cfg``'s file."""
    return stamp_current(cfg._stamp)


def device_config(device=None) -> TuningConfig:
    """:func:`load_config` for the GPU of ``device`` (a torch device, an index, or None for the current GPU):
    what every launcher uses, so an op on a second GPU takes that GPU's file, not the current one's."""
    from .tma.capability import capability

    return load_config(capability(device).device_name if device is not None else None)


@functools.lru_cache(maxsize=16)
def _defaults(why: str) -> TuningConfig:
    cfg = TuningConfig()
    cfg._why = why
    return cfg


def _current_device_name() -> Optional[str]:
    from .tma.capability import capability

    return capability().config_name


class ConfigSearch(NamedTuple):
    """Where :func:`config_search` looked and what it found.

    ``path``: the file to load, or None (built-in defaults); ``looked``: every file it looked for by name, in
    order; ``why``: how it got there, in words (``python -m hopperkern.info`` shows it); ``closest_to``: when
    ``path`` is the closest file of the same architecture, the device whose own file is missing; ``named``:
    whether ``path`` was chosen by its name (its ``device_name`` must then match it); ``listed``: the folders
    whose file lists the closest-file search read; ``arch``: ``"sm_90"``-style architecture of a closest file;
    ``passed_over``: the closer candidates that search skipped as invalid tuning files, as (path, mtime_ns)."""

    path: Optional[Path]
    looked: list
    why: str
    closest_to: Optional[str] = None
    named: bool = False
    listed: tuple = ()
    arch: str = ""
    passed_over: tuple = ()


def _folders(env: Optional[str]) -> list[Path]:
    """The folders searched for ``<DEVICE_NAME>.json``, in order."""
    return ([Path(env)] if env and Path(env).is_dir() else []) + packaged_config_dirs()


def _closest_file(device: str, folders: list[Path]):
    """(file or None, folders listed, compute capability, candidates passed over as (path, mtime_ns)) of the
    closest file of ``device``'s architecture in ``folders`` (:func:`hopperkern.tma.capability.closest_devices`)."""
    from .tma.capability import capability, closest_devices, known_compute_capability, normalize_device_name

    cc = sms = None
    if normalize_device_name(device) == _current_device_name():  # this GPU: its own facts beat the model table
        cap = capability()
        cc, sms = cap.compute_capability, cap.sm_count
    cc = cc or known_compute_capability(device)
    files: dict[str, Path] = {}
    listed = []
    for d in folders:
        if not d.is_dir():
            continue
        listed.append(str(d))
        for f in sorted(d.glob("*.json")):
            if normalize_device_name(f.stem) == f.stem:  # only names a tuning file can have (no "x.old.json")
                files.setdefault(f.stem, f)  # an earlier folder wins, as in the lookup by name
    # Candidates in order of closeness; one that is not a valid tuning file for its name (notes, a backup, a
    # sweep dump) is passed over rather than breaking every op call on this GPU.
    passed_over = []
    for stem in closest_devices(device, list(files), compute_capability=cc, sm_count=sms):
        try:
            _parse_file(files[stem], True)
        except TuningFileError as exc:
            warnings.warn(f"hopperkern: passing over {files[stem]} as the closest tuning file for {device}: {exc}",
                          stacklevel=4)
            passed_over.append((str(files[stem]), _mtime(str(files[stem]))))
            continue
        return files[stem], tuple(listed), cc, tuple(passed_over)
    return None, tuple(listed), cc, tuple(passed_over)


def config_search(source=None) -> ConfigSearch:
    """Resolve ``source`` (None, a device name or a path, as for :func:`load_config`) to the file to load. Reads
    no file's content; the closest-file search lists the searched folders."""
    from .tma.capability import capability, normalize_device_name

    looked: list[str] = []
    if source is not None:
        p = Path(source)
        if isinstance(source, Path) or str(source).endswith(".json") or os.sep in str(source):
            return ConfigSearch(p, [str(p)], "path given by the caller")
        device = str(source)
        stem = normalize_device_name(device)
        why_dev = f"device name {source!r} given by the caller"
    else:
        stem = _current_device_name()
        device = capability().device_name if stem else None
        why_dev = "current GPU" if stem else "no GPU: no device file to look for"
    env = os.environ.get("HOPPERKERN_CONFIG")
    if env and not Path(env).is_dir():
        return ConfigSearch(Path(env), [env], "HOPPERKERN_CONFIG file")
    if not stem:
        return ConfigSearch(None, looked, why_dev)
    folders = _folders(env)
    for d in folders:
        cand = d / f"{stem}.json"
        looked.append(str(cand))
        if cand.is_file():
            where = "HOPPERKERN_CONFIG folder" if env and d == Path(env) else "packaged file"
            return ConfigSearch(cand, looked, f"{where}, {why_dev}", named=True)
    path, listed, cc, passed_over = _closest_file(device, folders)
    if path is None:
        return ConfigSearch(None, looked, why_dev, listed=listed, passed_over=passed_over)
    arch = f"sm_{cc[0]}{cc[1]}"
    return ConfigSearch(path, looked, f"closest file of the same architecture ({arch}): no file for {device} "
                                      f"({why_dev})", closest_to=device, named=True, listed=listed, arch=arch,
                        passed_over=passed_over)


_WARNED: set = set()  # keys of the warnings given: one per missing file, per closest file, per Triton mismatch
# (source, HOPPERKERN_CONFIG, current GPU) -> (file or None, why, named, files that must stay absent, (folder or
# passed-over candidate, modification time) pairs that must not change, the fallback warning due or None, whether
# the file is a closest file): a search's result, valid while those files stay absent and those paths unchanged.
_FOUND: dict = {}


def _mtime(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def load_config(source=None) -> TuningConfig:
    """The tuning config for ``source``: None (current GPU), a device name (``"NVIDIA H200"``) or a path.

    The returned config is shared between calls (treat it as read-only). Where the GPU has no file, the closest
    file of the same architecture is used with one warning naming both; where there is none either, built-in
    defaults, with one warning naming the file looked for and the tuner command. Raises
    :class:`TuningFileError` for a malformed file and ``FileNotFoundError`` for an explicit path (argument or
    ``HOPPERKERN_CONFIG``) that does not exist.
    """
    # Steady state of an op call: one dict lookup and a stat per file involved. A search's result is remembered
    # per (source, HOPPERKERN_CONFIG, current GPU) together with what would change it: the files looked for
    # before the one found must still be absent, and the folders the closest-file search listed unchanged
    # (adding or removing a file changes a folder's modification time), as must the candidates it passed over as
    # invalid (an edit may repair one). The stat of the file itself sees an edit (a new mtime: parsed again; a
    # closest file made invalid is searched again, so passed over as a fresh search would) and a removal
    # (searched again). A changed HOPPERKERN_CONFIG is a new key.
    memo_key = (source if source is None or isinstance(source, str) else str(source),
                os.environ.get("HOPPERKERN_CONFIG"), _current_device_name() if source is None else None)
    hit = _FOUND.get(memo_key)
    if hit is not None:
        path, why, named, absent, listed, notice, closest = hit
        if not any(os.path.exists(a) for a in absent) and all(_mtime(d) == m for d, m in listed):
            mtime = _mtime(path) if path is not None else None
            if path is None or mtime is not None:
                try:
                    cfg = _defaults(why) if path is None else _load_cached(path, mtime, why, named)
                except TuningFileError:
                    if not closest:
                        raise
                    cfg = None  # a closest file made invalid since: the search passes it over, as a fresh one would
                if cfg is not None:
                    _notify(notice)
                    return _checked(cfg)
        _FOUND.pop(memo_key, None)
    found = config_search(source)
    if found.path is not None and not found.path.is_file():
        if found.path.is_dir():  # a folder given as the caller's path: HOPPERKERN_CONFIG is where folders go
            raise FileNotFoundError(f"tuning file {found.path} ({found.why}) is a folder, not a file: pass the "
                                    "file itself, or name the folder in HOPPERKERN_CONFIG")
        raise FileNotFoundError(f"tuning file {found.path} ({found.why}) does not exist")
    listed = tuple((d, _mtime(d)) for d in found.listed)
    notice = None
    if found.path is None:
        cfg = _defaults(found.why)
        if found.looked:
            notice = (tuple(found.looked),
                      f"hopperkern: no tuning file found (looked for {', '.join(found.looked)}); using built-in "
                      f"defaults. Tune this GPU with: {TUNER_COMMAND}")
    else:
        cfg = _load_cached(str(found.path), found.path.stat().st_mtime_ns, found.why, found.named)
        if found.closest_to is not None:
            notice = ((found.closest_to, cfg.origin),
                      f"hopperkern: no tuning file for {found.closest_to} (looked for {', '.join(found.looked)}); "
                      f"using {cfg.origin} (tuned on {cfg.device_name}), the closest file of the same architecture "
                      f"({found.arch}). Tune this GPU with: {TUNER_COMMAND}")
    _notify(notice)
    if found.looked or found.path is not None:
        if len(_FOUND) >= 256:
            _FOUND.clear()
        absent = tuple(p for p in found.looked if p != str(found.path))
        # A candidate the closest-file search passed over is watched like a folder: edited, it is searched again.
        _FOUND[memo_key] = (None if found.path is None else str(found.path), found.why, found.named, absent,
                            listed + found.passed_over, notice, found.closest_to is not None)
    return _checked(cfg)


def _notify(notice) -> None:
    """Warn ``notice = (key, message)`` unless a warning with that key was given already (one per missing file)."""
    if notice is not None and notice[0] not in _WARNED:
        _WARNED.add(notice[0])
        warnings.warn(notice[1], stacklevel=3)  # the caller of load_config


def triton_mismatch(cfg: TuningConfig) -> Optional[str]:
    """A sentence when ``cfg`` was tuned with another Triton version than the running one, else None."""
    from .tma.capability import _numbers, capability

    running = capability().triton_version
    if not (cfg.triton_version and running) or _numbers(running) == _numbers(cfg.triton_version):
        return None
    return (f"tuned with triton {cfg.triton_version}, this process runs triton {running}: its launch configs are "
            "used, but may no longer be the fastest")


def _checked(cfg: TuningConfig) -> TuningConfig:
    """``cfg``, after one warning per file and Triton version when the file was tuned with another Triton."""
    key = ("triton", cfg.origin, cfg.triton_version)
    if not cfg.triton_version or key in _WARNED:
        return cfg
    _WARNED.add(key)
    mismatch = triton_mismatch(cfg)
    if mismatch:
        warnings.warn(f"hopperkern: tuning file {cfg.origin} was {mismatch}. Re-tune with: {TUNER_COMMAND}",
                      stacklevel=3)  # the caller of load_config
    return cfg
