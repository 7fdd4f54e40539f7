"""Checkpoints of quantized models, private: DCP entries (``state_dict``), DCP save/load (``dcp``), Hugging Face
directories (``hf``). The public front is :mod:`dtensor_quant.checkpoint` and :mod:`dtensor_quant.hf`."""
