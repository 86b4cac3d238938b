"""The tuner (hopperkern.tune): candidate selection, candidate lists, both sweeps under the interpreter, the file
writer and the command line, without a GPU."""

import math

import pytest

from hopperkern.tune import pick_fastest, rel_err
from hopperkern.tuning import KernelConfig, MoeConfig


def _cfg(bn):
    return KernelConfig(block_m=16, block_n=bn, block_k=32, group_m=1, num_warps=4, num_stages=2)


def test_pick_fastest_skips_failing_and_wrong_candidates():
    """The fastest candidate computes a wrong result and another raises: the winner is the fastest correct one,
    and both rejects are logged with the reason."""
    speed = {16: 3.0, 32: 1.0, 64: 2.0, 128: 0.5}
    last = {}

    def run(cfg):
        if cfg.block_n == 128:
            raise RuntimeError("out of resource: shared memory")
        last["bn"] = cfg.block_n

    def timer(fn):
        fn()
        return speed[last["bn"]]

    logs = []
    best = pick_fastest([_cfg(b) for b in (16, 32, 64, 128)], run, timer, log=logs.append, what="t",
                        check=lambda cfg: 0.5 if cfg.block_n == 32 else 1e-3, tol=2e-2)
    assert best == (2.0, _cfg(64))
    assert any("skipped: error 0.5" in m and "'block_n': 32" in m for m in logs)
    assert any("skipped: RuntimeError: out of resource" in m and "'block_n': 128" in m for m in logs)


def test_pick_fastest_rejects_nan_and_returns_none_when_nothing_is_left():
    best = pick_fastest([_cfg(16)], lambda cfg: None, lambda fn: 1.0, log=lambda m: None,
                        check=lambda cfg: math.nan)
    assert best is None


def _drifting(speed: dict, factor):
    """run and timer of candidates whose time is ``speed[block_n] * factor(number of runs so far)``, and the
    order in which the timer saw them."""
    state = {"runs": 0, "bn": None}
    order = []

    def run(cfg):
        state["runs"] += 1
        state["bn"] = cfg.block_n

    def timer(fn):
        fn()
        order.append(state["bn"])
        return speed[state["bn"]] * factor(state["runs"])

    return run, timer, order


def test_pick_fastest_rotates_the_timing_order_over_rounds():
    """Three rounds over three candidates: each candidate is timed once per round and takes each place once."""
    run, timer, order = _drifting({16: 1.0, 32: 1.0, 64: 1.0}, lambda n: 1.0)
    pick_fastest([_cfg(b) for b in (16, 32, 64)], run, timer, log=lambda m: None, rounds=3)
    rounds = [order[i:i + 3] for i in range(0, 9, 3)]
    assert all(sorted(r) == [16, 32, 64] for r in rounds)
    assert all(sorted(r[place] for r in rounds) == [16, 32, 64] for place in range(3))


def test_pick_fastest_settles_the_clock_before_timing():
    """A GPU that runs 10 % faster for its first calls (a boost clock): timed at once, the first candidate wins
    on the boost; after the settling calls the truly fastest one does."""
    speed = {16: 1.0, 32: 1.0, 64: 0.97}
    boost = lambda runs: 0.9 if runs <= 5 else 1.0  # noqa: E731
    cands = [_cfg(b) for b in (16, 32, 64)]
    run, timer, _ = _drifting(speed, boost)
    assert pick_fastest(cands, run, timer, log=lambda m: None, rounds=1)[1] == _cfg(16)
    run, timer, _ = _drifting(speed, boost)
    assert pick_fastest(cands, run, timer, log=lambda m: None, rounds=3, settle_s=0.01) == (0.97, _cfg(64))


def test_pick_fastest_ranks_by_the_median_round():
    """One slow outlier round does not cost the fastest candidate its place; the log lists every round."""
    calls = {"n": 0}
    run, timer, _ = _drifting({16: 1.0, 32: 0.9}, lambda n: 1.0)

    def spiky(fn):
        calls["n"] += 1
        return timer(fn) * (3.0 if calls["n"] == 2 else 1.0)  # the first round's second sample: 32's

    logs = []
    assert pick_fastest([_cfg(16), _cfg(32)], run, spiky, log=logs.append, rounds=3) == (0.9, _cfg(32))
    assert any("rounds 2700.0, 900.0, 900.0" in m for m in logs)
    with pytest.raises(ValueError, match="rounds"):
        pick_fastest([_cfg(16)], run, timer, rounds=0)


