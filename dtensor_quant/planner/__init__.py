"""The mesh planner (``dq.planner``; ``python -m dtensor_quant plan``): which TP/FSDP degrees a model allows.

``plan(source, fmt, ...)`` checks every weight of a model (a transformers
config, a model, or shapes) on every mesh before any data exists and returns
a :class:`Plan`: each weight's verdict, bytes per rank, the nearest legal
degree and what would make an illegal one legal (the column-parallel switch,
the smallest zero-padding). ``parse_format`` reads a format from its
command-line spelling (``int4:128,float16``).
"""

from .._model.format_spec import parse_format
from .._model.planner.plan import Plan, plan

__all__ = ["Plan", "parse_format", "plan"]
