"""examples/tp_inference.py: tensor-parallel inference with quantized weights, through torch's own ParallelStyles.

The example's ``build_tp`` runs on the ranks of the session's pools; so does its ``main`` (``session_launcher``).

The reference is the same model quantized on one process. Quantized weights
are compared byte for byte. Outputs are not: the row-parallel all-reduce sums
the ranks' partial products in another order than one process does, and the
CPU's GEMM blocks each shard's shorter sums its own way (MKL's order differs
between AVX-512 and AVX2). One layer is compared within the bound of its
summation (:mod:`dtensor_quant.testing.bounds`); a whole model, whose norms,
softmax and attention no such bound follows, within a model-level tolerance
of the logits' size far above the reordering it measures (fp32: ~1e-7 of the
largest logit against 1e-5; bf16: a few roundings). Greedy tokens must be the
reference's, and where one differs it must be a near-tie that the measured
logit difference explains -- in fp32 too, since on another CPU a reordering
of ~1e-7 may flip an exact-looking tie.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

import dtensor_quant as dq
from dtensor_quant.testing import FORMATS, assert_same_bits, mesh, tiny_llama
from tests.support.examples import tp_inference

PROMPT = torch.randint(0, 1024, (2, 8), generator=torch.Generator().manual_seed(3))


def reference_model(fmt, dtype, seed=0):
    model = tiny_llama.build(tiny_llama.Config(), seed, dtype)
    return dq.quantize_(model, fmt)


def tp_generate(fmt_name, world, quantize_first, sequence_parallel, dtype=torch.float32, new_tokens=6):
    fmt, m = FORMATS[fmt_name], mesh(world)
    pad = world if sequence_parallel else 1
    reference = reference_model(fmt, dtype)
    model = tp_inference.build_tp(
        tiny_llama.Config(), fmt, m, dtype=dtype, quantize_first=quantize_first, sequence_parallel=sequence_parallel
    )
    # Every quantized weight is a DTensor whose local shard has exactly the bytes of the same shard
    # of the one-process quantized weight.
    ref_params = dict(reference.named_parameters())
    for name in dq.quantized_fqns(model):
        p = model.get_parameter(name)
        assert isinstance(p, DTensor), name
        assert_same_bits(p.to_local(), distribute_tensor(ref_params[name], m, p.placements).to_local(), name)
    assert len(dq.quantized_fqns(model)) == 15
    expected = tiny_llama.generate(reference, PROMPT, new_tokens, pad)
    tokens = tiny_llama.generate(model, PROMPT, new_tokens, pad)
    padded = F.pad(expected, (0, -expected.shape[1] % pad))
    with torch.no_grad():
        ref_logits, tp_logits = reference(padded).float(), model(padded).float()
    noise = ((ref_logits - tp_logits).abs().max() / ref_logits.abs().max()).item()
    tie = tp_inference.explain_difference(model, reference, tokens, expected, pad)
    return torch.equal(tokens, expected), noise, tie


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("quantize_first", [True, False])
@pytest.mark.parametrize("fmt_name", ["int8", "int4g128"])
def test_tp_float32_tokens_equal(ranks, fmt_name, quantize_first, sequence_parallel):
    for equal, noise, tie in ranks(2).run(tp_generate, fmt_name, 2, quantize_first, sequence_parallel):
        assert equal or tie["near_tie"], tie
        assert noise < 1e-5, noise


@pytest.mark.parametrize("fmt_name", ["int8", "int4g128"])
def test_tp_bf16_within_rounding(ranks, fmt_name):
    for equal, noise, tie in ranks(2).run(tp_generate, fmt_name, 2, True, True, torch.bfloat16):
        assert noise < tp_inference.ROUNDING_BOUND, noise
        assert equal or tie["near_tie"], tie


def one_token_through_fused_kernels(fmt_name):
    """One decode token on the TP model (every Linear's fused kernel, counted) and on one process, dequantizing."""
    from dtensor_quant._formats import float8, nf4

    calls, originals = [], {module: module.fused_linear for module in (float8, nf4)}
    native = os.environ.get("DTENSOR_QUANT_NATIVE")  # restored after: the ranks live on for other tests

    def counting(original):
        return lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)

    try:
        for module, original in originals.items():
            module.fused_linear = counting(original)
        model = tp_inference.build_tp(tiny_llama.Config(), FORMATS[fmt_name], mesh(2), dtype=torch.bfloat16)
        token = torch.tensor([[7]])
        with torch.no_grad():
            logits = model(token).float()
            os.environ["DTENSOR_QUANT_NATIVE"] = "0"  # the reference: dequantize + mm
            expected = reference_model(FORMATS[fmt_name], torch.bfloat16)(token).float()
    finally:  # the ranks live on for other tests (popping the variable turned the kernels on for all of them)
        if native is None:
            os.environ.pop("DTENSOR_QUANT_NATIVE", None)
        else:
            os.environ["DTENSOR_QUANT_NATIVE"] = native
        for module, original in originals.items():
            module.fused_linear = original
    return len(calls), ((logits - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("fmt_name", ["nf4b32s4", "f8row", "f8block128"])
def test_tp_decode_runs_the_fused_kernels(ranks, fmt_name):
    """TP=2, one bf16 token: all 15 quantized Linears of each rank run NF4's/float8's fused kernel, and the logits
    are one process's (dequantize + mm) up to rounding."""
    from dtensor_quant._formats import float8, nf4

    if nf4.kernel() is None or float8.kernel() is None:
        pytest.skip("no fused kernels here (DTENSOR_QUANT_NATIVE=0, or no AVX2 or C++ compiler)")
    for calls, noise in ranks(2).run(one_token_through_fused_kernels, fmt_name):
        assert calls == 15
        assert noise < tp_inference.ROUNDING_BOUND, noise


@pytest.mark.slow
@pytest.mark.parametrize("fmt_name", ["int8", "int4g128"])
def test_tp_four_ranks(ranks, fmt_name):
    """TP=4: w2 holds 384 = 3 groups of 128 columns per rank, wo 128 = 1 group."""
    for equal, _noise, tie in ranks(4).run(tp_generate, fmt_name, 4, False, True, new_tokens=4):
        assert equal or tie["near_tie"], tie


# -- torch.compile -------------------------------------------------------------------


def compiled_tp(backend, sequence_parallel, dtype):
    """Greedy tokens of the compiled TP model == eager TP model == one-process model (one layer: compile time)."""
    torch._dynamo.reset()
    m, fmt, cfg = mesh(2), FORMATS["int4g128"], tiny_llama.Config(n_layers=1)
    pad = 2 if sequence_parallel else 1
    reference = dq.quantize_(tiny_llama.build(cfg, 0, dtype), fmt)
    model = tp_inference.build_tp(cfg, fmt, m, dtype=dtype, sequence_parallel=sequence_parallel)
    expected = tiny_llama.generate(reference, PROMPT, 3, pad)
    eager = tiny_llama.generate(model, PROMPT, 3, pad)
    compiled_model = torch.compile(model, backend=backend)
    compiled = tiny_llama.generate(compiled_model, PROMPT, 3, pad)
    # TP may flip a token only where the one-process logits nearly tie (test_tp_bf16_within_rounding); so may
    # the compiled graph, whose decompositions (addmm for linear, fused norms) sum and round in other orders
    same = torch.equal(eager, expected)
    near_tie = not same and tp_inference.explain_difference(model, reference, eager, expected, pad)["near_tie"]
    same_compiled = torch.equal(compiled, eager)
    compiled_tie = not same_compiled and tp_inference.explain_difference(compiled_model, model, compiled, eager, pad)
    return same_compiled or compiled_tie["near_tie"], same or near_tie


@pytest.mark.parametrize(
    "backend,sequence_parallel,dtype",
    [
        ("aot_eager", False, torch.float32),
        pytest.param("aot_eager", True, torch.float32, marks=pytest.mark.slow),
        pytest.param("inductor", False, torch.bfloat16, marks=pytest.mark.slow),  # the int4 kernel op inside
    ],
)
@pytest.mark.slow
def test_compiled_tp(ranks, backend, sequence_parallel, dtype):
    for same_as_eager, same_as_reference in ranks(2).run(compiled_tp, backend, sequence_parallel, dtype):
        assert same_as_eager and same_as_reference


# -- the example, as a user runs it -------------------------------------------------


@pytest.mark.slow
def test_example_generates_the_reference_tokens(session_launcher, capsys):
    argv = ["--world", "2", "--format", "int4:128", "--tokens", "4", "--layers", "1", "--sequence-parallel"]
    assert tp_inference.main(argv) == 0
    out = capsys.readouterr().out
    assert "tokens equal to the one-process quantized model on every rank" in out
    assert "(0.266x)" in out  # int4 with a bf16 scale and zero per 128 weights: 0.5 + 4/128 bytes vs 2


def compiled_decode(fmt_name, dtype):
    """One-token forward of the inductor-compiled TP model against eager, quantized and dense alike.

    Returns the largest logit difference (relative to the largest logit) of the
    quantized and of the dense bf16 model, compiled vs eager: inductor fuses
    the norms, RoPE and SwiGLU in fp32 and rounds to the dtype less often than
    eager does, so the two differ by the dtype's rounding, for both models.
    """
    torch._dynamo.reset()
    m, cfg = mesh(torch.distributed.get_world_size()), tiny_llama.Config(n_layers=1)
    token = torch.tensor([[5]])
    diffs = []
    # Another format's graph of the same model (another test on this pool) is not reused: torch_fixes keys a
    # DTensor by its quantized local too (docs/performance.md, "Compiled decode").
    with torch.no_grad():
        for fmt in (FORMATS[fmt_name], None):
            model = tp_inference.build_tp(cfg, fmt, m, dtype=dtype)
            eager = model(token).float()
            compiled = torch.compile(model, backend="inductor")(token).float()
            diffs.append(((compiled - eager).abs().max() / eager.abs().max()).item())
            same_token = torch.equal(compiled.argmax(-1), eager.argmax(-1))
            diffs.append(same_token)
    return diffs


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,fmt_name,dtype",
    [
        (1, "int8", torch.bfloat16),
        (2, "int4g128", torch.bfloat16),
        (2, "int8", torch.float32),
    ],
)
def test_compiled_one_token_decode_matches_eager(ranks, world, fmt_name, dtype):
    """Compiled decode (inductor, DTensor of QuantizedTensor weights) gives eager's logits up to the dtype's rounding.

    fp32: within 1e-5 of the largest logit (summation order only). bf16: within 2e-2
    (bf16 keeps 8 bits: a few roundings of a logit), the same bound the dense model
    compiled the same way must meet; the greedy token is the same either way.
    """
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for quant, quant_same, dense, dense_same in ranks(world).run(compiled_decode, fmt_name, dtype, timeout=900):
        assert quant <= tol, f"compiled quantized logits differ from eager by {quant:.2e} (dense: {dense:.2e})"
        assert dense <= tol and quant_same and dense_same
