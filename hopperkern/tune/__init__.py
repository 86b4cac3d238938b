"""The tuner: ``python -m hopperkern.tune`` times launch configs on the current GPU and writes its tuning file.

    python -m hopperkern.tune [--out configs/] [--only lce|moe] [--moe-shapes NAME ...] [--moe-tokens T ...]
                              [--budget-s 240]

It writes ``<out>/<DEVICE_NAME>.json`` (see :mod:`hopperkern.tuning`), merged with the file already there:
entries not tuned in this run are kept. Every entry goes through the :mod:`hopperkern.tuning` models, so a
file the tuner writes always loads. A candidate config is timed only after its result matches an fp32 torch
reference (:func:`~hopperkern.tune.timing.rank_fastest`), so a config that miscomputes is never written. The
candidates of one choice are timed in rotated rounds after the GPU clock has settled, and compared within each
round, so a clock that drifts under load does not favour the first of them.

Modules: :mod:`~hopperkern.tune.lce_tuner` and :mod:`~hopperkern.tune.moe_tuner` (the sweeps),
:mod:`~hopperkern.tune.timing` (CUDA-event and CUDA-graph timing, shared with the benchmarks of a source
checkout), :mod:`~hopperkern.tune.shapes` (the model shapes), :mod:`~hopperkern.tune.cli` (the command and the
file writer). Importing any of them touches no GPU and compiles nothing.
"""

from .cli import main, merge_into_file
from .timing import capture_graph, graph_ms, pick_fastest, rank_fastest, rel_err, time_cuda

__all__ = ["capture_graph", "graph_ms", "main", "merge_into_file", "pick_fastest", "rank_fastest", "rel_err",
           "time_cuda"]