def test_pick_fastest_compares_candidates_within_each_round():
    """The clock drops between rounds (levels 1, 1.3, 1.6) and the truly fastest candidate (32) meets
    interference in one round: ranked by their absolute medians, 16 would win; against each round's median, 32
    does, and its median time is what comes back."""
    true, level = {16: 1.0, 32: 0.98, 64: 1.05}, (1.0, 1.3, 1.6)
    state = {"calls": 0, "bn": None}

    def run(cfg):
        state["bn"] = cfg.block_n

    def timer(fn):
        fn()
        r = state["calls"] // 3
        state["calls"] += 1
        return true[state["bn"]] * level[r] * (1.5 if (r, state["bn"]) == (1, 32) else 1.0)

    ms, cfg = pick_fastest([_cfg(b) for b in (16, 32, 64)], run, timer, log=lambda m: None, rounds=3)
    assert cfg == _cfg(32)
    assert ms == pytest.approx(0.98 * 1.6)


def test_pick_fastest_survives_a_failed_settle_and_zero_rounds(monkeypatch):
    """The settling calls raise (the candidate is kept: it runs in the rounds); a round whose times are all 0
    (a graph time clamped at its baseline) ranks nobody, and the other rounds decide."""
    import hopperkern.tune.timing as timing

    state = {"bn": None, "calls": 0}

    def run(cfg):
        state["bn"] = cfg.block_n

    def timer(fn):
        fn()
        state["calls"] += 1
        return {16: 1.0, 32: 0.9}[state["bn"]] * (0.0 if state["calls"] <= 2 else 1.0)

    def failing(fn, seconds):
        raise RuntimeError("launch failed while settling")

    monkeypatch.setattr(timing, "_settle", failing)
    logs = []
    best = pick_fastest([_cfg(16), _cfg(32)], run, timer, log=logs.append, rounds=3, settle_s=1.0)
    assert any("settling" in m and "RuntimeError" in m for m in logs)
    assert best == (0.9, _cfg(32))


def test_rel_err_is_inf_for_non_finite_outputs():
    import torch

    ref = torch.ones(4)
    assert rel_err(ref * 1.01, ref) == pytest.approx(0.01)
    assert rel_err(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref) == math.inf


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
@pytest.mark.parametrize("gemm", [1, 2])
def test_moe_candidates_fit_shared_memory_and_keep_block_m(block_m, gemm):
    from hopperkern.tune.moe_tuner import candidates, fused_candidates

    cands = candidates(block_m, gemm) + (fused_candidates(block_m) if gemm == 2 else [])
    assert cands and all(c.block_m == block_m for c in cands)
    ops = 2 if gemm == 1 else 1
    for c in cands:
        smem = c.num_stages * (c.block_m + ops * c.block_n) * c.block_k * 2
        assert smem <= 227 * 1024, c


def test_moe_block_m_choices_cover_the_heuristic():
    from hopperkern.tune.moe_tuner import block_m_choices
    from hopperkern.moe.configs import pick_block_m

    for T in (1, 16, 64, 256, 1024, 4096, 16384):
        for E, k in ((128, 8), (256, 8), (8, 2), (128, 4)):
            choices = block_m_choices(T, k, E)
            assert choices[0] == pick_block_m(T, k, E) and len(set(choices)) == len(choices)


def _no_time(fn):
    fn()
    return 1.0


def test_lce_tuner_loop_checks_candidates_against_its_reference(monkeypatch):
    """The LCE tuner's whole loop under the interpreter (tiny shape, fp32). Its torch reference (LSE, and
    d_hidden of sum(g * logprob)) accepts the kernels' results, so both phases get an entry. A candidate that
    raises and one whose forward result is wrong (simulated around the real launcher) are skipped."""
    import torch

    from hopperkern.tune import lce_tuner
    from hopperkern.lce import launch

    good = KernelConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)
    boom = KernelConfig(block_m=16, block_n=64, block_k=32, group_m=2, num_warps=4, num_stages=1)
    wrong = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=1)
    real = launch.lce_forward

    def forward(*args, config=None, **kw):
        if config == boom:
            raise RuntimeError("out of resource: shared memory")
        out = real(*args, config=config, **kw)
        return (*out[:3], out[3] + 0.01) if config == wrong else out

    monkeypatch.setattr(launch, "lce_forward", forward)
    logs, result = [], {}
    lce_tuner._tune_lce_shape(64, 300, torch.float32, (40,), result, logs.append, device="cpu", time_fn=_no_time,
                         candidates=[wrong, boom, good])
    assert result["forward:float32:H64"]["40"] == good, logs
    assert "backward:float32:H64" in result, logs
    assert any("skipped: error" in m and "'block_n': 16" in m for m in logs), logs
    assert any("skipped: RuntimeError" in m and "'block_n': 64" in m for m in logs), logs


