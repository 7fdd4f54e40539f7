"""The data model: relations, the format protocol, the tensor and its op table.

Nothing here knows an op, a collective or a format: ``layout`` (how inner
tensors follow logical dims), ``format`` (what a format declares),
``tensor`` (``QuantizedTensor``), ``dispatch`` (the handler table every op
goes through, filled by the layers above on import), ``registry`` (the
slots a lower layer calls and an upper one provides on import), and the leaf helpers the
formats use (``reductions``, ``native``).
"""
