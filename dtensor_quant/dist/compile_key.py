"""torch.compile's cache key of a DTensor whose local tensor is quantized.

torch 2.13's ``DTensor._stable_hash_for_caching``
(``torch/distributed/tensor/_api.py``) hashes the DTensor's spec (mesh,
placements, logical shape, stride, dtype) and ``requires_grad``, never its
local tensor. Two models whose weights differ only in format (Int8Rowwise,
then Int4Groupwise(128), of the same Linear) give the same dynamo graph and
the same key, so the second ``torch.compile`` is served the first one's
compiled code. Where the inner shapes differ it fails in
``assert_size_stride``; where they coincide it runs the wrong kernel. The
patch adds the local tensor's own key
(:meth:`QuantizedTensor._stable_hash_for_caching`: format, relations, inner
dtypes and shapes) when the local tensor is quantized; dense DTensors keep
torch's key unchanged. Installed on import.
"""

from __future__ import annotations

import hashlib

from torch.distributed.tensor import DTensor

from ..core.tensor import QuantizedTensor


def _key_dtensor_by_quantized_local() -> None:
    torch_key = DTensor._stable_hash_for_caching
    if getattr(torch_key, "keys_quantized_local", False):
        return  # already installed (the module was reloaded)

    def _stable_hash_for_caching(self) -> str:
        key = torch_key(self)
        local = self._local_tensor
        if isinstance(local, QuantizedTensor):
            both = key + local._stable_hash_for_caching()
            key = hashlib.blake2b(both.encode(), digest_size=16).hexdigest()
        return key

    _stable_hash_for_caching.keys_quantized_local = True
    _stable_hash_for_caching.__doc__ = torch_key.__doc__
    DTensor._stable_hash_for_caching = _stable_hash_for_caching


if hasattr(DTensor, "_stable_hash_for_caching"):
    _key_dtensor_by_quantized_local()


if hasattr(DTensor, "_stable_hash_for_caching"):
    _key_dtensor_by_quantized_local()