def test_moe_tuner_loop_checks_candidates_against_its_reference(monkeypatch):
    """The MoE tuner's whole loop under the interpreter (tiny shape, fp32): a direct-plan bucket (T=1, with the
    fused top-k candidates) and a sorted one. The real kernels pass the fp32 reference check; a down-GEMM
    candidate whose result is wrong (simulated around the real launcher) is skipped."""
    import torch

    import hopperkern.moe as moe_pkg
    from hopperkern.tune import moe_tuner

    def tiny(block_m, gemm):
        return [KernelConfig(block_m=block_m, block_n=bn, block_k=32, group_m=1, num_warps=4, num_stages=1)
                for bn in (16, 32)]

    real_down = moe_pkg.down

    def down(*args, config=None, fused_topk=False, **kw):
        out = real_down(*args, config=config, fused_topk=fused_topk, **kw)
        return out * 1.5 if (config.block_n == 32 and not fused_topk) else out

    monkeypatch.setattr(moe_tuner, "candidates", tiny)
    monkeypatch.setattr(moe_tuner, "fused_candidates", lambda bm: tiny(bm, 2)[:1])
    monkeypatch.setattr(moe_pkg, "down", down)
    logs = []
    found = moe_tuner.tune_moe([(4, 64, 32, 2)], (1, 8), torch.float32, log=logs.append, device="cpu",
                              time_fn=_no_time)
    entries = found["E4_H64_I32_float32"]
    assert set(entries) == {"1", "8"}, logs
    rejected = [m for m in logs if "skipped" in m]
    assert rejected and all("gemm2 {" in m and "'block_n': 32" in m and "skipped: error" in m
                            for m in rejected), rejected
    assert all(e.gemm2.block_n == 16 or e.fused_topk for e in entries.values())


def test_moe_tuner_skips_down_configs_whose_atomic_variant_fails(monkeypatch):
    """fused_moe(deterministic=False) runs a sorted plan's down config with the atomic epilogue, which needs
    other resources, on direct and sorted plans: a candidate whose atomic variant cannot launch (simulated:
    shared memory) never wins, even when its deterministic variant is right and fastest."""
    import torch

    import hopperkern.moe as moe_pkg
    from hopperkern.tune import moe_tuner

    def tiny(block_m, gemm):
        return [KernelConfig(block_m=block_m, block_n=bn, block_k=32, group_m=1, num_warps=4, num_stages=1)
                for bn in (32, 16)]

    real_down = moe_pkg.down

    def down(*args, config=None, deterministic=True, **kw):
        if config.block_n == 32 and not deterministic:
            raise RuntimeError("out of resource: shared memory (atomic epilogue)")
        return real_down(*args, config=config, deterministic=deterministic, **kw)

    monkeypatch.setattr(moe_tuner, "candidates", tiny)
    monkeypatch.setattr(moe_tuner, "fused_candidates", lambda bm: [])  # the direct bucket takes the slot kernel
    monkeypatch.setattr(moe_pkg, "down", down)
    logs = []
    found = moe_tuner.tune_moe([(4, 64, 32, 2)], (1, 8), torch.float32, log=logs.append, device="cpu",
                              time_fn=_no_time)
    entries = found["E4_H64_I32_float32"]
    assert set(entries) == {"1", "8"}, logs  # a direct plan (T=1) and a sorted one
    assert all(e.gemm2.block_n == 16 and not e.fused_topk for e in entries.values()), logs
    assert any("gemm2 {" in m and "'block_n': 32" in m and "skipped: RuntimeError" in m for m in logs), logs


