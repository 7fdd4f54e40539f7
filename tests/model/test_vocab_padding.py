"""model/vocab_padding: dq.pad_vocab_for_tp, the output head's rows padded so every rank's slice is legal.

Real cases: NF4 at TP 8 refuses Qwen2.5-1.5B's 151936-row head (hidden 1536:
a factor covers 32 rows, 18992 rows per rank) and Phi-3-mini's 32064 rows
(hidden 3072: 16 rows, 4008 per rank); 152064 and 32128 are legal. The tiny
models here have the same problem at TP 2: Float8Blockwise(128) needs
multiples of 128 rows per rank, and 1000 rows give 500 (padded to 1024),
1152 rows (9 blocks, as Llama-2's 32000 = 250 blocks at TP 4) 576 (padded
to 1280, one more block).

Logits over the real vocabulary are compared with a bound derived from the
summation (a matmul over more rows may block the same dot products
differently): two orders of summing ``hidden`` terms differ by at most
``2 * hidden * eps * sum |x_k w_k|``.
"""

import copy

import pytest
import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import Shard

import dtensor_quant as dq
from dtensor_quant._model.vocab_padding import vocab_length
from dtensor_quant.testing import assert_same_bits

transformers = pytest.importorskip("transformers", reason="the vocabulary tests pad a transformers model")

VOCAB, HIDDEN, PADDED = 1000, 256, 1024
BLOCKS, BLOCKS_PADDED = 1152, 1280  # whole 128-row blocks: padded after quantizing by one more block
FP8B = dq.Float8Blockwise(128)


def tiny(tied: bool, dtype=torch.float32, vocab=VOCAB):
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=128, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).to(dtype).eval()


def tokens(vocab=VOCAB):
    return torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(1))


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, hidden_states: torch.Tensor, head: torch.Tensor):
    """Within two summation orders of each other: ``2 * hidden * eps * (|h| @ |W|^T)``."""
    assert got.shape == want.shape, (got.shape, want.shape)
    bound = 2 * HIDDEN * torch.finfo(torch.float32).eps * (hidden_states.abs() @ head.abs().t())
    assert (got - want).abs().le(bound).all(), (got - want).abs().max()


def head_input(model, ids):
    with torch.no_grad():
        return model.model(ids).last_hidden_state


def test_real_models_refused_and_padded_lengths():
    for vocab, hidden, padded in ((151936, 1536, 152064), (32064, 3072, 32128)):
        with pytest.raises(dq.LayoutError):
            dq.check_placements((vocab, hidden), dq.NF4(), (8,), [Shard(0)])
        assert vocab_length(vocab, hidden, dq.NF4(), 8) == padded
        dq.check_placements((padded, hidden), dq.NF4(), (8,), [Shard(0)])
    # vLLM rounds to a multiple of 64: 32064 is one and still refused, so that is an option, not the default
    assert 32064 % 64 == 0 and vocab_length(32064, 3072, dq.NF4(), 8, multiple=64) == 32128
    assert vocab_length(151936, 1536, dq.NF4(), 8, multiple=1024) == 152576  # 149 x 1024, 596 x 32 rows per rank
    assert vocab_length(VOCAB, HIDDEN, None, 2) == VOCAB and vocab_length(VOCAB, HIDDEN, None, 2, 64) == 1024


def test_tied_dense_model_logits_and_generation_unchanged():
    ref = tiny(tied=True)
    model = copy.deepcopy(ref)
    done = dq.pad_vocab_for_tp(model, 2, FP8B)
    assert done == {"lm_head": (VOCAB, PADDED), "model.embed_tokens": (VOCAB, PADDED)}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert model.lm_head.weight.shape == (PADDED, HIDDEN) and model.model.embed_tokens.num_embeddings == PADDED
    assert model.lm_head.weight[VOCAB:].count_nonzero() == 0
    assert torch.equal(model.lm_head.weight[:VOCAB], ref.lm_head.weight)
    assert model.lm_head.tp_padding.tolist() == [VOCAB, PADDED]
    ids = tokens()
    with torch.no_grad():
        got, want = model(ids, labels=ids), ref(ids, labels=ids)
    assert got.logits.shape[-1] == VOCAB  # the padded logits are sliced away
    assert_logits_close(got.logits, want.logits, head_input(ref, ids), ref.lm_head.weight)
    assert torch.allclose(got.loss, want.loss, rtol=1e-5)
    generate = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **generate), ref.generate(ids, **generate))


