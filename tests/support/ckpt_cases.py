"""Models, layouts and checks for the checkpoint tests (importable by the ranks of a pool).

A small model with three Linears chosen to stress the layout: ``a`` has 10
rows (uneven over 3 and 4 ranks), ``b`` has a dense bias, ``c`` has 5 rows
(an empty shard on 4 ranks). Every layout below is legal for int8, int4g32
and int4g64 of the registry. A reference model is always the same single-process quantization,
so a loaded model is compared with it bit by bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import checkpoint as ckpt
from dtensor_quant.testing import FORMATS, assert_same_bits, mesh, placements

SHAPES = {"a": (10, 256), "b": (24, 128), "c": (5, 64)}  # [out, in]

# name -> (mesh shape or None for a single process, {param: placements})
LAYOUTS = {
    "single": (None, {}),
    "tp2": ((2,), {"a.weight": "S0", "b.weight": "S1", "b.bias": "R", "c.weight": "S0"}),
    "fsdp4": ((4,), {"a.weight": "S0", "b.weight": "S0", "b.bias": "S0", "c.weight": "S0"}),
    "s0_2": ((2,), {"a.weight": "S0", "b.weight": "S0", "b.bias": "S0", "c.weight": "S0"}),
    "s1_2": ((2,), {"a.weight": "S1", "b.weight": "S1", "b.bias": "R", "c.weight": "S1"}),
    "s0_3": ((3,), {"a.weight": "S0", "b.weight": "S0", "b.bias": "S0", "c.weight": "S0"}),
    "s1_3": ((3,), {"a.weight": "S1", "b.weight": "S1", "b.bias": "R", "c.weight": "S1"}),  # int8 only
    "2x2": ((2, 2), {"a.weight": "S0,S1", "b.weight": "S1,S0", "b.bias": "S0,R", "c.weight": "R,S1"}),
    # FSDP2 + TP: dp shards what tp already sharded (_StridedShard on the dp dim)
    "fsdp_tp": ((2, 2), {"a.weight": "SS0:2,S0", "b.weight": "S0,S1", "b.bias": "S0,R", "c.weight": "SS0:2,S0"}),
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(SHAPES["a"][1], SHAPES["a"][0], bias=False)
        self.b = nn.Linear(SHAPES["b"][1], SHAPES["b"][0], bias=True)
        self.c = nn.Linear(SHAPES["c"][1], SHAPES["c"][0], bias=False)


def dense_net(seed: int) -> Net:
    """The same bf16 weights on every rank for a given seed."""
    torch.manual_seed(seed)
    return Net().to(torch.bfloat16)


def reference(seed: int, fmt_name: str | None) -> Net:
    """The single-process model: dense, or quantized as a whole."""
    net = dense_net(seed)
    return dq.quantize_(net, FORMATS[fmt_name]) if fmt_name else net


def placed(seed: int, fmt_name: str | None, layout: str) -> Net:
    """``reference(seed, fmt)`` distributed by ``layout`` (every parameter a DTensor on its mesh)."""
    net = reference(seed, fmt_name)
    mesh_shape, specs = LAYOUTS[layout]
    if mesh_shape is None:
        return net
    m = mesh(*mesh_shape)
    for name, param in list(net.named_parameters()):
        module_name, attr = name.rsplit(".", 1)
        dt = distribute_tensor(param.detach(), m, placements(specs[name]), src_data_rank=None)
        setattr(net.get_submodule(module_name), attr, nn.Parameter(dt, requires_grad=param.requires_grad))
    return net


def check_against(net: Net, seed: int, fmt_name: str | None, layout: str) -> None:
    """Every parameter of ``net`` holds exactly ``placed(seed, fmt, layout)``'s local bytes and full tensor."""
    expected = dict(placed(seed, fmt_name, layout).named_parameters())
    ref = dict(reference(seed, fmt_name).named_parameters())
    for name, param in net.named_parameters():
        want = expected[name]
        assert type(param) is type(want), (name, type(param), type(want))
        if isinstance(param, DTensor):
            assert param.placements == want.placements and param.device_mesh == want.device_mesh, name
            got_local, want_local, full = param.to_local(), want.to_local(), param.full_tensor()
        else:
            got_local, want_local, full = param, want, param
        if isinstance(want_local, dq.QuantizedTensor):
            assert_same_bits(got_local, want_local, f"{name} local")
            assert_same_bits(full, ref[name].detach(), f"{name} full")
        else:
            assert torch.equal(got_local.view(torch.uint8), want_local.view(torch.uint8)), name
            assert torch.equal(full, ref[name].detach()), name


