"""torchtitan integration (``dq.torchtitan``): trainable quantized weights, AdamW8bit/4bit, checkpoints.

Importing this module imports torchtitan (0.3.0); ``import dtensor_quant``
does not. In a torchtitan config module::

    import dtensor_quant.torchtitan as dqt
    from torchtitan.components.optimizer import ParamGroupConfig

    config.model_spec = model_registry("debugmodel", converters=[dqt.QuantizedLinearConverter.Config(format="int8")])
    config.optimizer = dqt.OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW8bit", optimizer_kwargs={"lr": 8e-4})]
    )
    config.checkpoint = dqt.CheckpointManager.Config(enable=True, folder="checkpoint")

docs/frameworks.md says what runs and what is untested.
"""

from .._frameworks.torchtitan import (
    CheckpointManager,
    OptimizersContainer,
    QuantizedLinearConverter,
    quantized_linear_class,
)

__all__ = ["CheckpointManager", "OptimizersContainer", "QuantizedLinearConverter", "quantized_linear_class"]
