"""LoRA adapters on quantized weights (``dq.lora``): QLoRA under FSDP2 and tensor parallelism, and merging.

``add_lora_`` wraps each Linear in a :class:`LoRALinear` (frozen quantized
base, trainable dense adapters); ``lora_parameters`` lists the adapters and
``lora_tp_plan`` extends a TP plan to them. ``merge_and_unload`` merges PEFT
adapters into quantized weights; ``peft_config`` registers this
library's LoRA layer in a PEFT ``LoraConfig``, so that PEFT's own
``merge_and_unload()`` merges into quantized weights too.
"""

from .._model.lora import LoRALinear, add_lora_, lora_parameters, lora_tp_plan, peft_config
from .._model.peft_merge import merge_and_unload

__all__ = ["LoRALinear", "add_lora_", "lora_parameters", "lora_tp_plan", "merge_and_unload", "peft_config"]