SEED, OTHER = 7, 1234


def world(layout: str) -> int | None:
    mesh_shape = LAYOUTS[layout][0]
    return None if mesh_shape is None else int(torch.tensor(mesh_shape).prod())


def on(ranks, layout, fn, *args):
    """``fn(*args)`` on the ranks a layout needs (here, in this process, for a single process)."""
    n = world(layout)
    return [fn(*args)] if n is None else ranks(n).run(fn, *args)


def save_model(fmt_name, layout, path, api="dq", seed=SEED):
    net = placed(seed, fmt_name, layout)
    if api == "dq":
        ckpt.save(net, path)
    elif api == "dcp":  # plain dcp, default planner: the model opted out of tensors (entry-form state dicts)
        net = ckpt.tensor_state_dicts(net, enabled=False)
        dcp.save(net.state_dict(), checkpoint_id=path, no_dist=not dist.is_initialized())
    elif api == "dsd":  # plain dcp, default planner: the state dict converted to entries
        sd = ckpt.entries_from_state(get_model_state_dict(net))
        dcp.save(sd, checkpoint_id=path, no_dist=not dist.is_initialized())
    elif api == "tensors":  # the default tensors-only state dicts, plain dcp with the library's planner
        sd = get_model_state_dict(net)
        assert all(isinstance(v, torch.Tensor) for v in sd.values())
        dcp.save(sd, checkpoint_id=path, planner=ckpt.SavePlanner(), no_dist=not dist.is_initialized())


def load_model(fmt_name, layout, path, api="dq", seed=SEED):
    net = placed(OTHER, fmt_name, layout)
    if api == "dq":
        ckpt.load(net, path)
    elif api == "dcp":
        sd = ckpt.tensor_state_dicts(net, enabled=False).state_dict()
        dcp.load(sd, checkpoint_id=path, no_dist=not dist.is_initialized())
        net.load_state_dict(sd)
    elif api == "dsd":
        sd = ckpt.entries_from_state(get_model_state_dict(net))
        dcp.load(sd, checkpoint_id=path, no_dist=not dist.is_initialized())
        set_model_state_dict(net, sd)
    elif api == "tensors":
        sd = get_model_state_dict(net)
        dcp.load(sd, checkpoint_id=path, planner=ckpt.LoadPlanner(), no_dist=not dist.is_initialized())
        set_model_state_dict(net, sd)
    check_against(net, seed, fmt_name, layout)


def load_damaged(path, layout, fmt_name="int8"):
    """Load into a model with other weights: a clear error, and every local byte as it was."""
    from dtensor_quant import checkpoint as ckpt

    net = placed(2, fmt_name, layout)
    before = {k: v.clone() for k, v in local_bytes(net).items()}
    try:
        ckpt.load(net, path)
    except (ckpt.CheckpointCorruptError, ckpt.CheckpointFormatError) as e:
        after = local_bytes(net)
        same = all(torch.equal(before[k], after[k]) for k in before)
        return type(e).__name__, str(e), same
    return "loaded", "", False


def local_bytes(net) -> dict[str, torch.Tensor]:
    """This rank's stored bytes: each quantized weight's inner tensors, each dense tensor (uint8 views)."""
    out = {}
    for k, v in net.state_dict().items():
        local = v.to_local() if isinstance(v, DTensor) else v
        inner = local.inner if isinstance(local, dq.QuantizedTensor) else {"": local}
        out.update({f"{k}.{n}": t.contiguous().view(torch.uint8) for n, t in inner.items()})
    return out


def save_placed(path, layout, fmt_name="int8"):
    from dtensor_quant import checkpoint as ckpt

    ckpt.save(placed(1, fmt_name, layout), path)
