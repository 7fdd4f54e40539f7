"""checkpoint/state_dict: how a quantized weight appears in a state dict, and the format record it is
checked against.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dtensor_quant as dq
from dtensor_quant import checkpoint as ckpt
from dtensor_quant.testing import FORMATS, placements
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
    from dtensor_quant.state_dict import check_entry_chunks

    fmt = FORMATS.get(fmt_name) or dq.Int4Groupwise(int(fmt_name[5:]))
    shape, places = (rows, 2 * half_cols), tuple(placements(",".join(specs[: len(mesh_shape)])))
    try:
        dq.check_placements(shape, fmt, mesh_shape, places)
    except dq.LayoutError:
        return  # an illegal placement has no checkpoint form to check
    check_entry_chunks(fmt, shape, mesh_shape, places)


def test_entry_chunk_check_rejects_a_cut_block():
    from dtensor_quant.state_dict import check_entry_chunks

    with pytest.raises(dq.LayoutError, match="cannot follow"):
        check_entry_chunks(dq.Int4Groupwise(32), (4, 96), (2,), tuple(placements("S1")))


def test_load_state_dict_of_another_format_is_refused():
    """The module hook checks the format record too (plain dcp.load + load_state_dict)."""
    sd = cc.reference(SEED, "int4g32").state_dict()
    net = cc.reference(OTHER, "int4g64")
    with pytest.raises(ckpt.CheckpointFormatError, match=r"group_size=32.*group_size=64"):
        net.load_state_dict(sd)