def test_quantized_head_padded_after_quantizing_keeps_its_bytes():
    ref = dq.quantize_(tiny(tied=False, vocab=BLOCKS), FP8B)
    with pytest.raises(dq.LayoutError):
        dq.check_placements(tuple(ref.lm_head.weight.shape), FP8B, (2,), [Shard(0)])
    model = copy.deepcopy(ref)
    assert dq.pad_vocab_for_tp(model, 2) == {"lm_head": (BLOCKS, BLOCKS_PADDED)}  # the weight gives its format
    w = model.lm_head.weight
    assert_same_bits(w.narrow(0, 0, BLOCKS), ref.lm_head.weight, "lm_head")
    assert w.narrow(0, BLOCKS, BLOCKS_PADDED - BLOCKS).dequantize().count_nonzero() == 0
    dq.check_placements(tuple(w.shape), FP8B, (2,), [Shard(0)])
    assert model.model.embed_tokens.num_embeddings == BLOCKS  # untied: the dense embedding is left alone
    ids = tokens()
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    head = ref.lm_head.weight.dequantize(torch.float32)
    assert_logits_close(got, want, head_input(ref, ids), head)
    assert dq.pad_vocab_for_tp(model, 2) == {}  # already legal: nothing to do


def test_pad_before_quantizing_where_blocks_would_change():
    """A partial last block (1000 rows = 7 blocks and 104 rows) or NF4's mean: refused once quantized, unchanged.

    Padded dense, then quantized: Float8Blockwise's block maxima ignore zero
    rows, so the real rows quantize to the same bytes; NF4's mean over the
    whole weight moves, so its real rows keep their codes but not their scales.
    """
    for fmt in (FP8B, dq.NF4()):
        model = dq.quantize_(tiny(tied=False), fmt)
        before = model.lm_head.weight
        with pytest.raises(ValueError, match="Pad the dense model"):
            dq.pad_vocab_for_tp(model, 2)
        assert model.lm_head.weight is before and not hasattr(model.lm_head, "tp_padding")
    ref = dq.quantize_(tiny(tied=False), FP8B)
    model = tiny(tied=False)
    assert dq.pad_vocab_for_tp(model, 2, FP8B) == {"lm_head": (VOCAB, PADDED)}
    dq.quantize_(model, FP8B)
    dq.check_placements(tuple(model.lm_head.weight.shape), FP8B, (2,), [Shard(0)])
    assert_same_bits(model.lm_head.weight.narrow(0, 0, VOCAB), ref.lm_head.weight, "lm_head")
    model = tiny(tied=False)
    assert dq.pad_vocab_for_tp(model, 2, dq.NF4()) == {"lm_head": (VOCAB, PADDED)}
    dq.quantize_(model, dq.NF4())
    dq.check_placements(tuple(model.lm_head.weight.shape), dq.NF4(), (2,), [Shard(0)])


def test_refusals():
    with pytest.raises(ValueError, match="no output head"):
        dq.pad_vocab_for_tp(nn.Sequential(nn.Linear(8, 8)), 2, FP8B)
    with pytest.raises(ValueError, match=">= 1"):
        dq.pad_vocab_for_tp(tiny(tied=False), 0, FP8B)


def test_hf_export_writes_the_original_vocabulary(tmp_path):
    ref = dq.quantize_(tiny(tied=False, vocab=BLOCKS), FP8B)
    model = copy.deepcopy(ref)
    dq.pad_vocab_for_tp(model, 2)
    dq.hf.save(model, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert not any("tp_padding" in k for k in f.keys())
        assert tuple(f.get_slice("lm_head.weight").get_shape()) == (BLOCKS, HIDDEN)
    back = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert back.lm_head.weight.shape == (BLOCKS, HIDDEN) and back.config.vocab_size == BLOCKS
    assert torch.equal(back.lm_head.weight, ref.lm_head.weight.dequantize(torch.float32))
    # a padded model reads an unpadded dense checkpoint: zeros past the original vocabulary
    tiny(tied=False, vocab=BLOCKS).save_pretrained(tmp_path / "dense")
    again = dq.quantize_(tiny(tied=False, vocab=BLOCKS), FP8B)
    dq.pad_vocab_for_tp(again, 2)
    dq.hf.load(again, tmp_path / "dense")
    assert_same_bits(again.lm_head.weight.narrow(0, 0, BLOCKS), ref.lm_head.weight, "lm_head")
    assert again.lm_head.weight.narrow(0, BLOCKS, BLOCKS_PADDED - BLOCKS).dequantize().count_nonzero() == 0


def test_tied_dense_export(tmp_path):
    model = tiny(tied=True)
    dq.pad_vocab_for_tp(model, 2, FP8B)
    dq.hf.save(model, tmp_path / "out", dtype=torch.float32)
    back = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert back.model.embed_tokens.weight.shape == (VOCAB, HIDDEN) and back.config.tie_word_embeddings
    assert torch.equal(back.lm_head.weight, model.lm_head.weight[:VOCAB])
