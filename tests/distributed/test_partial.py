"""A Partial placement meets one error, LayoutError with one message, at every entry point and on every rank.

A quantized tensor cannot hold partial sums (adding codes and scales is not
adding values), so wherever a Partial placement reaches a quantized weight --
the placement check, quantizing a Partial DTensor, the reducing collectives
of a redistribute, the checkpoint entries -- the library raises
``dq.layout.partial_refused``'s LayoutError before any collective.
"""

import pytest
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import custom_ops
from dtensor_quant.testing import mesh, weight

STYLE = ("dtensor_quant: ", "cannot be Partial", "holds no partial sums", "Reduce the dense tensor first")


def _assert_partial_refusal(error: BaseException, what: str) -> None:
    assert type(error) is dq.LayoutError, f"{what}: {type(error).__name__}: {error}"
    assert all(s in str(error) for s in STYLE), f"{what}: {error}"


def test_check_placements_refuses_partial():
    for p in (Partial(), Partial("avg"), Partial("max")):
        with pytest.raises(dq.LayoutError) as info:
            dq.check_placements((64, 64), dq.Int4Groupwise(32), (2, 2), [Shard(0), p])
        _assert_partial_refusal(info.value, f"check_placements {p}")
        assert "on mesh dim 1" in str(info.value)


def refusals():
    """Every entry point where a Partial placement meets a quantized weight, run on each rank."""
    m, fmt = mesh(2), dq.Int8Rowwise()
    w = weight((4, 64))
    q = dq.quantize(w, fmt)
    cases = {
        "quantize(from_local Partial)": lambda: dq.quantize(DTensor.from_local(w, m, [Partial()]), fmt),
        "quantize(distribute_tensor Partial)": lambda: dq.quantize(distribute_tensor(w, m, [Partial()]), fmt),
        "custom op quantize(Partial)": lambda: custom_ops.quantize(DTensor.from_local(w, m, [Partial()]), fmt),
        "full_tensor of Partial": lambda: DTensor.from_local(q, m, [Partial()]).full_tensor(),
        "redistribute Partial -> Replicate": lambda: DTensor.from_local(q, m, [Partial()]).redistribute(
            m, [Replicate()]
        ),
        "redistribute Partial -> Shard(0)": lambda: DTensor.from_local(q, m, [Partial()]).redistribute(m, [Shard(0)]),
        "redistribute Partial(avg) -> Replicate": lambda: DTensor.from_local(q, m, [Partial("avg")]).full_tensor(),
        "state_dict of a Partial weight": lambda: _state_dict_of(DTensor.from_local(q, m, [Partial()])),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except Exception as e:
            out[name] = e
    return out


def _state_dict_of(param):
    lin = nn.Linear(64, 4, bias=False)
    lin.weight = nn.Parameter(param, requires_grad=False)
    return dq.state_dict.register(lin).state_dict()


def test_partial_refused_with_one_error_everywhere(ranks):
    for rank, errors in enumerate(ranks(2).run(refusals, timeout=120)):
        for name, error in errors.items():
            assert error is not None, f"rank {rank}: {name} did not raise"
            _assert_partial_refusal(error, f"rank {rank}: {name}")


def torch_refusals():
    """Where torch itself refuses first; recorded so that a change in torch shows up here."""
    m = mesh(2)
    q = dq.quantize(weight((4, 64)), dq.Int8Rowwise())
    out = {}
    try:  # DTensor refuses any redistribute *to* Partial before a local op runs
        distribute_tensor(q, m, [Replicate()]).redistribute(m, [Partial()])
    except RuntimeError as e:
        out["redistribute to Partial"] = (type(e).__name__, "internal use only" in str(e))
    try:  # distribute_tensor(..., [Partial()]) divides the local tensor by the mesh size: dense math
        distribute_tensor(q, m, [Partial()])
    except dq.UnsupportedOpError as e:
        out["distribute_tensor Partial(sum)"] = (type(e).__name__, "aten.div" in str(e))
    return out


def test_torch_refuses_partial_targets_first(ranks):
    expected = {
        "redistribute to Partial": ("RuntimeError", True),
        "distribute_tensor Partial(sum)": ("UnsupportedOpError", True),
    }
    assert ranks(2).run(torch_refusals, timeout=60) == [expected, expected]
