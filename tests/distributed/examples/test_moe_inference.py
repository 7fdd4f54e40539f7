"""examples/moe_inference.py: a tiny transformers MoE served with quantized experts over 2 and 4 ranks."""

import pytest

from tests.support.examples import moe_inference


def _run(ranks, world, argv):
    args = moe_inference.parse_args(["--world", str(world), *argv])
    results = ranks(world).run(moe_inference.run, args)
    return args, results


@pytest.mark.parametrize(
    "world,argv",
    [
        (2, ["--model", "mixtral", "--format", "int8"]),
        (4, ["--model", "qwen3_moe", "--format", "nf4:64,64"]),
        pytest.param(4, ["--model", "mixtral", "--experts", "3", "--format", "int4:64"], marks=pytest.mark.slow),
        pytest.param(2, ["--model", "qwen3_moe", "--format", "float8rowwise"], marks=pytest.mark.slow),
    ],
)
def test_expert_parallel_logits_bit_identical(ranks, world, argv):
    args, results = _run(ranks, world, argv)
    assert all(r["tokens_equal"] and r["logits_equal"] for r in results), results
    assert moe_inference.report(args, results)
    # every rank holds only its experts, as quantized bytes
    assert sum(r["experts_here"][0] for r in results) == args.experts


def test_expert_and_tensor_parallel_tokens_equal(ranks):
    _, results = _run(ranks, 4, ["--tp", "2", "--format", "int4:64"])
    # partial sums added in another order (by the CPU's GEMM too): a token may differ only at a near-tie
    assert all(r["tokens_equal"] or r["near_tie"] for r in results), results
    assert max(r["max_logit_diff"] for r in results) < 0.05  # a model-level tolerance: a few bf16 roundings


@pytest.mark.slow
def test_main_smoke(session_launcher):
    assert moe_inference.main(["--world", "2", "--tokens", "3"]) == 0
