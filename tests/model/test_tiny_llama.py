"""The example model's attention: grouped-query attention inside SDPA is the k/v repeat it replaces, bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from dtensor_quant.testing import tiny_llama


def _repeated_kv_attention(attn: tiny_llama.Attention, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The attention as written before ``enable_gqa``: k and v repeated per query head, then SDPA."""
    bsz, seq, _ = x.shape
    q = attn.wq(x).view(bsz, seq, -1, attn.head_dim)
    k = attn.wk(x).view(bsz, seq, -1, attn.head_dim)
    v = attn.wv(x).view(bsz, seq, -1, attn.head_dim)
    q, k = tiny_llama.apply_rope(q, freqs), tiny_llama.apply_rope(k, freqs)
    k, v = k.repeat_interleave(attn.n_rep, dim=2), v.repeat_interleave(attn.n_rep, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return attn.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n_kv_heads", [1, 2, 8])
@pytest.mark.parametrize("seq", [1, 7, 32])
def test_gqa_attention_is_the_repeated_kv_attention(dtype, n_kv_heads, seq):
    cfg = tiny_llama.Config(dim=128, n_heads=8, n_kv_heads=n_kv_heads, hidden_dim=256, max_seq_len=32, n_layers=1)
    model = tiny_llama.build(cfg, seed=3, dtype=dtype)
    x = torch.randn(2, seq, cfg.dim, generator=torch.Generator().manual_seed(seq)).to(dtype)
    freqs = model.freqs[:seq]
    attn = model.layers[0].attention
    with torch.no_grad():
        assert torch.equal(attn(x, freqs), _repeated_kv_attention(attn, x, freqs))