def test_moe_tuner_times_the_runner_up_down_config_end_to_end(monkeypatch):
    """The two fastest down configs of a block_m both run end to end: a down config that is second when timed
    alone but first behind the gate/up GEMM wins (with only the fastest one going on it could not)."""
    import torch

    import hopperkern.moe as moe_pkg
    from hopperkern.tune import moe_tuner

    def tiny(block_m, gemm):
        return [KernelConfig(block_m=block_m, block_n=bn, block_k=32, group_m=1, num_warps=4, num_stages=1)
                for bn in (16, 32, 64)]

    seen = {}
    real_down, real_fused = moe_pkg.down, moe_pkg.fused_moe

    def down(*args, config=None, **kw):
        seen["last"] = ("down", config.block_n)
        return real_down(*args, config=config, **kw)

    def fused_moe(*args, config=None, **kw):
        out = real_fused(*args, config=config, **kw)
        seen["last"] = ("fused_moe", config.gemm2.block_n)
        return out

    alone = {16: 1.0, 32: 2.0, 64: 3.0}  # down GEMM timed alone: 16, then 32, then 64
    behind = {16: 2.0, 32: 1.0, 64: 0.5}  # end to end: 64 would be fastest, but it ranks third alone

    def timer(fn):
        seen["last"] = None
        fn()
        kind, bn = seen["last"] or ("gate_up", 0)
        return {"down": alone, "fused_moe": behind}.get(kind, {0: 1.0}).get(bn, 1.0)

    monkeypatch.setattr(moe_tuner, "candidates", tiny)
    monkeypatch.setattr(moe_pkg, "down", down)
    monkeypatch.setattr(moe_pkg, "fused_moe", fused_moe)
    logs = []
    found = moe_tuner.tune_moe([(4, 64, 32, 2)], (8,), torch.float32, log=logs.append, device="cpu", time_fn=timer)
    assert found["E4_H64_I32_float32"]["8"].gemm2.block_n == 32, logs
    assert not any("'block_n': 64" in m for m in logs if m.lstrip().startswith("fused_moe")), logs


@pytest.mark.parametrize("min_t", [8, None], ids=["sorted rows tried", "below SORTED_ROWS_MIN_T"])
def test_moe_tuner_weighs_sorted_rows_end_to_end(min_t, monkeypatch):
    """From SORTED_ROWS_MIN_T tokens each sorted-plan finalist also runs end to end with sorted_rows (and wins
    here, timed faster); below it no sorted-rows config is timed at all."""
    import torch

    import hopperkern.moe as moe_pkg
    from hopperkern.tune import moe_tuner

    def tiny(block_m, gemm):
        return [KernelConfig(block_m=block_m, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=1)]

    seen, real_fused = {}, moe_pkg.fused_moe

    def fused_moe(*args, config=None, **kw):
        seen["sorted"] = config.sorted_rows
        return real_fused(*args, config=config, **kw)

    def timer(fn):
        seen["sorted"] = None
        fn()
        return {None: 1.0, False: 2.0, True: 1.5}[seen["sorted"]]

    monkeypatch.setattr(moe_tuner, "candidates", tiny)
    monkeypatch.setattr(moe_pkg, "fused_moe", fused_moe)
    if min_t is not None:
        monkeypatch.setattr(moe_tuner, "SORTED_ROWS_MIN_T", min_t)
    logs = []
    found = moe_tuner.tune_moe([(4, 64, 32, 2)], (8,), torch.float32, log=logs.append, device="cpu", time_fn=timer)
    tried = any("'sorted_rows': True" in m for m in logs if m.lstrip().startswith("fused_moe"))
    assert found["E4_H64_I32_float32"]["8"].sorted_rows is tried is (min_t is not None), logs


def test_moe_final_pick_keeps_the_config_in_use_unless_beaten():
    """The per-block_m winners run end to end beside the config in use: the fastest of them wins (the one in use
    too), a wrong one never does, and a lone finalist is taken without timing."""
    from hopperkern.tune.moe_tuner import _final_pick
    from hopperkern.tuning import MoeConfig

    def mc(bm, bn):
        k = KernelConfig(block_m=bm, block_n=bn, block_k=32, group_m=1, num_warps=4, num_stages=2)
        return MoeConfig(gemm1=k, gemm2=k)

    a, b, current = mc(16, 32), mc(32, 32), mc(16, 64)
    last = {}

    def run(cfg):
        last["cfg"] = cfg

    def timer_for(speeds):
        def timer(fn):
            fn()
            return speeds[last["cfg"]]
        return timer

    def err(out):
        return 0.0

    finalists = [(1.0, a), (1.1, b)]
    quiet = lambda m: None  # noqa: E731
    assert _final_pick(finalists, current, run, lambda o: 0.0, timer_for({a: 1.0, b: 1.1, current: 0.9}), 0.0,
                       quiet) == (0.9, current)
    assert _final_pick(finalists, current, run, lambda o: 0.0, timer_for({a: 1.0, b: 0.8, current: 0.9}), 0.0,
                       quiet) == (0.8, b)
    assert _final_pick(finalists, a, run, lambda o: 0.0, timer_for({a: 1.0, b: 0.8}), 0.0, quiet) == (0.8, b)
    wrong = {"cfg": b}

    def run_checked(cfg):
        last["cfg"] = cfg
        return cfg

    got = _final_pick(finalists, None, run_checked, lambda out: 1.0 if out == wrong["cfg"] else 0.0,
                      timer_for({a: 1.0, b: 0.8}), 0.0, quiet)
    assert got == (1.0, a)
    assert _final_pick([(2.0, a)], None, run, err, timer_for({}), 0.0, quiet) == (2.0, a)
    assert _final_pick([(2.0, a)], a, run, err, timer_for({}), 0.0, quiet) == (2.0, a)
    assert _final_pick([], None, run, err, timer_for({}), 0.0, quiet) is None
    assert _final_pick([], current, run, err, timer_for({current: 1.0}), 0.0, quiet) is None  # nothing new passed


