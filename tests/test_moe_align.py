"""Invariants of the MoE alignment plan (hopperkern.moe.align), separate from the GEMM tests."""

from dataclasses import dataclass

import pytest
import torch

from hopperkern.moe import max_blocks_for, moe_align


def check_plan(ids: torch.Tensor, E: int, block_m: int):
    """Every real slot exactly once, grouped by expert in slot order; each expert's segment padded to block_m
    with the sentinel; block experts consistent with the offsets; -1 / out-of-range slots dropped."""
    plan = moe_align(ids, E, block_m)
    T, k = ids.shape
    flat = ids.reshape(-1).long().cpu()
    valid = (flat >= 0) & (flat < E)
    counts = torch.bincount(flat[valid], minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)])
    npad = int(offsets[-1])
    nb = npad // block_m

    assert plan.num_slots == T * k and plan.sentinel == T * k and plan.block_m == block_m
    assert plan.max_blocks == max_blocks_for(T * k, E, block_m) >= nb
    assert int(plan.num_blocks.cpu()) == nb
    assert torch.equal(plan.expert_counts.long().cpu(), counts)
    assert torch.equal(plan.expert_offsets.long().cpu(), offsets)

    rows = plan.sorted_slots[:npad].long().cpu()
    row_expert = torch.repeat_interleave(torch.arange(E), padded)
    real = (torch.arange(npad) - offsets[row_expert]) < counts[row_expert]  # real rows lead each segment
    assert torch.equal(rows < T * k, real), "padding rows must hold the sentinel, real rows a slot"
    assert (rows[~real] == T * k).all()
    # Real rows = valid slots ordered by (expert, slot): each exactly once, deterministic order.
    order = torch.nonzero(valid).flatten()
    order = order[torch.sort(flat[order], stable=True).indices]
    assert torch.equal(rows[real], order)

    be = plan.block_expert.long().cpu()
    assert torch.equal(be[:nb], row_expert[::block_m])
    assert (be[nb:] == -1).all()
    return plan


@dataclass
class Case:
    T: int
    k: int
    E: int
    block_m: int
    why: str
    fill: str = "random"  # random | one_expert | permutation | sparse


CASES = [
    Case(1, 1, 8, 16, "T=1, k=1: one slot"),
    Case(1, 8, 256, 16, "decode: T=1, k=8 of 256 experts (most experts empty)"),
    Case(3, 2, 64, 16, "empty experts everywhere"),
    Case(100, 1, 8, 32, "all tokens on one expert: several blocks of one expert", "one_expert"),
    Case(37, 3, 13, 16, "prime E, T < block_m"),
    Case(50, 4, 300, 32, "E = 300 (histogram wider than 256)"),
    Case(5, 16, 16, 16, "top-k = E: every token on every expert", "permutation"),
    Case(200, 4, 16, 64, "-1 slots dropped (about half)", "sparse"),
    Case(128, 8, 1000, 16, "one-launch path with many programs: several scatter sub-blocks and block tiles"),
    Case(256, 8, 128, 16, "one-launch path at its limit (T*k = 2048 = _SMALL_MAX_SLOTS)"),
    Case(257, 8, 128, 16, "multi-chunk path just past it (T*k = 2056)"),
    Case(256, 8, 600, 16, "2048 slots over 600 experts (1024-bin histogram): the multi-chunk path"),
    Case(400, 8, 64, 128, "multi-chunk path (T*k = 3200), block_m 128"),
    Case(2000, 3, 600, 16, "multi-chunk path, E=600 (E_P=1024: several scatter steps per chunk)"),
    Case(70000, 1, 16, 64, "T = 70000: beyond 64k tokens"),
]


def _ids(case: Case, gen: torch.Generator, device) -> torch.Tensor:
    T, k, E = case.T, case.k, case.E
    if case.fill == "one_expert":
        ids = torch.full((T, k), 5, dtype=torch.int32)
    elif case.fill == "permutation":
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    else:
        ids = torch.randint(0, E, (T, k), generator=gen, dtype=torch.int32)
        if case.fill == "sparse":
            ids[torch.rand((T, k), generator=gen) < 0.5] = -1
    return ids.to(device)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.why)
def test_plan_invariants(case, device):
    gen = torch.Generator().manual_seed(case.T * 31 + case.E)
    check_plan(_ids(case, gen, device), case.E, case.block_m)


@pytest.mark.parametrize("slots, E, one", [(2048, 128, True), (2049, 128, False), (2048, 511, True),
                                           (2048, 512, False), (1024, 2000, True), (1025, 2000, False)])
