"""``python -m hopperkern.tune``: the command line, and the one writer of tuning files (:func:`merge_into_file`)."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
import time
from pathlib import Path

from .. import tuning
from .moe_tuner import BUCKETS as MOE_BUCKETS
from .shapes import MOE_SHAPES

__all__ = ["COMMAND", "main", "merge_into_file", "recorded_command"]

COMMAND = "python -m hopperkern.tune"
_DESCRIPTION = ("Time launch configs of hopperkern's kernels on this GPU and write its tuning file,\n"
                "<out>/<DEVICE_NAME>.json, merged with the file already there.")
_EPILOG = """\
The file is named after the GPU: its name with every run of characters other than letters, digits, '-' and '_'
turned into one '_' (NVIDIA H200 -> NVIDIA_H200.json). hopperkern finds it in a checkout's configs/ folder or
in the folder HOPPERKERN_CONFIG names; `python -m hopperkern.info` shows which file a run loads and why."""


def merge_into_file(path: Path, *, lce: dict | None = None, moe: dict | None = None, tuner: str = COMMAND,
                    device_name: str | None = None) -> tuning.TuningConfig:
    """Merge tuned entries (``{key: {bucket: config}}`` for the LCE and MoE sections) into the tuning file at
    ``path`` (created if missing), keeping every other entry; stamp the device (``device_name``, default the
    current GPU's), the running Triton version, the time and ``tuner`` (the command, after those that wrote the
    file's earlier entries, "; " between them); validate through the
    :mod:`hopperkern.tuning` models and write the file in its canonical order. Returns the config written."""
    from ..tma import capability

    path = Path(path)
    cap = capability()
    data = (tuning.load_config(path) if path.is_file() else tuning.TuningConfig()).model_dump()
    for section, found in (("lce", lce), ("moe", moe)):
        for key, buckets in (found or {}).items():
            data[section].setdefault(key, {}).update({b: c.model_dump() for b, c in buckets.items()})
    data.update(device_name=device_name or cap.device_name or data["device_name"],
                triton_version=cap.triton_version or data["triton_version"],
                tuned_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                tuner=_tuner_history(data["tuner"] if path.is_file() else "", tuner))
    out = tuning.TuningConfig.model_validate(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    out.save(path)
    return out


def _tuner_history(before: str, command: str) -> str:
    """The ``tuner`` field after ``command`` merged entries into a file whose field read ``before``: each command
    that wrote entries, in order, joined by "; " (a command already last in the list is not repeated)."""
    done = [_rerecorded(c.strip()) for c in before.split(";") if c.strip()]
    if not done or done[-1] != command:
        done.append(command)
    return "; ".join(done)


def _rerecorded(entry: str) -> str:
    """An entry of an existing file's ``tuner`` field as :func:`recorded_command` records it now (an older
    record may hold its ``--out`` folder)."""
    words = entry.split()
    head = COMMAND.split()
    return recorded_command(words[len(head):]) if words[:len(head)] == head else entry


def recorded_command(argv) -> str:
    """The command line as the tuning file records it: ``python -m hopperkern.tune`` with the arguments that chose
    what was tuned, without ``--out`` (where the file was written says nothing about its entries, and a machine's
    folder has no place in a shipped file)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return " ".join([COMMAND, *kept])


def _searched_by_default(folder: Path) -> bool:
    """Whether load_config finds ``<DEVICE_NAME>.json`` in ``folder`` without being told (a packaged folder, or
    the HOPPERKERN_CONFIG folder of this environment)."""
    folder = folder.resolve()
    env = os.environ.get("HOPPERKERN_CONFIG")
    dirs = [d.resolve() for d in tuning.packaged_config_dirs()] + ([Path(env).resolve()] if env else [])
    return folder in dirs


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a token count must be a positive integer, got {text!r}")
    return value


def main(argv=None) -> int:
    """``python -m hopperkern.tune``; returns the exit code (1 when there is no CUDA GPU to tune)."""
    # No abbreviated options: the file records the command line (recorded_command), which must recognise --out.
    ap = argparse.ArgumentParser(prog=COMMAND, description=_DESCRIPTION, epilog=_EPILOG, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("configs"),
                    help="folder of <DEVICE_NAME>.json; an existing file there is merged (default: ./configs)")
    ap.add_argument("--only", choices=("lce", "moe"), default=None, help="tune one kernel family only")
    ap.add_argument("--moe-shapes", nargs="+", choices=list(MOE_SHAPES), default=None, metavar="NAME",
                    help=f"MoE shapes to sweep (default: all of {', '.join(MOE_SHAPES)})")
    ap.add_argument("--moe-tokens", nargs="+", type=_positive, default=None, metavar="T",
                    help=f"MoE token buckets (default: {' '.join(map(str, MOE_BUCKETS))})")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="time budget of the MoE sweep in seconds; buckets not reached keep the heuristics")
    args = ap.parse_args(argv)

    from ..tma import capability

    cap = capability()
    if not cap.cuda_available or cap.interpreter or not cap.config_name:
        if cap.interpreter:
            why = "Triton's CPU interpreter is on (TRITON_INTERPRET): a tuner times compiled kernels"
        else:
            why = "; ".join(cap.reasons) or "no CUDA device"
        print(f"{COMMAND}: needs a CUDA GPU to time kernels on ({why}); see: python -m hopperkern.info",
              file=sys.stderr)
        return 1
    from .lce_tuner import tune_lce
    from .moe_tuner import tune_moe_default

    path = args.out / f"{cap.config_name}.json"
    t0 = time.time()
    lce = tune_lce() if args.only in (None, "lce") else None
    moe = None
    if args.only in (None, "moe"):
        moe = tune_moe_default(args.moe_shapes, args.moe_tokens or MOE_BUCKETS, time_budget_s=args.budget_s)
    merge_into_file(path, lce=lce, moe=moe, tuner=recorded_command(argv if argv is not None else sys.argv[1:]),
                    device_name=cap.device_name)
    print(f"{COMMAND}: wrote {path} in {time.time() - t0:.0f} s")
    if not _searched_by_default(args.out):
        print(f"hopperkern loads it where HOPPERKERN_CONFIG={args.out.resolve()} is set (a folder of "
              "<DEVICE_NAME>.json files); to ship it with hopperkern, add it to the configs/ folder of a checkout")
    return 0
