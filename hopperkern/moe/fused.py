"""``fused_moe``: the MoE MLP of routed tokens, built from align -> gate/up GEMM -> down GEMM + top-k reduce,
differentiable with respect to hidden, w13, w2 and topk_weights (backward: :mod:`hopperkern.moe.backward`).

Validation happens here; the launches run inside the ``hopperkern::moe_forward`` / ``moe_backward`` custom
ops (:mod:`hopperkern.moe.ops`)."""

from __future__ import annotations

import torch

from .. import tma as _tma
from .._validate import FLOAT_DTYPES, INDEX_DTYPES, check_choice, check_dtype, check_ndim, check_same_device
from .._validate import check_flag, check_no_transform, check_same_dtype, options_key, real_tensor, sync_check
from .._validate import tensor_meta, validate_once
from ..tuning import MoeConfig
from .gemm import ACTIVATIONS
from .ops import SAVE_NONE, SAVE_PLAN, SAVE_PRE, cached_forward, check_expert_ids, config_to_list, moe_forward_op
from .ops import moe_forward_run

__all__ = ["fused_moe", "check_expert_ids"]

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


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, activation: str = "silu", tma: str = "auto", check_ids: bool | str = "auto",
              deterministic: bool = True, config: MoeConfig | None = None, recompute: bool = False) -> torch.Tensor:
    """Mixture-of-Experts MLP of routed tokens. Equivalent plain PyTorch (see :mod:`hopperkern.moe.reference`)::

        out = zeros(T, H)
        for t, j:  e = topk_ids[t, j]; skip if e == -1
            x = hidden[t]
            out[t] += topk_weights[t, j] * (act(x @ w13[e, :I].T) * (x @ w13[e, I:].T)) @ w2[e].T

    hidden [T, H]; w13 [E, 2*I, H] (rows 0..I-1 gate, I..2I-1 up); w2 [E, H, I]; all one dtype (fp16, bf16,
    fp32; fp32 accumulation, fp32 inputs multiply in full fp32); topk_weights [T, k] fp16, bf16 or fp32
    (whatever hidden's dtype); topk_ids [T, k] int32/int64 in [-1, E), -1 dropping that slot (expert parallel),
    any strides (a flat copy of T*k ids where they do not flatten to unit stride). Returns [T, H] in
    hidden's dtype. The intermediate act(gate) * up is stored once, in hidden's dtype, in expert-sorted order.

    Differentiable with respect to hidden, w13, w2 and topk_weights (so the router logits get their gradient
    through :func:`hopperkern.moe.route`). Gradients come in their input's dtype, each formed from fp32 sums and
    rounded once: d_w13 and d_w2 are summed over each expert's tokens in fp32 and written once (exact zeros for
    an expert without tokens); d_hidden sums a token's k slots in a fixed order (bitwise reproducible unless
    ``deterministic=False``); dropped slots get no gradient. When autograd records (an input requires grad and
    grad mode is on) the forward keeps the alignment plan and, unless ``recompute``, the gate/up
    pre-activations ([rows, 2I] in hidden's dtype, rows = T*k plus up to block_m - 1 padding rows for each
    expert that gets tokens) for the backward;
    ``recompute=True`` keeps only the plan and recomputes them in the backward (the gate/up GEMM once more:
    about 22 % more FLOPs per training step). Under ``torch.no_grad()`` / inference mode nothing is kept.
    First-order gradients only: differentiating the backward again (double backward) raises.

    activation: "silu" or "gelu_tanh" (tanh approximation). tma: "auto" | "always" | "never" (per operand,
    see :func:`hopperkern.tma.decide`; decisions are recorded as "moe.gemm1" and "moe.gemm2", and for the
    backward "moe.backward.dgate_up", "moe.backward.d_hidden", "moe.backward.d_w13", "moe.backward.d_w2").
    check_ids: "auto" (default): no host sync on a GPU; a token with an id outside [-1, E) gets a NaN output
    row (and NaN d_hidden, and NaN d_topk_weights for that slot), never a plausible row lacking an expert;
    where the check costs no sync (CPU tensors) it raises ValueError. True: validate on the host first (one
    device->host sync; not under CUDA-graph capture), raising ValueError naming the bad ids. False: never
    check. Nothing else synchronises, forward or backward.
    deterministic: True (default) stores each slot's weighted row once (hidden's dtype) and sums the k rows
    of a token in a fixed order, in fp32: bitwise reproducible. False adds the rows with fp32 atomics into a
    [T, H] fp32 buffer, then casts: no [T*k, H] round trip, but the add order (so the last bits) varies run to
    run, and it costs a memset and a cast launch. The same holds for d_hidden in the backward.
    config: a :class:`hopperkern.tuning.MoeConfig` to use instead of the tuning file / heuristics. Its
    ``fused_topk`` (tuned per shape) makes tiny batches (a direct plan, see :func:`hopperkern.moe.prefer_direct`)
    sum each token's k experts inside the down GEMM: deterministic there whatever ``deterministic`` says. Its
    ``sorted_rows`` (tuned per shape and token count) makes sorted plans copy the token rows into sorted order
    first, so that the gate/up GEMM reads them with TMA (the same products and sums: the same results); the
    copy shares the per-slot rows' memory, and "moe.gemm1"'s decision then names it ``xs``. Its ``fused_mlp``
    (tuned per shape, direct plans only) runs both GEMMs of a tiny batch in one kernel, one program per (slot,
    slice of I), and sums each token's partial rows in a fixed order in a second launch: deterministic too, in
    fp32 throughout (no per-slot rounding); the decisions then name ``w13`` and ``w2`` only.
    When autograd records, the forward always uses a sorted plan (the backward walks expert segments).

    Inputs are read through their strides (no copies of the weights); TMA needs unit inner stride and 16-byte
    aligned strides, so ``tma="auto"`` falls back to pointer loads for weights that are not.
    """
    check_no_transform("moe.fused_moe")
    # getattr: a non-tensor argument must reach the validation below and its TypeError.
    grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (hidden, w13, w2, topk_weights))
    recompute = check_flag("recompute", recompute)  # before the cached path, which does not look at it
    if config is None and not grad and not torch.compiler.is_compiling():
        # The common eager inference call: one key lookup finds the plan of an earlier validated call.
        out = cached_forward(hidden, w13, w2, topk_weights, topk_ids, activation, tma, check_ids, deterministic)
        if out is not None:
            return out
    deterministic = check_flag("deterministic", deterministic)
    validate_once((tensor_meta(hidden), tensor_meta(w13), tensor_meta(w2), tensor_meta(topk_weights),
                   tensor_meta(topk_ids), options_key(activation, tma)),
                  lambda: _validate(hidden, w13, w2, topk_weights, topk_ids, activation, tma),
                  ("w13", w13), ("w2", w2))
    if config is not None and not isinstance(config, MoeConfig):
        raise TypeError(f"config must be a hopperkern.tuning.MoeConfig or None, got {type(config).__name__}")
    T, H = hidden.shape
    if not grad and (T == 0 or topk_ids.shape[1] == 0 or H == 0 or w2.shape[2] == 0):
        return torch.zeros((T, H), dtype=hidden.dtype, device=hidden.device)
    save = (SAVE_PLAN if recompute else SAVE_PRE) if grad else SAVE_NONE
    # Inference in eager mode needs neither autograd nor tracing: call the op's function without the dispatcher.
    eager = not grad and not torch.compiler.is_compiling() and real_tensor(hidden)  # meta/fake: the op's fake impl
    args = (hidden, w13, w2, topk_weights, topk_ids, activation, tma, sync_check("check_ids", check_ids, topk_ids),
            bool(deterministic), None if config is None else config_to_list(config), save)
    if eager:
        return moe_forward_run(*args, validated=True)[0]
    return moe_forward_op(*args)[0]
