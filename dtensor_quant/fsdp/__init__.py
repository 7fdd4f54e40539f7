"""FSDP2 with quantized parameters (``dq.fsdp``).

``fully_shard`` makes the checks FSDP2 cannot make (every rank, before any
collective) and calls torch's ``fully_shard``; FSDP2 then all-gathers each
quantized parameter as its stored bytes through the all-gather hooks the
layout derives. ``GatherQuantized`` / ``gather_quantized_`` keep trainable
dense weights whose all-gather is quantized. The implementation lives in the
private ``dtensor_quant._fsdp``.
"""

from .._fsdp import (
    GatherMeta,
    GatherQuantized,
    check_fully_shard,
    dequantized_from,
    fully_shard,
    gather_quantized_,
    install_fsdp_post_forward_reshard,
    post_all_gather,
    pre_all_gather,
    quantized_params,
    record_tensor_parallel,
)

__all__ = [
    "GatherMeta",
    "GatherQuantized",
    "check_fully_shard",
    "dequantized_from",
    "fully_shard",
    "gather_quantized_",
    "install_fsdp_post_forward_reshard",
    "post_all_gather",
    "pre_all_gather",
    "quantized_params",
    "record_tensor_parallel",
]
