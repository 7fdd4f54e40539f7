"""checkpoint/state_dict: how a quantized weight appears in a state dict, and the format record it is
checked against.

The reference is the weight itself: its entries are its own inner tensors, and whatever is built back from
entries holds the saved weight's bytes (or quantize's, from a dense tensor).
"""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dtensor_quant as dq
from dtensor_quant import checkpoint as ckpt
from dtensor_quant._checkpoint import state_dict as sd
from dtensor_quant._core.layout import Stacked
from dtensor_quant.testing import FORMATS, assert_same_bits, placements, weight
from tests.support import ckpt_cases as cc
from tests.support.ckpt_cases import OTHER, SEED

_PLACEMENTS = ["R", "S0", "S1", "SS0:2", "SS1:2", "SS1:3"]


@settings(max_examples=300, deadline=None)
@given(
    fmt_name=st.sampled_from(["int8", "int4g2", "int4g8", "int4g16"]),
    rows=st.integers(1, 12),
    half_cols=st.integers(1, 40),
    mesh_shape=st.sampled_from([(2,), (3,), (4,), (2, 2), (2, 3), (3, 2)]),
    specs=st.lists(st.sampled_from(_PLACEMENTS), min_size=2, max_size=2),
)
def test_legal_placements_have_entry_chunks(fmt_name, rows, half_cols, mesh_shape, specs):
    """DTensor's chunk of each inner entry is the logical chunk's inner range, on every rank."""
    from dtensor_quant.checkpoint import check_entry_chunks

    fmt = FORMATS.get(fmt_name) or dq.Int4Groupwise(int(fmt_name[5:]))
    shape, places = (rows, 2 * half_cols), tuple(placements(",".join(specs[: len(mesh_shape)])))
    try:
        dq.check_placements(shape, fmt, mesh_shape, places)
    except dq.LayoutError:
        return  # an illegal placement has no checkpoint form to check
    check_entry_chunks(fmt, shape, mesh_shape, places)


def test_entry_chunk_check_rejects_a_cut_block():
    from dtensor_quant.checkpoint import check_entry_chunks

    with pytest.raises(dq.LayoutError, match="cannot follow"):
        check_entry_chunks(dq.Int4Groupwise(32), (4, 96), (2,), tuple(placements("S1")))


def test_load_state_dict_of_another_format_is_refused():
    """The module hook checks the format record too (plain dcp.load + load_state_dict)."""
    sd = cc.reference(SEED, "int4g32").state_dict()
    net = cc.reference(OTHER, "int4g64")
    with pytest.raises(ckpt.CheckpointFormatError, match=r"group_size=32.*group_size=64"):
        net.load_state_dict(sd)


# -- the entries of one weight, on one process -------------------------------------------------


def quantized(fmt_name, seed=1, shape=(16, 256)):
    return dq.quantize(weight(shape, seed=seed), FORMATS[fmt_name])


@pytest.mark.parametrize("fmt_name", list(FORMATS))
def test_entries_alias_the_inner_tensors_and_carry_a_json_record(fmt_name):
    """One plain entry per inner tensor -- the weight's own bytes, no copy -- and a JSON record a reader without the
    library can use: the format, its parameters, the logical shape and dtype, each inner tensor's dtype and layout."""
    q = quantized(fmt_name)
    entries = sd.to_entries(q)
    assert set(entries) == {*q.fmt.inner_names, sd.SPEC_KEY}
    for name in q.fmt.inner_names:
        assert entries[name] is getattr(q, name) or entries[name].data_ptr() == getattr(q, name).data_ptr(), name
    record = json.loads(entries[sd.SPEC_KEY])
    assert record["format"] == type(q.fmt).__name__ and record["description"] == str(q.fmt)
    assert record["shape"] == list(q.shape) and record["dtype"] == str(q.dtype).removeprefix("torch.")
    assert sorted(record["inner"]) == sorted(q.fmt.inner_names)  # written with sorted keys
    for name, rels in zip(q.fmt.inner_names, q.rels):
        assert record["inner"][name]["layout"] == [sd.relation_name(r) for r in rels]
        assert record["inner"][name]["dtype"] == str(getattr(q, name).dtype).removeprefix("torch.")
    assert sd.parse_spec(entries[sd.SPEC_KEY], "w") == record
    assert record == sd.quant_record(q.fmt, q.shape, q.dtype, {n: getattr(q, n).dtype for n in q.fmt.inner_names})


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@pytest.mark.parametrize("transposed", [False, True])
def test_from_entries_rebuilds_the_saved_weight_bit_for_bit(fmt_name, transposed):
    """Entries of one weight (cloned: what a load reads) placed into a parameter of the same format give its bytes;
    a transposed parameter's entries are stored in the canonical orientation and come back transposed."""
    saved, like = quantized(fmt_name, seed=1), quantized(fmt_name, seed=2)
    if transposed:
        saved, like = saved.t(), like.t()
    entries = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.to_entries(saved).items()}
    back = sd.from_entries(entries, like)
    assert back.shape == saved.shape and back.dims == saved.dims
    assert_same_bits(back, saved, fmt_name)


