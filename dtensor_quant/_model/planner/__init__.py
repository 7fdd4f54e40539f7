"""The mesh planner: which tensor-parallel and FSDP degrees a quantized model can take, before any data exists.

One room for one feature, behind the public ``dtensor_quant.planner``
(``dq.planner.plan``) and the ``plan`` command of ``python -m dtensor_quant``:

* ``plan`` -- the entry point (``plan``, ``Plan``);
* ``cells`` -- one weight on one mesh: the verdict, its bytes, the hints, the runtime's head rule;
* ``layers`` -- a model's weights with the styles of its TP plan (``*`` keys as ``parallelize_module`` matches them);
* ``report`` -- the collapsed report, totals and CSV;
* ``verdict`` -- the verdict per mesh after ``adapt_tp_plan`` and padding (``Plan.summary()``);
* ``checkpoint`` -- a pre-quantized checkpoint's formats as stored (``plan --checkpoint``).

Nothing is imported here: ``tp_plan`` and ``format_spec`` use ``cells`` and
``layers`` without loading the rest of the planner.
"""
