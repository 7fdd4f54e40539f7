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
torch's key unchanged. Installed when the process makes its first quantized
tensor (:func:`dtensor_quant._core.tensor.on_first_quantized_tensor`), never
by ``import dtensor_quant`` alone.
"""

from __future__ import annotations

import hashlib

from torch.distributed.tensor import DTensor

from .._core.tensor import QuantizedTensor, on_first_quantized_tensor
from .._core.torch_patches import replace

#: torch 2.13.0's ``DTensor._stable_hash_for_caching`` (core.torch_patches.fingerprint of its source).
TORCH_2_13 = "6e6be6a17262cf9f"


def _keyed_by_quantized_local(torch_key):
    def _stable_hash_for_caching(self) -> str:
        key = torch_key(self)
        local = self._local_tensor
        if isinstance(local, QuantizedTensor):
            both = key + local._stable_hash_for_caching()
            key = hashlib.blake2b(both.encode(), digest_size=16).hexdigest()
        return key

    _stable_hash_for_caching.__doc__ = torch_key.__doc__
    return _stable_hash_for_caching


def install():
    """Install the patch (once); returns it (None only on a torch without the member, with a warning)."""
    return replace(
        "compile_key",
        "torch.compile's cache key of a DTensor names its quantized local tensor",
        {(DTensor, "_stable_hash_for_caching"): (TORCH_2_13, _keyed_by_quantized_local)},
        strict=False,
    )


on_first_quantized_tensor(install)
