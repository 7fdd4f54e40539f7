"""core/format_ids: a stable integer id per format, which custom ops take and torch.compile treats as constant."""

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant._core.format_ids import format_from_id, format_id
from dtensor_quant.testing import FORMATS


def test_format_ids_are_stable_and_distinct():
    ids = {name: format_id(f) for name, f in FORMATS.items()}
    assert len(set(ids.values())) == len(ids)
    assert format_id(dq.Int4Groupwise(64)) == ids["int4g64"]  # equal formats, same id
    assert all(format_from_id(i) == FORMATS[n] for n, i in ids.items())
    with pytest.raises(ValueError, match="unknown format id"):
        format_from_id(12345)


def test_format_id_is_marked_constant_the_way_torch_compiler_marks_it():
    from dtensor_quant._core.format_ids import format_id

    def probe():
        pass

    marked = torch.compiler.assume_constant_result(probe)
    added = {k: v for k, v in vars(marked).items()}
    assert added and all(getattr(format_id, k, None) == v for k, v in added.items()), added
