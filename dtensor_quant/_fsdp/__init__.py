"""FSDP2 with quantized parameters: all-gather hooks, ``fully_shard`` checks, trainable weights gathered quantized.

``all_gather`` holds the hooks FSDP2 calls on a quantized local tensor (an
uneven shard's padded rows are in its notes, :mod:`dtensor_quant._core.notes`),
``fully_shard`` the up-front checks, ``gather_quantized`` the dense master
weights whose all-gather is quantized, and ``reshard_after_forward`` the
scoped patch that lets FSDP2 keep a quantized post-forward shard.
"""

from .all_gather import GatherMeta, dequantized_from, post_all_gather, pre_all_gather
from .fully_shard import check_fully_shard, fully_shard, quantized_params, record_tensor_parallel
from .gather_quantized import GatherQuantized, gather_quantized_
from .reshard_after_forward import install_fsdp_post_forward_reshard

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
