"""What this machine can run, for users and bug reports: ``python -m hopperkern.info [--json]``.

:func:`collect` gathers plain JSON-able data and never raises: a probe that fails becomes the string
``"could not collect: ..."``. :func:`render` draws it as rich tables. Everything about hardware and TMA comes
from :func:`hopperkern.tma.capability`; everything about tuning files from :mod:`hopperkern.tuning`.
The kernel families are described from the capability alone, so this works before (or without) importing
any op module, with no GPU, and under Triton's interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

__all__ = ["collect", "main", "render"]

BUG_REPORT_LINE = ("Paste this output (or `python -m hopperkern.info --json`) into bug reports: "
                   "it says what ran and why.")
_ENV_VARS = ("HOPPERKERN_TMA", "HOPPERKERN_CONFIG", "HOPPERKERN_PDL", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")
_GATHER = "activations: rows gathered by token index: pointer loads (TMA gather needs sm_100)"
# (family, what goes through TMA when it can, operands that never can on sm_90). The op name a launcher passes
# to tma.decide() is the family's first word.
_FAMILIES = (
    ("matmul", "a, b and c tiles, each when eligible", None),
    ("lce.forward", "hidden and weight tiles, each when eligible", None),
    ("lce.backward", "hidden, weight and dlogits tiles, each when eligible", None),
    ("moe.gemm1 (gate/up, rows gathered: pointer loads for activations, TMA for weights)",
     "expert weights through a 3-D descriptor", _GATHER),
    ("moe.gemm2", "sorted intermediate rows and expert weights", None),
)


def _failed(exc: BaseException) -> str:
    return f"could not collect: {type(exc).__name__}: {exc}"


def _probe(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        return _failed(exc)


def _version(module: str):
    mod = __import__(module)
    v = getattr(mod, "__version__", None) or getattr(mod, "VERSION", None)
    if v is None:
        from importlib.metadata import version

        v = version(module)
    return str(v)


def _numpy() -> str:
    try:
        return _version("numpy")
    except ImportError:
        return "not installed (only Triton's CPU interpreter needs it: pip install \"hopperkern[interpreter]\")"


def _driver() -> str:
    from .tma.capability import nvidia_driver_version

    return nvidia_driver_version()


def _cuda_runtime() -> str:
    from .tma.capability import cuda_runtime_version

    return cuda_runtime_version()


def _installation() -> dict:
    """Where the imported hopperkern lives, how it got there (editable install, wheel install, or a source tree
    on the path) and, in a git checkout, its revision."""
    from importlib import metadata

    import hopperkern

    pkg = Path(hopperkern.__file__).resolve().parent
    try:
        dist = metadata.distribution("hopperkern")
    except metadata.PackageNotFoundError:
        dist = None
    if dist is None:
        kind = "not installed: imported from a source tree on the path"
    else:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        url = direct.get("url", "")
        if direct.get("dir_info", {}).get("editable"):
            src = Path(url.removeprefix("file://")).resolve() if url.startswith("file://") else None
            kind = f"editable install of {src or url}"
            if src is not None and not pkg.is_relative_to(src):
                kind = f"imported from a source tree; hopperkern {dist.version} is an editable install of {src}"
        elif pkg.is_relative_to(Path(dist.locate_file("")).resolve()):
            kind = "wheel install" + (f" from {url}" if url else "")
        else:
            kind = f"imported from a source tree; hopperkern {dist.version} is installed at {dist.locate_file('')}"
    return {"path": str(pkg), "kind": kind, "git": _git_revision(pkg.parent)}


def _git_revision(root: Path):
    """``"abc1234"`` (with ``" + uncommitted changes"``) when ``root`` is a git checkout, else None."""
    if not (root / ".git").exists():  # a folder, or a file in a worktree
        return None
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return _failed(exc)
    if rev.returncode != 0:
        return f"could not collect: git rev-parse: {rev.stderr.strip()}"
    return rev.stdout.strip() + (" + uncommitted changes" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def _torch_cuda():
    import torch

    return torch.version.cuda or "none (CPU build)"


def _capability() -> dict:
    from . import tma

    cap = tma.capability()
    return {
        "cuda_available": cap.cuda_available,
        "interpreter": cap.interpreter,
        "device_name": cap.device_name,
        "compute_capability": ".".join(map(str, cap.compute_capability)) if cap.compute_capability else None,
        "sm_count": cap.sm_count,
        "triton_version": cap.triton_version,
        "triton_has_tensor_descriptors": cap.tensor_descriptors,  # the API; whether they run here is "tma"
        "tma": cap.tma,
        "reasons": list(cap.reasons),
        "pdl": cap.pdl,
        "pdl_enabled": _pdl_enabled(),
        "hopper_mma": cap.hopper_mma,
    }


def _pdl_enabled():
    """Whether plans built now chain their launches (capability and HOPPERKERN_PDL), or why that is unknown."""
    from .tma.launcher import pdl_enabled

    try:
        return pdl_enabled()
    except ValueError as exc:
        return str(exc)


def _interpreter():
    """Triton's interpreter: None when off; else what stops it here, and per 16-bit dtype whether the probe found
    its dot and cast right ("right") or the reasons it computes that dtype wrongly (ops refuse such inputs)."""
    import torch

    from . import tma

    if not tma.interpreter_active():
        return None
    problems = list(tma.interpreter_problems())
    out = {"problems": problems}
    for dtype in (torch.float16, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        if problems:
            out[name] = "not probed: the interpreter cannot run here"
        else:
            out[name] = list(tma.interpreter_dtype_problems(dtype)) or "right"
    return out


def _tma_mode() -> str:
    from . import tma

    return tma.resolve_mode("auto")


def _last_launch(op: str):
    from . import tma

    d = tma.last_decision(op)
    if d is None:
        return None
    return {"mode": d.mode, "tma": {k: bool(v) for k, v in d.use.items()},
            "reasons": {k: list(r) for k, r in d.reasons.items() if r and not d.use[k]}}


def _families(cap, mode) -> list[dict]:
    """One row per kernel family: can it use TMA here (``yes`` / ``partly`` / ``no``) and why."""
    if isinstance(cap, str):  # the capability probe failed
        blocked = [cap]
    elif mode.startswith("could not collect"):
        blocked = [f"HOPPERKERN_TMA is invalid, every op will raise: {mode.removeprefix('could not collect: ')}"]
    elif mode == "never":
        blocked = ["HOPPERKERN_TMA=never: pointer loads everywhere"]
    elif not cap["tma"]:
        blocked = list(cap["reasons"]) or ["TMA is off (no reason recorded)"]
    else:
        blocked = []
    rows = []
    for family, uses, never in _FAMILIES:
        extra = [never] if never else []
        if blocked:
            row = {"family": family, "tma": "no", "why": blocked + extra}
        else:
            row = {"family": family, "tma": "partly" if never else "yes", "why": [uses] + extra}
        row["last_launch"] = _probe(_last_launch, family.split()[0])
        rows.append(row)
    return rows


def _tuning() -> dict:
    from . import tuning

    out = {}
    found = tuning.config_search()
    out["found"] = str(found.path) if found.path is not None else None
    out["looked_for"] = list(found.looked)
    out["why"] = found.why
    out["closest_to"] = found.closest_to  # this GPU has no file: the file found is the closest one of its kind
    # The tuning files hopperkern ships (file names; each is named after the GPU it was tuned on).
    out["shipped"] = sorted({p.name for d in tuning.packaged_config_dirs() if d.is_dir() for p in d.glob("*.json")})
    # The fallback warnings are the ops' business; here the same facts go into the report instead, and the
    # warnings stay due for the first op call of a program that collects this report.
    warned = set(tuning._WARNED)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = tuning.load_config()
    except Exception as exc:  # a malformed file: the error names the file and the field or key
        out["loaded"] = None
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        tuning._WARNED.intersection_update(warned)
    out["loaded"] = cfg.origin
    out["error"] = None
    out["tuned_on"] = cfg.device_name or None
    out["tuned_with_triton"] = cfg.triton_version or None
    out["triton_mismatch"] = tuning.triton_mismatch(cfg)
    out["entries"] = {"lce": sorted(cfg.lce), "moe": sorted(cfg.moe)}
    if found.looked and (cfg.is_default or found.closest_to is not None):
        out["hint"] = f"tune this GPU with: {tuning.TUNER_COMMAND}"
    return out


def collect() -> dict:
    """Plain, JSON-able facts about this process: versions, device, TMA per kernel family, tuning file.

    Never raises; a probe that fails reads ``"could not collect: <error>"``.
    """
    from . import __version__

    cap = _probe(_capability)
    mode = _probe(_tma_mode)
    return {
        "hopperkern": __version__,
        "installation": _probe(_installation),
        "environment": {
            "python": sys.version.split()[0],
            "platform": _probe(platform.platform),
            "torch": _probe(_version, "torch"),
            "torch.version.cuda": _probe(_torch_cuda),
            "NVIDIA driver": _probe(_driver),
            "CUDA runtime": _probe(_cuda_runtime),
            "triton": _probe(_version, "triton"),
            "numpy": _probe(_numpy),
            "pydantic": _probe(_version, "pydantic"),
            "rich": _probe(_version, "rich"),
        },
        "capability": cap,
        "interpreter": _probe(_interpreter),
        "settings": {name: os.environ.get(name) for name in _ENV_VARS},
        "tma_mode": mode,
        "families": _probe(_families, cap, mode),
        "tuning": _probe(_tuning),
    }


def _text(value) -> str:
    """One table cell: data strings are escaped, because rich reads ``[tma]`` as markup and drops it."""
    from rich.markup import escape

    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return "\n".join(_text(v) for v in value) if value else "-"
    return escape(str(value))


def _launch_text(last) -> list[str]:
    if not isinstance(last, dict):
        return [] if last is None else [f"last launch: {last}"]
    paths = ", ".join(f"{k}={'TMA' if v else 'pointer'}" for k, v in last["tma"].items())
    return [f"last launch (tma={last['mode']!r}): {paths}"]


def render(data: dict, console=None) -> None:
    """Print :func:`collect`'s data as rich tables on ``console`` (default: stdout)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()

    env = Table(title=f"hopperkern {_text(data.get('hopperkern'))}: environment", show_header=False)
    env.add_column("what", style="bold")
    env.add_column("value")
    where = data.get("installation")
    if isinstance(where, dict):
        env.add_row("hopperkern from", _text(f"{where['path']} ({where['kind']})"))
        if where.get("git"):
            env.add_row("git revision", _text(where["git"]))
    else:
        env.add_row("hopperkern from", _text(where))
    environment = data.get("environment")
    for k, v in (environment.items() if isinstance(environment, dict) else [("environment", environment)]):
        env.add_row(_text(k), _text(v))
    cap = data.get("capability")
    if isinstance(cap, dict):
        cc = cap["compute_capability"]
        env.add_row("GPU", _text(cap["device_name"] or ("none" if not cap["cuda_available"] else None)))
        env.add_row("compute capability", _text(f"{cc} (sm_{cc.replace('.', '')})" if cc else None))
        env.add_row("SMs", _text(cap["sm_count"]))
        env.add_row("Triton interpreter", "on (kernels run on the CPU)" if cap["interpreter"] else "off")
        env.add_row("triton tensor-descriptor API", _text(cap["triton_has_tensor_descriptors"]))
        # Whether descriptors can be used here: on a CPU without the interpreter the API exists but nothing runs.
        usable = "yes" if cap["tma"] else f"no: {'; '.join(cap['reasons']) or 'no reason recorded'}"
        env.add_row("tensor descriptors (TMA) here", _text(usable))
        if "pdl" in cap:
            on = cap.get("pdl_enabled")
            text = ("no" if not cap["pdl"] else "yes, on (HOPPERKERN_PDL=0 turns it off)" if on is True
                    else "yes, off (HOPPERKERN_PDL)" if on is False else f"yes; {on}")
            env.add_row("programmatic dependent launch", _text(text))
        if "hopper_mma" in cap:
            env.add_row("LCE label logits", "own tensor-core kernel at tiles of 128 x 256 or more (Hopper)"
                        if cap["hopper_mma"] else "picked in the forward's tiles")
    else:
        env.add_row("capability", _text(cap))
    interp = data.get("interpreter")
    if isinstance(interp, dict):
        env.add_row("interpreter problems", _text(interp.get("problems") or "none"))
        for name in ("float16", "bfloat16"):
            verdict = interp.get(name)
            if verdict == "right":
                verdict = "computed right (probed)"
            elif isinstance(verdict, list):
                verdict = verdict + [f"so every op refuses {name} inputs here (UnsupportedError)"]
            env.add_row(f"interpreter {name} (dot, cast)", _text(verdict))
    elif interp is not None:
        env.add_row("interpreter", _text(interp))
    env.add_row("TMA mode for tma='auto'", _text(data.get("tma_mode")))
    settings = data.get("settings")
    for k, v in (settings.items() if isinstance(settings, dict) else [("settings", settings)]):
        env.add_row(_text(k), _text(v if v is not None else "(unset)"))
    console.print(env)

    fam = Table(title="kernel families: TMA or pointer loads")
    fam.add_column("family", style="bold")
    fam.add_column("TMA")
    fam.add_column("why")
    families = data.get("families")
    for row in families if isinstance(families, list) else []:
        fam.add_row(_text(row["family"]), _text(row["tma"]),
                    _text(row["why"] + _launch_text(row.get("last_launch"))))
    if not isinstance(families, list):
        fam.add_row("-", "unknown", _text(families))
    console.print(fam)

    tun = Table(title="tuning file", show_header=False)
    tun.add_column("what", style="bold")
    tun.add_column("value")
    t = data.get("tuning")
    if isinstance(t, dict):
        tun.add_row("would load", _text(t.get("loaded") or "nothing: the file is unusable"))
        tun.add_row("because", _text(t.get("why")))
        tun.add_row("looked for", _text(t.get("looked_for") or "(nothing: no device name)"))
        if t.get("error"):
            tun.add_row("error", _text(t["error"]))
        for key, label in (("tuned_on", "tuned on"), ("tuned_with_triton", "tuned with triton"),
                           ("triton_mismatch", "triton"), ("hint", "hint")):
            if t.get(key):
                tun.add_row(label, _text(t[key]))
        if isinstance(t.get("entries"), dict):
            tun.add_row("entries", f"lce: {len(t['entries']['lce'])}, moe: {len(t['entries']['moe'])}")
        if t.get("shipped"):
            tun.add_row("shipped files", _text(", ".join(t["shipped"])))
    else:
        tun.add_row("tuning", _text(t))
    console.print(tun)
    console.print(_text(BUG_REPORT_LINE))


def main(argv=None) -> int:
    """``python -m hopperkern.info [--json]``; returns the exit code (always 0: a report never fails)."""
    ap = argparse.ArgumentParser(prog="python -m hopperkern.info", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the collected data as JSON instead of tables")
    args = ap.parse_args(argv)
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        render(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
