"""``fused_moe``: the MoE MLP of routed tokens, built from align -> gate/up GEMM -> down GEMM + top-k reduce.

Forward only (inference): there is no backward yet, so inputs that require grad are refused while autograd is
recording (:class:`hopperkern.tma.UnsupportedError`) rather than returning a result cut off from the graph."""

from __future__ import annotations

import torch

from .. import tma as _tma
from .._validate import FLOAT_DTYPES, INDEX_DTYPES, check_choice, check_dtype, check_ndim, check_same_device
from .._validate import check_same_dtype
from ..tuning import MoeConfig
from .align import direct_plan, moe_align, prefer_direct
from .configs import moe_launch_config
from .gemm import ACTIVATIONS, down, gate_up

__all__ = ["fused_moe", "check_expert_ids"]

_MAX_LISTED_IDS = 8


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError naming the ids of ``topk_ids`` outside ``[-1, num_experts)``.

    Costs one device->host synchronisation (a boolean reduction read back), i.e. tens of microseconds on a
    GPU and a break in CUDA-graph capture; skip it with ``fused_moe(..., check_ids=False)``."""
    bad = (topk_ids < -1) | (topk_ids >= num_experts)
    if bool(bad.any()):
        vals = torch.unique(topk_ids[bad]).tolist()
        listed = ", ".join(str(v) for v in vals[:_MAX_LISTED_IDS]) + (", ..." if len(vals) > _MAX_LISTED_IDS else "")
        raise ValueError(f"topk_ids must be in [-1, {num_experts}) (-1 drops a slot), got expert ids {listed}")


def _validate(hidden, w13, w2, topk_weights, topk_ids, activation, tma):
    check_dtype("hidden", hidden, FLOAT_DTYPES)
    check_dtype("w13", w13, FLOAT_DTYPES)
    check_dtype("w2", w2, FLOAT_DTYPES)
    check_same_dtype("w13", w13, "hidden", hidden)
    check_same_dtype("w2", w2, "hidden", hidden)
    check_dtype("topk_weights", topk_weights, FLOAT_DTYPES)
    check_dtype("topk_ids", topk_ids, INDEX_DTYPES)
    check_ndim("hidden", hidden, 2)
    check_ndim("w13", w13, 3)
    check_ndim("w2", w2, 3)
    check_ndim("topk_ids", topk_ids, 2)
    check_choice("activation", activation, tuple(ACTIVATIONS))
    _tma.resolve_mode(tma)  # unknown tma mode -> ValueError before any launch
    T, H = hidden.shape
    E, H2, I = w2.shape  # noqa: E741
    if E < 1:
        raise ValueError(f"w2 must have at least 1 expert (E >= 1), got shape {tuple(w2.shape)}")
    if H2 != H:
        raise ValueError(f"w2 must be [E, H, I] with H = {H} (hidden.shape[1]), got shape {tuple(w2.shape)}")
    if tuple(w13.shape) != (E, 2 * I, H):
        raise ValueError(f"w13 must be [E, 2*I, H] = ({E}, {2 * I}, {H}) given w2 {tuple(w2.shape)} and hidden "
                         f"{tuple(hidden.shape)}, got shape {tuple(w13.shape)}")
    if topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must have {T} rows (hidden.shape[0]), got shape {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights must have the shape of topk_ids {tuple(topk_ids.shape)}, got shape "
                         f"{tuple(topk_weights.shape)}")
    check_same_device({"hidden": hidden, "w13": w13, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids})
    return T, H, E, I


def _check_no_grad(hidden, w13, w2, topk_weights) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (hidden, w13, w2, topk_weights)):
        raise _tma.UnsupportedError("fused_moe", [
            "backward is not implemented yet: fused_moe is forward-only (inference); call it under "
            "torch.no_grad() or detach its inputs"])


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, activation: str = "silu", tma: str = "auto", check_ids: bool = True,
              deterministic: bool = True, config: MoeConfig | None = None) -> torch.Tensor:
    """Mixture-of-Experts MLP of routed tokens, forward only. Equivalent plain PyTorch (see
    :mod:`hopperkern.moe.reference`)::

        out = zeros(T, H)
        for t, j:  e = topk_ids[t, j]; skip if e == -1
            x = hidden[t]
            out[t] += topk_weights[t, j] * (act(x @ w13[e, :I].T) * (x @ w13[e, I:].T)) @ w2[e].T

    hidden [T, H]; w13 [E, 2*I, H] (rows 0..I-1 gate, I..2I-1 up); w2 [E, H, I]; all one dtype (fp16, bf16,
    fp32; fp32 accumulation, fp32 inputs multiply in full fp32); topk_weights [T, k] float (any float dtype);
    topk_ids [T, k] int32/int64 in [-1, E), -1 dropping that slot (expert parallel). Returns [T, H] in
    hidden's dtype. The intermediate act(gate) * up is stored once, in hidden's dtype, in expert-sorted order.

    activation: "silu" or "gelu_tanh" (tanh approximation). tma: "auto" | "always" | "never" (per operand,
    see :func:`hopperkern.tma.decide`; decisions are recorded as "moe.gemm1" and "moe.gemm2").
    check_ids: validate the ids on the host first (one device->host sync). Pass False when ids are known valid
    and for CUDA-graph capture; invalid ids then drop their slots silently.
    deterministic: True (default) stores each slot's weighted row once (hidden's dtype) and sums the k rows
    of a token in a fixed order, in fp32: bitwise reproducible. False adds the rows with fp32 atomics into a
    [T, H] fp32 buffer, then casts: no [T*k, H] round trip, but the add order (so the last bits) varies run to
    run, and it costs a memset and a cast launch. The default was picked on traffic estimates (the atomic
    read-modify-writes miss L2 at prefill sizes; decode saves two launches); see benchmarks/bench_moe.py.
    config: a :class:`hopperkern.tuning.MoeConfig` to use instead of the tuning file / heuristics. Its
    ``fused_topk`` (tuned per shape) makes tiny batches (a direct plan, see :func:`hopperkern.moe.prefer_direct`)
    sum each token's k experts inside the down GEMM: deterministic there whatever ``deterministic`` says.

    Inputs are read through their strides (no copies of the weights); TMA needs unit inner stride and 16-byte
    aligned strides, so ``tma="auto"`` falls back to pointer loads for weights that are not.

    Forward only (inference): no backward is implemented yet, so when autograd is recording and any of hidden,
    w13, w2, topk_weights requires grad this raises :class:`hopperkern.tma.UnsupportedError` before any launch
    (call it under ``torch.no_grad()`` / ``torch.inference_mode()`` or pass detached tensors).
    """
    T, H, E, I = _validate(hidden, w13, w2, topk_weights, topk_ids, activation, tma)
    _check_no_grad(hidden, w13, w2, topk_weights)
    k = topk_ids.shape[1]
    if T == 0 or k == 0 or H == 0 or I == 0:
        return torch.zeros((T, H), dtype=hidden.dtype, device=hidden.device)
    if check_ids:
        check_expert_ids(topk_ids, E)
    if config is None:
        config, _ = moe_launch_config(E, H, I, hidden.dtype, T, k, hidden.device)
    make_plan = direct_plan if prefer_direct(T, k, E) else moe_align
    with _tma.launch_context(hidden, "moe.fused_moe"):
        plan = make_plan(topk_ids, E, config.gemm1.block_m)
        inter = gate_up(hidden, w13, plan, config=config.gemm1, activation=activation, tma=tma)
        return down(inter, w2, topk_weights, topk_ids, plan, config=config.gemm2, tma=tma,
                    deterministic=deterministic, out_dtype=hidden.dtype, fused_topk=config.fused_topk)