def test_one_launch_limit(slots, E, one):
    """One launch up to 2048 slots while the histogram (E + 1 bins as a power of two) has at most 512 bins, up to
    1024 slots with a wider one; the plan's scratch and its launches agree on it."""
    from hopperkern.moe import align

    assert align._one_launch(slots, E) is one
    assert (align.scratch_shapes(slots, E) == {}) is one
    env = dict(ids=None, sorted_slots=None, block_expert=None, expert_offsets=None, expert_counts=None,
               num_blocks=None, chunk_counts=None, base=None)
    steps = align.align_steps(env, slots, E, 16, align.max_blocks_for(slots, E, 16))
    assert len(steps) == (1 if one else 3)


@pytest.mark.parametrize("block_m", [16, 64])
def test_plan_int64_and_noncontiguous_ids(block_m, device):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(-1, 9, (4, 30), generator=gen, dtype=torch.int64).to(device).T  # [30, 4], strided
    assert not ids.is_contiguous()
    check_plan(ids, 9, block_m)


def test_out_of_range_ids_are_dropped(device):
    """With check_ids=False, fused_moe relies on the plan dropping ids outside [-1, E) instead of reading
    out of bounds."""
    ids = torch.tensor([[0, 7], [-3, 2], [100, 1]], dtype=torch.int32, device=device)
    plan = check_plan(ids, 4, 16)
    assert int(plan.expert_counts.sum()) == 3


@pytest.mark.parametrize("T, k", [(3, 2), (600, 4)], ids=["one-launch", "multi-chunk"])
def test_int64_ids_beyond_int32_are_dropped(T, k, device):
    """int64 ids are range-checked before the kernels narrow them to int32: 2**32 + 1 is dropped, not expert 1
    (and -2**32 + 2 not expert 2); both the one-launch and the multi-chunk kernels."""
    gen = torch.Generator().manual_seed(T)
    ids = torch.randint(0, 4, (T, k), generator=gen, dtype=torch.int64)
    ids[0, 0], ids[1, 1], ids[-1, 0] = 2**32 + 1, -2**32 + 2, 2**33
    plan = check_plan(ids.to(device), 4, 16)
    assert int(plan.expert_counts.sum()) == T * k - 3


def test_all_slots_dropped(device):
    ids = torch.full((6, 2), -1, dtype=torch.int32, device=device)
    plan = check_plan(ids, 4, 16)
    assert int(plan.num_blocks.cpu()) == 0 and (plan.block_expert.cpu() == -1).all()


def test_zero_tokens(device):
    plan = moe_align(torch.empty((0, 4), dtype=torch.int32, device=device), 8, 16)
    assert plan.max_blocks == 0 and int(plan.num_blocks.cpu()) == 0
    assert plan.expert_offsets.cpu().tolist() == [0] * 9


@pytest.mark.parametrize("bad, exc, match", [
    (dict(block_m=24), ValueError, "block_m must be a power of two >= 16, got 24"),
    (dict(block_m=8), ValueError, "block_m must be a power of two >= 16, got 8"),
    (dict(num_experts=0), ValueError, "num_experts must be >= 1, got 0"),
    (dict(ids=torch.zeros(4, dtype=torch.int32)), ValueError, r"topk_ids must be 2-D, got shape \(4,\)"),
    (dict(ids=torch.zeros((2, 2))), TypeError, "topk_ids must be int32 or int64, got float32"),
])
def test_align_errors(bad, exc, match):
    args = dict(ids=torch.zeros((2, 2), dtype=torch.int32), num_experts=4, block_m=16) | bad
    with pytest.raises(exc, match=match):
        moe_align(args["ids"], args["num_experts"], args["block_m"])


@pytest.mark.gpu
@pytest.mark.parametrize("T, k, E, block_m", [(1, 8, 256, 16), (64, 8, 128, 16), (256, 8, 128, 32), (16384, 8, 256, 128),
                                               (65536, 8, 128, 64), (262144, 2, 8, 128)])
def test_plan_invariants_gpu(T, k, E, block_m):
    gen = torch.Generator().manual_seed(T)
    ids = torch.randint(-1, E, (T, k), generator=gen, dtype=torch.int32).cuda()
    check_plan(ids, E, block_m)


@pytest.mark.parametrize("programs", [2, 16])
def test_scatter_programs_take_several_sub_blocks(programs, device, monkeypatch):
    """Large batches give each scatter program several consecutive sub-blocks (SUBS > 1); forced here on a
    small batch by capping the scatter's programs: 6 chunks of 16 sub-blocks, each program taking 16 or 8."""
    from hopperkern.moe import align

    monkeypatch.setattr(align, "_SCATTER_PROGRAMS", programs)
    gen = torch.Generator().manual_seed(programs)
    ids = torch.randint(-1, 600, (2000, 3), generator=gen, dtype=torch.int32).to(device)
    check_plan(ids, 600, 16)