def test_in_use_is_none_under_the_interpreter():
    """Both tuners time the config in use beside their candidates on a GPU; under the interpreter there is none."""
    import torch

    from hopperkern.tune import lce_tuner, moe_tuner

    assert moe_tuner.in_use(4, 64, 32, torch.float32, 8, 2, torch.device("cpu")) is None
    assert lce_tuner.in_use("forward", torch.float32, 40, 64, torch.device("cpu")) is None


def test_merge_into_file_keeps_other_entries(tmp_path, monkeypatch):
    """The one writer of tuning files: new buckets merge into the existing file, every other entry and section
    is kept, the device and Triton version are stamped, and the file is written in canonical order and loads
    through the lookup by device name."""
    import triton

    from hopperkern import tuning
    from hopperkern.tune import merge_into_file
    from hopperkern.tuning import MoeConfig

    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    path = tmp_path / "Test_GPU.json"
    k = KernelConfig(block_m=16, block_n=32, block_k=64, group_m=1, num_warps=4, num_stages=3)
    merge_into_file(path, lce={"forward:bfloat16:H64": {"2048": k}}, device_name="Test GPU")
    merge_into_file(path, moe={"E4_H64_I32_bfloat16": {"1": MoeConfig(gemm1=k, gemm2=k, fused_topk=True)}},
                    tuner="python -m hopperkern.tune --only moe", device_name="Test GPU")
    merge_into_file(path, lce={"forward:bfloat16:H64": {"16384": k}}, device_name="Test GPU")
    cfg = tuning.load_config("Test GPU")
    assert cfg.origin == str(path) and (cfg.device_name, cfg.triton_version) == ("Test GPU", triton.__version__)
    assert list(cfg.lce["forward:bfloat16:H64"]) == ["2048", "16384"]
    assert cfg.moe["E4_H64_I32_bfloat16"]["1"].fused_topk
    # Every command that wrote entries, in order.
    assert cfg.tuner == ("python -m hopperkern.tune; python -m hopperkern.tune --only moe; python -m hopperkern.tune")
    assert path.read_text() == cfg.canonical_json()
    merge_into_file(path, lce={"forward:bfloat16:H64": {"2048": k}}, device_name="Test GPU")
    assert tuning.load_config(path).tuner == cfg.tuner  # the last command is not repeated


def test_recorded_command_leaves_out_the_output_folder():
    from hopperkern.tune import cli

    assert cli.recorded_command(["--only", "moe", "--out", "/some/folder", "--budget-s", "60"]) == (
        "python -m hopperkern.tune --only moe --budget-s 60")
    assert cli.recorded_command(["--out=/x", "--only", "lce"]) == "python -m hopperkern.tune --only lce"
    assert cli.recorded_command([]) == "python -m hopperkern.tune"
    # An older record's folder goes when the file is merged into; the command line takes no abbreviated --out.
    before = "python -m hopperkern.tune --out /some/folder --only lce"
    assert cli._tuner_history(before, "python -m hopperkern.tune") == (
        "python -m hopperkern.tune --only lce; python -m hopperkern.tune")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--ou", "/some/folder"])
    assert exc.value.code == 2


