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
    monkeypatch.setattr(moe_tuner, "fused_mlp_candidates", lambda slots, I: [])
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


@pytest.mark.parametrize("faster", [True, False], ids=["new forms faster", "slower, or below SORTED_ROWS_MIN_T"])
def test_moe_tuner_weighs_fused_mlp_and_sorted_rows_end_to_end(faster, monkeypatch):
    """A direct-plan bucket (1 token) also times ``MoeConfig.fused_mlp`` candidates end to end (checked against the
    reference like every candidate) and takes one where it is fastest. From SORTED_ROWS_MIN_T tokens each
    sorted-plan finalist also runs with sorted_rows (and wins here, timed faster); below it no sorted-rows config is
    timed at all. A sorted bucket never tries fused_mlp."""
    import torch

    import hopperkern.moe as moe_pkg
    from hopperkern.tune import moe_tuner

    def tiny(block_m, gemm):
        return [KernelConfig(block_m=block_m, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=1)]

    g1 = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=1)
    g2 = KernelConfig(block_m=16, block_n=32, block_k=16, group_m=1, num_warps=4, num_stages=1)
    seen, real_fused = {}, moe_pkg.fused_moe

    def fused_moe(*args, config=None, **kw):
        seen["form"] = "mlp" if config.fused_mlp else "sorted" if config.sorted_rows else "plain"
        return real_fused(*args, config=config, **kw)

    def timer(fn):
        seen["form"] = None  # a GEMM timed alone
        fn()
        new = 0.5 if faster else 3.0
        return {None: 1.0, "plain": 2.0, "mlp": new, "sorted": new}[seen["form"]]

    monkeypatch.setattr(moe_tuner, "candidates", tiny)
    monkeypatch.setattr(moe_tuner, "fused_candidates", lambda bm: [])
    monkeypatch.setattr(moe_tuner, "fused_mlp_candidates",
                        lambda slots, I: [MoeConfig(gemm1=g1, gemm2=g2, fused_mlp=True)])
    monkeypatch.setattr(moe_pkg, "fused_moe", fused_moe)
    if faster:
        monkeypatch.setattr(moe_tuner, "SORTED_ROWS_MIN_T", 8)
    logs = []
    found = moe_tuner.tune_moe([(4, 64, 32, 2)], (1, 8), torch.float32, log=logs.append, device="cpu", time_fn=timer)
    entries = found["E4_H64_I32_float32"]
    assert entries["1"].fused_mlp is faster and not entries["1"].sorted_rows, logs
    assert any(m.strip().startswith("fused mlp") and "us" in m for m in logs), logs
    tried = any("'sorted_rows': True" in m for m in logs if m.lstrip().startswith("fused_moe"))
    assert entries["8"].sorted_rows is tried is faster and not entries["8"].fused_mlp, logs
