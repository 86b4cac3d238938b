"""LCE tuner: launch configs of the forward and the d(logits) kernels per (phase, dtype, hidden size) and token
bucket, on the current GPU.

Each candidate must first match an fp32 torch reference on 64 tokens spread over the batch (forward: the LSE;
backward: d_hidden) or it is skipped (:func:`hopperkern.tune.timing.pick_fastest`).
"""

from __future__ import annotations

import torch

from .. import tuning
from ..tuning import KernelConfig
from .timing import pick_fastest, rel_err, time_cuda

__all__ = ["CANDIDATES", "CHECK_ROWS", "LCE_BUCKETS", "LCE_SHAPES", "in_use", "tune_lce"]

LCE_SHAPES = ((4096, 128256), (896, 151936))  # (H, V) classes of the sweep; token buckets below
LCE_BUCKETS = (2048, 16384, 32768)
CANDIDATES = [
    KernelConfig(block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3, flatten=True),
    KernelConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, flatten=True),
    KernelConfig(block_m=128, block_n=256, block_k=64, group_m=32, num_warps=8, num_stages=3, flatten=True),
    KernelConfig(block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3, flatten=False),
    KernelConfig(block_m=128, block_n=128, block_k=64, group_m=16, num_warps=8, num_stages=4, flatten=True),
    KernelConfig(block_m=128, block_n=128, block_k=128, group_m=16, num_warps=8, num_stages=3, flatten=True),
]


def _bench(fn, reps=1):
    return time_cuda(fn, warmup=1, reps=reps)[0]  # one of pick_fastest's three rounds


SETTLE_S = 1.0  # seconds of back-to-back calls before each bucket's timing rounds (the GPU clock's settling)


def tune_lce(dtype=torch.bfloat16, buckets=LCE_BUCKETS, log=print) -> dict:
    """{lce_key: {bucket: KernelConfig}} for the forward and backward kernels, timed on this GPU."""
    result: dict = {}
    for H, V in LCE_SHAPES:
        _tune_lce_shape(H, V, dtype, buckets, result, log)
    return result


def in_use(phase: str, dtype, N: int, H: int, device) -> KernelConfig | None:
    """The config the LCE runs now for this phase, dtype and size: the entry of the tuning file it loads (which is
    the file ``--out`` merges into only when they are the same file), else the built-in default; None under the
    interpreter or when no file can be read. The tuner times it beside the candidates."""
    import warnings

    from ..lce.launch import pick_config
    from ..tma import interpreter_active

    if interpreter_active():
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return pick_config(phase, dtype, N, H, device)
    except Exception:  # an unreadable tuning file: nothing to compare with (the runtime says what is wrong)
        return None


CHECK_ROWS = 64  # tokens compared with the fp32 torch reference per bucket


def _tune_lce_shape(H, V, dtype, buckets, result, log, *, device="cuda", time_fn=None, candidates=None):
    from ..lce.launch import LceOptions, lce_backward, lce_forward

    opts = LceOptions()
    w = (torch.randn(V, H, device=device) * 0.5).to(dtype)
    for N in buckets:
        h = (torch.randn(N, H, device=device) * H**-0.5).to(dtype)
        y = torch.randint(0, V, (N,), device=device)
        _, lp, ent, lse = lce_forward(h, w, y, None, opts)
        g = torch.randn(N, device=device)
        # fp32 torch reference on CHECK_ROWS tokens spread over every row block: the LSE and d_hidden of
        # sum(g * logprob), i.e. (g * (onehot(y) - softmax(z))) @ w.
        sel = torch.linspace(0, N - 1, min(N, CHECK_ROWS), device=device).long()
        z = h[sel].float() @ w.float().T
        ref_lse = torch.logsumexp(z, -1)
        dz = -torch.softmax(z, -1) * g[sel, None]
        dz[torch.arange(len(sel), device=device), y[sel]] += g[sel]
        ref_dh = dz @ w.float()
        del z, dz
        for phase in ("forward", "backward"):
            if phase == "forward":
                def run(cfg):
                    return lce_forward(h, w, y, None, opts, config=cfg)

                def check(cfg):
                    return rel_err(run(cfg)[3][sel], ref_lse)
            else:
                def run(cfg):
                    # d(logits) kernels only: the cuBLAS GEMMs after them do not depend on the config.
                    return lce_backward(h, w, y, None, lse, ent, None, g, None, None, opts, logprob=lp,
                                        need_weight_grad=False, need_hidden_grad=False, config=cfg)

                def check(cfg):
                    d_h = lce_backward(h, w, y, None, lse, ent, None, g, None, None, opts, logprob=lp,
                                       need_weight_grad=False, config=cfg)[0]
                    return rel_err(d_h[sel], ref_dh)
            # fp32 LSE of exact bf16 products: only summation order differs (~1e-6); d_hidden is rounded to bf16.
            cands = list(candidates or CANDIDATES)
            current = in_use(phase, dtype, N, H, h.device)
            if current is not None and current not in cands:
                cands.append(current)  # a re-tune keeps the config in use unless a candidate beats it
            best = pick_fastest(cands, run, time_fn or _bench, log=log,
                                what=f"lce {phase} H={H} N={N}",
                                check=check, tol=1e-4 if phase == "forward" else 2e-2,
                                settle_s=0.0 if time_fn else SETTLE_S,
                                rounds=1 if time_fn else 3)  # a given time_fn (the CPU tests') is deterministic
            if best is not None:
                result.setdefault(tuning.lce_key(phase, dtype, H), {})[str(N)] = best[1]
                log(f"lce {phase} H={H} N={N}: best {best[1].model_dump()} {best[0]:.3f} ms")
        del h, y, lp, ent, lse, g, ref_lse, ref_dh
