"""Whole models, private: ``quantize_``, LoRA adapters, tensor-parallel plans and padding, the mesh planner.

The public entry points are exported by the package root (``dq.quantize_``,
``dq.adapt_tp_plan``, ``dq.pad_for_tp``) and by :mod:`dtensor_quant.lora`,
:mod:`dtensor_quant.planner`, :mod:`dtensor_quant.training`.
"""