def test_from_entries_refuses_another_format_a_missing_entry_and_a_wrong_shape():
    q8, q4 = quantized("int8"), quantized("int4g32")
    with pytest.raises(sd.CheckpointFormatError, match=r"w: the checkpoint holds Int8Rowwise\(\).*Int4Groupwise"):
        sd.from_entries(sd.to_entries(q8), q4, "w")
    entries = dict(sd.to_entries(q4))
    del entries["zero"]
    with pytest.raises(sd.CheckpointFormatError, match=r"entries \['zero'\].*are missing"):
        sd.from_entries(entries, q4, "w")
    other = sd.to_entries(quantized("int4g32", shape=(8, 256)))
    with pytest.raises(sd.CheckpointFormatError, match=r"shape \(8, 256\).*shape \(16, 256\)"):
        sd.from_entries(other, q4, "w")
    with pytest.raises(sd.CheckpointFormatError, match="not a dtensor_quant format record"):
        sd.parse_spec("not json", "w")
    with pytest.raises(sd.CheckpointFormatError, match="not a dtensor_quant format record"):
        sd.parse_spec('{"shape": [1]}', "w")


@pytest.mark.parametrize("fmt_name", ["int8", "int4g32", "nf4", "f8tensor"])
def test_quantize_like_is_quantize_into_the_parameters_format(fmt_name):
    """A dense checkpoint loads by quantizing the whole tensor with the parameter's format: quantize's bytes."""
    like, dense = quantized(fmt_name, seed=1), weight((16, 256), seed=3)
    assert_same_bits(sd.quantize_like(dense, like), dq.quantize(dense, FORMATS[fmt_name]), fmt_name)
    with pytest.raises(sd.CheckpointFormatError, match=r"dense weight of shape \(8, 256\)"):
        sd.quantize_like(weight((8, 256)), like)
    with pytest.raises(sd.CheckpointFormatError, match="transposed quantized view"):
        sd.quantize_like(dense.t(), like.t())


def test_relation_names_are_the_documented_spellings():
    spelled = {
        dq.OneToOne(): "one-to-one",
        dq.Packed(2): "packed:2",
        dq.Blocked(128): "blocked:128",
        dq.Constant(): "constant",
        dq.FlatBlocked(64, 96): "flat-blocked:64:96",
        dq.FlatBlocked(64, 96, packed=True): "flat-packed:64:96",
        dq.InFlat(96): "in-flat:96",
    }
    for rel, name in spelled.items():
        assert sd.relation_name(rel) == name
    with pytest.raises(dq.LayoutError, match="no checkpoint form"):
        sd.relation_name(Stacked(4))


def test_the_state_dict_holds_tensors_and_its_entries_load_back():
    """The default form is the weight itself (torch's contract); the entry form, explicit, loads back too."""
    src = dq.quantize_(torch.nn.Linear(256, 16, bias=False), dq.Int4Groupwise(64))
    dst = dq.quantize_(torch.nn.Linear(256, 16, bias=False), dq.Int4Groupwise(64))
    assert isinstance(src.state_dict()["weight"], dq.QuantizedTensor)
    state = dq.checkpoint.entries_from_state(src.state_dict())
    assert set(state["weight"]) == {"qdata", "scale", "zero", sd.SPEC_KEY}
    opted_out = dq.checkpoint.tensor_state_dicts(
        dq.quantize_(torch.nn.Linear(256, 16, bias=False), dq.Int4Groupwise(64)), enabled=False
    )
    assert set(opted_out.state_dict()["weight"]) == {"qdata", "scale", "zero", sd.SPEC_KEY}
    dst.load_state_dict(
        {"weight": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state["weight"].items()}}
    )
    assert_same_bits(dst.weight, src.weight, "loaded")
    dense = weight((16, 256), seed=4, dtype=torch.float32)  # the Linear's dtype
    dst.load_state_dict({"weight": dense})  # a dense checkpoint: quantized on load, as quantize would
    assert_same_bits(dst.weight, dq.quantize(dense, dq.Int4Groupwise(64)), "dense")
