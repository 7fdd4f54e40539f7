"""torchao interop (``dq.interop``): torchao's NF4Tensor and per-row Int8Tensor weights as this library's tensors."""

from ._model.interop import from_torchao, from_torchao_

__all__ = ["from_torchao", "from_torchao_"]