def test_command_line_help_and_no_gpu(capsys):
    """`python -m hopperkern.tune` is the installed command: --help works anywhere, and without a GPU it says
    why it cannot tune (exit code 1) instead of failing inside a kernel."""
    import subprocess
    import sys

    import torch

    from hopperkern import tune

    with pytest.raises(SystemExit) as exc:
        tune.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m hopperkern.tune") and "--moe-shapes" in out and "NVIDIA_H200.json" in out
    with pytest.raises(SystemExit) as exc:
        tune.main(["--moe-tokens", "0"])
    assert exc.value.code == 2
    assert "argument --moe-tokens: a token count must be a positive integer, got '0'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert tune.main([]) == 1
        err = capsys.readouterr().err
        assert err.startswith("python -m hopperkern.tune: needs a CUDA GPU to time kernels on (")
        assert err.rstrip().endswith("see: python -m hopperkern.info")
    run = subprocess.run([sys.executable, "-m", "hopperkern.tune", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage: python -m hopperkern.tune"), run.stderr


def test_importing_the_tuner_touches_no_gpu():
    """Importing hopperkern.tune initialises no CUDA context, imports neither Triton nor a kernel module, and so
    compiles nothing."""
    import subprocess
    import sys

    code = ("import sys, torch, hopperkern.tune, hopperkern.tune.lce_tuner, hopperkern.tune.moe_tuner; "
            "print(torch.cuda.is_initialized(), 'triton' in sys.modules, "
            "any(m.startswith(('hopperkern.lce', 'hopperkern.moe')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]


def test_rank_fastest_orders_valid_candidates_and_pick_takes_the_first():
    """rank_fastest: every candidate that runs and checks out, fastest first (ties in the given order); failing and
    wrong ones are left out; pick_fastest is its first entry."""
    from hopperkern.tune import rank_fastest

    speed = {16: 3.0, 32: 1.0, 64: 2.0, 128: 1.0, 256: 0.5}
    current = {}

    def run(cfg):
        current["cfg"] = cfg
        if cfg.block_n == 256:
            raise RuntimeError("out of resource: shared memory")

    def timer(fn):
        fn()
        return speed[current["cfg"].block_n]

    def check(cfg):
        return 1.0 if cfg.block_n == 64 else 0.0  # 64 computes the wrong thing

    cands = [_cfg(b) for b in (16, 32, 64, 128, 256)]
    ranked = rank_fastest(cands, run, timer, log=lambda m: None, check=check)
    assert [cfg.block_n for _, cfg in ranked] == [32, 128, 16]
    assert [ms for ms, _ in ranked] == [1.0, 1.0, 3.0]
    assert pick_fastest(cands, run, timer, log=lambda m: None, check=check) == ranked[0]
    assert rank_fastest([_cfg(256)], run, timer, log=lambda m: None) == []


@pytest.mark.parametrize("mlp_ms", [0.5, 3.0], ids=["fused mlp faster", "fused mlp slower"])
def test_moe_tuner_weighs_the_fused_mlp_on_direct_plans(mlp_ms, monkeypatch):
    """A direct-plan bucket (T=1) also times ``MoeConfig.fused_mlp`` candidates end to end (checked against the
    reference like every candidate) and takes one where it is fastest; a sorted bucket never tries them."""
    import torch

    import hopperkern.moe as moe_pkg
    from hopperkern.tune import moe_tuner

    def tiny(block_m, gemm):
        return [KernelConfig(block_m=block_m, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=1)]

    g1 = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=1)
    g2 = KernelConfig(block_m=16, block_n=32, block_k=16, group_m=1, num_warps=4, num_stages=1)
    mlp = MoeConfig(gemm1=g1, gemm2=g2, fused_mlp=True)
    seen, real_fused = {}, moe_pkg.fused_moe

    def fused_moe(*args, config=None, **kw):
        seen["mlp"] = config.fused_mlp
        return real_fused(*args, config=config, **kw)

    def timer(fn):
        seen["mlp"] = None
        fn()
        return {None: 1.0, False: 2.0, True: mlp_ms}[seen["mlp"]]

    monkeypatch.setattr(moe_tuner, "candidates", tiny)
    monkeypatch.setattr(moe_tuner, "fused_candidates", lambda bm: [])
    monkeypatch.setattr(moe_tuner, "fused_mlp_candidates", lambda slots, I: [mlp])
    monkeypatch.setattr(moe_pkg, "fused_moe", fused_moe)
    logs = []
    found = moe_tuner.tune_moe([(4, 64, 32, 2)], (1, 8), torch.float32, log=logs.append, device="cpu", time_fn=timer)
    entries = found["E4_H64_I32_float32"]
    assert entries["1"].fused_mlp is (mlp_ms < 2.0), logs
    assert not entries["8"].fused_mlp
    assert any(m.strip().startswith("fused mlp") and "us" in m for m in logs), logs
