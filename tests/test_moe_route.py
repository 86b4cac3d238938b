"""moe.route against a per-token Python reference with explicit tie-breaking (lower index wins)."""

import pytest
import torch

from hopperkern import moe


def _best(values, k):
    """Indices of the k largest values, ties to the lower index (Python sort, independent of torch.sort)."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def route_reference(logits, top_k, scoring="softmax", renormalize=True, num_groups=None, topk_groups=None,
                    correction_bias=None, scale=1.0):
    x = logits.float()
    scores = x.softmax(-1) if scoring == "softmax" else x.sigmoid()
    T, E = x.shape
    groups = num_groups or 1
    keep = topk_groups or groups
    per = E // groups
    ws, ids = [], []
    for t in range(T):
        s = scores[t].tolist()
        c = [s[e] + (float(correction_bias[e]) if correction_bias is not None else 0.0) for e in range(E)]
        if keep < groups:
            gscore = []
            for g in range(groups):
                members = c[g * per:(g + 1) * per]
                top = sorted(members, reverse=True)
                gscore.append(sum(top[:2]) if correction_bias is not None and per >= 2 else top[0])
            kept = set(_best(gscore, keep))
            c = [c[e] if e // per in kept else float("-inf") for e in range(E)]
        sel = _best(c, top_k)
        w = [s[e] for e in sel]
        if renormalize:
            tot = sum(w)
            w = [v / tot for v in w]
        ws.append([v * scale for v in w])
        ids.append(sel)
    return torch.tensor(ws, dtype=torch.float64), torch.tensor(ids, dtype=torch.int32)


def _check(logits, k, **kw):
    w, ids = moe.route(logits, k, **kw)
    w_ref, ids_ref = route_reference(logits.cpu(), k, **kw)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (logits.shape[0], k)
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu().double(), w_ref, rtol=2e-6, atol=1e-7)
    return w, ids


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softmax_topk(renormalize, dtype, device):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((33, 20), generator=gen).to(dtype).to(device)
    w, _ = _check(logits, 4, renormalize=renormalize)
    if renormalize:
        torch.testing.assert_close(w.sum(-1).cpu(), torch.ones(33), rtol=1e-6, atol=1e-6)


def test_softmax_top_k_equals_E(device):
    logits = torch.randn((5, 8), generator=torch.Generator().manual_seed(1)).to(device)
    w, ids = _check(logits, 8, renormalize=False)
    torch.testing.assert_close(w.sum(-1).cpu(), torch.ones(5), rtol=1e-6, atol=1e-6)  # softmax sums to 1


def test_sigmoid_grouped_with_bias_and_scale(device):
    """DeepSeek-V3 style: group score = sum of the top-2 biased scores, keep 2 of 4 groups, weights from the
    unbiased score, renormalised, times the routed scaling factor."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn((40, 32), generator=gen).to(device)
    bias = (torch.randn(32, generator=gen) * 0.5).to(device)
    w, ids = _check(logits, 6, scoring="sigmoid", num_groups=4, topk_groups=2, correction_bias=bias, scale=2.5)
    torch.testing.assert_close(w.sum(-1).cpu(), torch.full((40,), 2.5), rtol=1e-6, atol=1e-6)
    for t in range(40):
        assert len(set((ids[t].long() // 8).tolist())) <= 2  # experts come from at most topk_groups groups


def test_grouped_without_bias_uses_group_max(device):
    logits = torch.randn((16, 24), generator=torch.Generator().manual_seed(3)).to(device)
    _check(logits, 3, scoring="softmax", num_groups=6, topk_groups=2, renormalize=False)


def test_sigmoid_ungrouped_bias_changes_selection_not_weights(device):
    logits = torch.zeros((2, 6), device=device)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 2.0], device=device)
    w, ids = _check(logits, 2, scoring="sigmoid", correction_bias=bias, renormalize=False)
    assert ids.cpu().tolist() == [[5, 4], [5, 4]]
    torch.testing.assert_close(w.cpu(), torch.full((2, 2), 0.5))  # sigmoid(0), not sigmoid(0) + bias


def test_ties_lower_index_wins(device):
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]], device=device)
    _, ids = _check(logits, 2)
    assert ids.cpu().tolist() == [[1, 2], [0, 1]]


def test_group_ties_lower_group_wins(device):
    logits = torch.zeros((3, 8), device=device)  # every group scores the same
    _, ids = _check(logits, 2, scoring="sigmoid", num_groups=4, topk_groups=1, correction_bias=torch.zeros(8, device=device))
    assert ids.cpu().tolist() == [[0, 1]] * 3


def test_zero_tokens(device):
    w, ids = moe.route(torch.empty((0, 8), device=device), 2)
    assert w.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(top_k=9), ValueError, r"top_k must be <= the number of experts \(8\), got 9"),
    (dict(top_k=0), ValueError, r"top_k must be >= 1, got 0"),
    (dict(top_k=2.0), TypeError, "top_k must be an int, got float"),
    (dict(num_groups=3), ValueError, r"num_groups must divide the number of experts \(8\), got 3"),
    (dict(num_groups=4, topk_groups=5), ValueError, r"topk_groups must be in \[1, 4\], got 5"),
    (dict(topk_groups=2), ValueError, "topk_groups needs num_groups, got num_groups=None"),
    (dict(top_k=5, num_groups=4, topk_groups=2), ValueError,
     r"top_k must be <= topk_groups \* experts per group \(2 \* 2\), got 5"),
    (dict(scoring="relu"), ValueError, r"scoring must be one of \('softmax', 'sigmoid'\), got 'relu'"),
    (dict(renormalize="yes"), TypeError, "renormalize must be a bool, got str"),
    (dict(scale=float("inf")), ValueError, "scale must be finite, got inf"),
    (dict(scale=float("nan")), ValueError, "scale must not be NaN"),
    (dict(correction_bias=torch.zeros(7)), ValueError, r"correction_bias must have shape \(8,\), got \(7,\)"),
    (dict(logits=torch.zeros(8)), ValueError, r"router_logits must be 2-D, got shape \(8,\)"),
    (dict(logits=torch.zeros((2, 8), dtype=torch.int32)), TypeError, "router_logits must be float16 or bfloat16 or float32, got int32"),
])
def test_route_errors(kw, exc, match):
    logits = kw.pop("logits", torch.zeros((2, 8)))
    top_k = kw.pop("top_k", 2)
    with pytest.raises(exc, match=match):
        moe.route(logits, top_k, **kw)
