"""Tensors whose elements are not in this process's memory: DTensors (FSDP2 parameters outside the wrapped module's
forward, tensor parallelism) and plain tensors whose storage FSDP freed. The kernels read raw pointers, so every op
refuses them with a clear error before launching: without the check a DTensor fails deep inside ("invalid python
storage", or a missing sharding rule for the custom op) and a freed storage is read as garbage without an error.
Inside the forward of a module that FSDP2's fully_shard wraps the parameters are plain gathered tensors: that works,
with the same loss and gradients as the unsharded model.

A one-process gloo group (an in-memory store, no ports) stands in for torchrun.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import DEVICE
from hopperkern import lce, moe

T, E, H, I, K, V = 16, 4, 64, 32, 2, 40  # noqa: E741

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh(torch.device(DEVICE).type, (1,))
    finally:
        dist.destroy_process_group()


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = dict(hidden=torch.randn(T, H, generator=g), weight=torch.randn(V, H, generator=g) / H ** 0.5,
             labels=torch.randint(0, V, (T,), generator=g), w13=torch.randn(E, 2 * I, H, generator=g) / H ** 0.5,
             w2=torch.randn(E, H, I, generator=g) / I ** 0.5, logits=torch.randn(T, E, generator=g))
    t = {k: v.to(DEVICE) for k, v in t.items()}
    t["topk_weights"], t["topk_ids"] = moe.route(t["logits"], K)
    return t


# Each op with the input that is made non-local.
CALLS = {
    "linear_cross_entropy": ("weight", lambda t: lce.linear_cross_entropy(t["hidden"], t["weight"], t["labels"])),
    "linear_logprobs_entropy": ("hidden", lambda t: lce.linear_logprobs_entropy(t["hidden"], t["weight"],
                                                                                  t["labels"])),
    "fused_moe": ("w13", lambda t: moe.fused_moe(t["hidden"], t["w13"], t["w2"], t["topk_weights"], t["topk_ids"])),
    "route": ("logits", lambda t: moe.route(t["logits"], K)),
}
NAMES = {"logits": "router_logits"}  # the argument's name in the error message


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
@pytest.mark.parametrize("op", CALLS)
def test_dtensor_input_is_refused(op, grad, mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    key, call = CALLS[op]
    t = inputs()
    t[key] = distribute_tensor(t[key], mesh, [Shard(0)]).requires_grad_(grad)
    name = NAMES.get(key, key)
    with pytest.raises(TypeError, match=rf"^{name} must be a plain torch.Tensor, got a DTensor with placements "
                                        rf"\(Shard\(dim=0\),\): hopperkern's kernels read local memory. Pass "
                                        rf"{name}.full_tensor\(\)"):
        call(t)


@pytest.mark.parametrize("op", CALLS)
def test_freed_storage_is_refused(op):
    """FSDP1 (use_orig_params=False) leaves the module's parameters as views of a storage resized to 0 bytes after
    the forward; their data_ptr still points somewhere, so a kernel would read garbage."""
    key, call = CALLS[op]
    t = inputs()
    t[key].untyped_storage().resize_(0)
    name = NAMES.get(key, key)
    with pytest.raises(ValueError, match=rf"^{name} must hold its \d+ elements in memory, got a tensor of shape "
                                         rf"\(\d+, \d+(, \d+)?\) whose storage is empty"):
        call(t)


class TinyLM(nn.Module):
    """An MoE block and an LM head with the fused loss, all inside forward (where FSDP2 gathers parameters)."""

    def __init__(self):
        super().__init__()
        self.block = moe.MoEBlock(H, I, E, K, device=DEVICE)
        self.lm_head = nn.Linear(H, V, bias=False, device=DEVICE)
        self.loss_fn = lce.LinearCrossEntropyLoss()

    def forward(self, x, labels):
        return self.loss_fn(self.block(x), self.lm_head.weight, labels)


def test_fsdp2_inside_forward_works_outside_is_refused(mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    plain = TinyLM()
    sharded = copy.deepcopy(plain)
    fully_shard(sharded.block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    t = inputs(seed=1)
    loss = sharded(t["hidden"], t["labels"])
    loss.backward()
    want = plain(t["hidden"], t["labels"])
    want.backward()
    assert torch.equal(loss, want)
    for (name, p), q in zip(sharded.named_parameters(), plain.parameters()):
        assert isinstance(p, DTensor) and torch.equal(p.grad.full_tensor(), q.grad), name
    with pytest.raises(TypeError, match="weight must be a plain torch.Tensor, got a DTensor"):
        lce.linear_cross_entropy(t["hidden"], sharded.lm_head.weight, t["labels"])
    full = lce.linear_cross_entropy(t["hidden"], sharded.lm_head.weight.full_tensor(), t["labels"])
    assert torch.equal(full, lce.linear_cross_entropy(t["hidden"], plain.lm_head.weight, t["labels"]))
