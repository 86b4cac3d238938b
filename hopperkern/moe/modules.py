"""``MoEBlock``: a Mixture-of-Experts MLP as a ``torch.nn.Module`` (router + experts), for training and inference,
with loaders for the expert weights of the common open checkpoints.

Parameters: ``gate.weight`` [E, H] (the router, an ``nn.Linear(H, E, bias=False)``), ``w13`` [E, 2I, H] (rows
0..I-1 the gate projection, I..2I-1 the up projection) and ``w2`` [E, H, I] (the down projection); with
``correction_bias=True`` also a float32 buffer ``correction_bias`` [E] (DeepSeek-V3's ``e_score_correction_bias``,
which moves expert selection only and is updated outside backprop).

Where the open checkpoints keep these tensors (``{prefix}`` is the block's key prefix, e.g.
``model.layers.0.mlp.``), and the block that matches each model:

==============  =======================================================  ==============================================
layout          keys read                                                 model, block
==============  =======================================================  ==============================================
``"mixtral"``   ``gate.weight``, ``experts.{e}.w1|w3|w2.weight``          Mixtral-8x7B (``block_sparse_moe.``):
                (w1 = gate, w3 = up, w2 = down)                           ``MoEBlock(4096, 14336, 8, 2)``
``"qwen3"``     ``gate.weight``, ``experts.{e}.gate_proj|up_proj|``       Qwen3-30B-A3B (``mlp.``):
                ``down_proj.weight``                                      ``MoEBlock(2048, 768, 128, 8)``
``"deepseek"``  as ``"qwen3"``, and ``gate.e_score_correction_bias``      DeepSeek-V3 (``mlp.``, layers 3+):
                                                                          ``MoEBlock(7168, 2048, 256, 8,
                                                                          scoring="sigmoid", num_groups=8,
                                                                          topk_groups=4, correction_bias=True,
                                                                          scale=2.5)``
``"stacked"``   ``gate.weight``, ``experts.gate_up_proj`` [E, 2I, H],     the fused expert modules of recent
                ``experts.down_proj`` [E, H, I]                           transformers releases (``MixtralExperts``,
                                                                          ``Qwen3MoeExperts``; gate rows first)
==============  =======================================================  ==============================================

Shared experts (DeepSeek, Qwen2-MoE) are plain MLPs outside the routed block: keep them as ``nn.Linear`` layers and
add their output. Qwen2-MoE (``norm_topk_prob=False``) needs ``renormalize=False``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validate import FLOAT_DTYPES, check_bool, check_choice, check_float, check_tensor
from ..tma import TMA_MODES
from .fused import fused_moe
from .gemm import ACTIVATIONS
from .routing import _check_int, route

__all__ = ["LAYOUTS", "MoEBlock"]

# Per-expert key templates (gate, up, down) under the block's prefix, for each checkpoint layout.
_PER_EXPERT_KEYS = {
    "mixtral": ("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
    "qwen3": ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight", "experts.{e}.down_proj.weight"),
    "deepseek": ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight", "experts.{e}.down_proj.weight"),
}
_STACKED_KEYS = ("experts.gate_up_proj", "experts.down_proj")
_ROUTER_KEY = "gate.weight"
_BIAS_KEY = "gate.e_score_correction_bias"
LAYOUTS = (*_PER_EXPERT_KEYS, "stacked")
_MAX_LISTED_KEYS = 4


def _checked(label: str, t, shape: tuple[int, ...], dims: str) -> torch.Tensor:
    """``t`` if it is a floating-point tensor of ``shape``; TypeError / ValueError naming ``label`` otherwise."""
    check_tensor(label, t)
    if not t.is_floating_point():
        raise TypeError(f"{label} must be a floating-point tensor, got {str(t.dtype).replace('torch.', '')}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{label} must have shape {dims} = {shape}, got {tuple(t.shape)}")
    return t


class MoEBlock(nn.Module):
    """A routed Mixture-of-Experts MLP: ``forward(x [..., H]) -> [..., H]``. In plain PyTorch::

        logits = x @ gate.weight.T                                   # [T, E], T = x.numel() // H
        topk_weights, topk_ids = moe.route(logits, top_k, scoring=scoring, renormalize=renormalize,
                                           num_groups=num_groups, topk_groups=topk_groups,
                                           correction_bias=correction_bias, scale=scale)
        out[t] = sum_j topk_weights[t, j] * (act(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)) @ w2[e].T
                                                                     # e = topk_ids[t, j]

    computed by :func:`hopperkern.moe.route` and :func:`hopperkern.moe.fused_moe`, so it is differentiable with
    respect to x, ``w13``, ``w2`` and, through the routing weights, the router ``gate.weight``.

    Args:
        hidden_size (H), intermediate_size (I, per expert), num_experts (E), top_k (k): ints >= 1, k <= E.
        activation: "silu" (SwiGLU experts) or "gelu_tanh".
        scoring, renormalize, num_groups, topk_groups, scale: routing options, see :func:`moe.route`.
        correction_bias: keep a float32 buffer ``correction_bias`` [E] (zeros) added to the scores for the
            expert selection only (DeepSeek-V3).
        tma, deterministic, recompute: passed on to :func:`moe.fused_moe`.
        device, dtype: of the parameters (fp16, bf16 or fp32; default ``torch.get_default_dtype()``).

    Initialisation follows ``nn.Linear``: every weight uniform in ±1/sqrt(fan_in), fan_in = H for the router
    and ``w13``, I for ``w2``. ``x`` must have the parameters' dtype; under ``torch.autocast`` the router runs as
    an autocast ``nn.Linear`` and the experts in the autocast dtype (x, ``w13`` and ``w2`` are cast: copies of
    the expert weights in each forward).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 activation: str = "silu", scoring: str = "softmax", renormalize: bool = True,
                 num_groups: int | None = None, topk_groups: int | None = None, correction_bias: bool = False,
                 scale: float = 1.0, tma: str = "auto", deterministic: bool = True, recompute: bool = False,
                 device=None, dtype: torch.dtype | None = None):
        super().__init__()
        H = _check_int("hidden_size", hidden_size, 1)
        I = _check_int("intermediate_size", intermediate_size, 1)  # noqa: E741
        E = _check_int("num_experts", num_experts, 1)
        check_choice("activation", activation, ACTIVATIONS)
        check_choice("tma", tma, TMA_MODES)
        for name, value in (("renormalize", renormalize), ("correction_bias", correction_bias),
                            ("deterministic", deterministic), ("recompute", recompute)):
            check_bool(name, value)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in FLOAT_DTYPES:
            names = " or ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
            raise TypeError(f"dtype must be {names}, got {dtype}")
        self.hidden_size, self.intermediate_size, self.num_experts, self.top_k = H, I, E, top_k
        self.activation, self.scoring, self.renormalize = activation, scoring, renormalize
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.scale = check_float("scale", scale, finite=True)
        self.tma, self.deterministic, self.recompute = tma, deterministic, recompute

        self.gate = nn.Linear(H, E, bias=False, device=device, dtype=dtype)
        self.w13 = nn.Parameter(torch.empty((E, 2 * I, H), device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty((E, H, I), device=device, dtype=dtype))
        bias = torch.zeros(E, device=device, dtype=torch.float32) if correction_bias else None
        self.register_buffer("correction_bias", bias)
        # route's own checks of top_k, scoring and the grouping, on zero tokens: an error here, not in forward.
        self._route(torch.empty((0, E), device="meta"), torch.zeros(E, device="meta") if correction_bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation for each weight (uniform in ±1/sqrt(fan_in)); the correction bias to 0."""
        self.gate.reset_parameters()
        with torch.no_grad():
            self.w13.uniform_(-1 / math.sqrt(self.hidden_size), 1 / math.sqrt(self.hidden_size))
            self.w2.uniform_(-1 / math.sqrt(self.intermediate_size), 1 / math.sqrt(self.intermediate_size))
            if self.correction_bias is not None:
                self.correction_bias.zero_()

    def _route(self, logits: torch.Tensor, correction_bias: torch.Tensor | None):
        return route(logits, self.top_k, scoring=self.scoring, renormalize=self.renormalize,
                     num_groups=self.num_groups, topk_groups=self.topk_groups, correction_bias=correction_bias,
                     scale=self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x)
        H = self.hidden_size
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"x must be [..., {H}] (hidden_size {H}), got shape {tuple(x.shape)}")
        h = x.reshape(-1, H)
        w13, w2 = self.w13, self.w2
        dev = x.device.type
        if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            h, w13, w2 = h.to(dt), w13.to(dt), w2.to(dt)
        elif x.dtype != w13.dtype:
            raise TypeError(f"x must be {str(w13.dtype).replace('torch.', '')} (the dtype of the block's "
                            f"parameters), got {str(x.dtype).replace('torch.', '')}")
        topk_weights, topk_ids = self._route(self.gate(h), self.correction_bias)
        # route's ids are valid by construction: check_ids=False spares the host sync that checks them
        out = fused_moe(h, w13, w2, topk_weights, topk_ids, activation=self.activation, tma=self.tma,
                        check_ids=False, deterministic=self.deterministic, recompute=self.recompute)
        return out if x.dim() == 2 else out.view(x.shape)

    # ------------------------------------------------------------------------------------------------------------
    # Loading the weights of per-expert checkpoints

    def _expert_sources(self, name: str, value, shape: tuple[int, ...], dims: str) -> list[torch.Tensor]:
        """The E tensors of one projection, from a stacked tensor [E, *shape] or a sequence of E tensors."""
        E = self.num_experts
        if isinstance(value, torch.Tensor):
            return list(_checked(name, value, (E, *shape), f"[E, {dims}]").unbind(0))
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a tensor [E, {dims}] or a list of E tensors [{dims}], "
                            f"got {type(value).__name__}")
        if len(value) != E:
            raise ValueError(f"{name} must hold {E} tensors (num_experts), got {len(value)}")
        return [_checked(f"{name}[{e}]", t, shape, f"[{dims}]") for e, t in enumerate(value)]

    @torch.no_grad()
    def _copy_in(self, gate, up, down, router=None, correction_bias=None) -> None:
        """Copy checked per-expert tensors into the parameters (cast to their dtype and device)."""
        I = self.intermediate_size  # noqa: E741
        for e in range(self.num_experts):
            self.w13[e, :I].copy_(gate[e])
            self.w13[e, I:].copy_(up[e])
            self.w2[e].copy_(down[e])
        if router is not None:
            self.gate.weight.copy_(router)
        if correction_bias is not None:
            self.correction_bias.copy_(correction_bias)

    def load_experts(self, gate_proj, up_proj, down_proj, *, router: torch.Tensor | None = None) -> None:
        """Copy per-expert weights into ``w13`` and ``w2`` (and the router into ``gate.weight``).

        ``gate_proj`` and ``up_proj``: E tensors [I, H] each, as a list or stacked [E, I, H]; ``down_proj``: E
        tensors [H, I], or [E, H, I]. These are ``nn.Linear`` weights ([out, in]): Qwen3-MoE's and DeepSeek's
        ``gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's ``w1`` / ``w3`` / ``w2``. ``router``: [E, H].
        Then, in plain PyTorch, ``w13[e] = cat([gate_proj[e], up_proj[e]])`` and ``w2[e] = down_proj[e]``.
        Every shape is checked before anything is copied (ValueError / TypeError naming the tensor); values are
        cast to the parameters' dtype and device.
        """
        H, I = self.hidden_size, self.intermediate_size  # noqa: E741
        gate = self._expert_sources("gate_proj", gate_proj, (I, H), "I, H")
        up = self._expert_sources("up_proj", up_proj, (I, H), "I, H")
        down = self._expert_sources("down_proj", down_proj, (H, I), "H, I")
        if router is not None:
            _checked("router", router, (self.num_experts, H), "[E, H]")
        self._copy_in(gate, up, down, router)

    def load_hf_state_dict(self, state_dict, prefix: str = "", *, layout: str) -> list[str]:
        """Load the router and experts of one MoE layer from a checkpoint's state dict (e.g. read with
        ``safetensors.torch.load_file``), by the key names of ``layout`` under ``prefix`` (see the table in
        :mod:`hopperkern.moe.modules`): ``"mixtral"``, ``"qwen3"``, ``"deepseek"`` or ``"stacked"``.

        The block's correction bias, if it has one, is read from ``gate.e_score_correction_bias``; a state dict
        holding that key for a block built without ``correction_bias=True`` is refused (the routing would
        differ). Missing keys raise ValueError listing them; shapes are checked before anything is copied.
        Returns the keys read, so a caller can see which of the layer's keys (shared experts, say) remain.
        """
        check_choice("layout", layout, LAYOUTS)
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size  # noqa: E741
        keys = [_ROUTER_KEY]
        if layout == "stacked":
            keys += list(_STACKED_KEYS)
        else:
            keys += [template.format(e=e) for template in _PER_EXPERT_KEYS[layout] for e in range(E)]
        if self.correction_bias is not None:
            keys.append(_BIAS_KEY)
        elif prefix + _BIAS_KEY in state_dict:
            raise ValueError(f"state_dict holds {prefix + _BIAS_KEY}, but this block has no correction bias: "
                             "build it with correction_bias=True (DeepSeek-V3 routing)")
        keys = [prefix + key for key in keys]
        missing = [key for key in keys if key not in state_dict]
        if missing:
            listed = ", ".join(missing[:_MAX_LISTED_KEYS]) + (", ..." if len(missing) > _MAX_LISTED_KEYS else "")
            raise ValueError(f"state_dict must hold the {len(keys)} keys of layout {layout!r} under prefix "
                             f"{prefix!r}, got {len(missing)} missing: {listed}")
        t = {key[len(prefix):]: state_dict[key] for key in keys}
        router = _checked(prefix + _ROUTER_KEY, t[_ROUTER_KEY], (E, H), "[E, H]")
        bias = None
        if self.correction_bias is not None:
            bias = _checked(prefix + _BIAS_KEY, t[_BIAS_KEY], (E,), "[E]")
        if layout == "stacked":
            gate_up = _checked(prefix + _STACKED_KEYS[0], t[_STACKED_KEYS[0]], (E, 2 * I, H), "[E, 2I, H]")
            down = _checked(prefix + _STACKED_KEYS[1], t[_STACKED_KEYS[1]], (E, H, I), "[E, H, I]")
            self._copy_in(gate_up[:, :I], gate_up[:, I:], down, router, bias)
            return keys
        shapes = ((I, H, "[I, H]"), (I, H, "[I, H]"), (H, I, "[H, I]"))
        parts = [[_checked(prefix + template.format(e=e), t[template.format(e=e)], (rows, cols), dims)
                  for e in range(E)] for template, (rows, cols, dims) in zip(_PER_EXPERT_KEYS[layout], shapes)]
        self._copy_in(*parts, router, bias)
        return keys

    def extra_repr(self) -> str:
        options = [f"hidden_size={self.hidden_size}", f"intermediate_size={self.intermediate_size}",
                   f"num_experts={self.num_experts}", f"top_k={self.top_k}", f"activation={self.activation!r}",
                   f"scoring={self.scoring!r}", f"renormalize={self.renormalize}"]
        if self.num_groups is not None:
            options += [f"num_groups={self.num_groups}", f"topk_groups={self.topk_groups}"]
        if self.correction_bias is not None:
            options.append("correction_bias=True")
        if self.scale != 1.0:
            options.append(f"scale={self.scale}")
        return ", ".join(options)
