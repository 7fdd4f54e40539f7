"""model/vocab_padding on TP ranks: the gathered output sliced to the real vocabulary, a rank's slice of the padded
logits masked (the models and the bound: tests/model/test_vocab_padding.py).
"""

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import dtensor_quant as dq
from dtensor_quant._model.vocab_padding import mask_padded_logits
from dtensor_quant.testing import mesh
from tests.model.test_vocab_padding import BLOCKS, BLOCKS_PADDED, FP8B, assert_logits_close, head_input, tiny, tokens

pytest.importorskip("transformers", reason="the vocabulary tests pad a transformers model")


def tp_logits(gathered: bool):
    ref = dq.quantize_(tiny(tied=False, vocab=BLOCKS), FP8B)
    model = copy.deepcopy(ref)
    dq.pad_vocab_for_tp(model, 2)
    style = ColwiseParallel(output_layouts=Replicate()) if gathered else ColwiseParallel()
    parallelize_module(model, mesh(2), {"lm_head": style})
    assert isinstance(model.lm_head.weight, DTensor)
    ids = tokens()
    h = head_input(ref, ids)
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
        # a rank that computes its own slice of the padded logits as a plain tensor (no style hook)
        rows = model.lm_head.weight.to_local().dequantize(torch.float32)
        masked = mask_padded_logits(model.lm_head, (h,), h @ rows.t())
    return got, want, h, ref.lm_head.weight.dequantize(torch.float32), masked


def test_tp_gathered_logits_are_sliced(ranks):
    for got, want, h, head, _ in ranks(2).run(tp_logits, True):
        assert_logits_close(got, want, h, head)


def test_tp_sharded_logits_are_those_of_the_real_vocabulary(ranks):
    """ColwiseParallel's sharded output: each rank holds its half of the 1152 real logits, none of the padding."""
    (got0, want, h, head, masked0), (got1, *_, masked1) = ranks(2).run(tp_logits, False)
    assert got0.shape[-1] == got1.shape[-1] == BLOCKS // 2
    assert_logits_close(torch.cat([got0, got1], -1), want, h, head)
    # a plain slice: rank 1's rows 640..1279 hold 128 padded ones, their logits are -inf
    half = BLOCKS_PADDED // 2
    assert masked0.isfinite().all() and masked1[..., BLOCKS - half :].eq(float("-inf")).all()
    assert_logits_close(torch.cat([masked0, masked1], -1)[..., :BLOCKS], want, h, head)
