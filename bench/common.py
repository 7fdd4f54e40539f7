"""What several benchmarks need and none of them measures: the optional plotting and torchao imports, CSV output,
a parallelized Linear layer.

The benchmarks run as scripts (``python bench/<name>.py``), so this directory
is on ``sys.path`` and they ``import common``.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch
from torch import nn


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (with a note) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'dtensor_quant[bench]'); no plot written")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def torchao_nf4():
    """torchao's ``to_nf4`` (0.18's module path, then the older one), or None when torchao is not installed."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import to_nf4
        except ImportError:
            return None
    return to_nf4


def write_csv(rows: list[dict], path: Path) -> None:
    """``rows`` (one dict per measurement, the first one's keys as the header) to ``path``, its folder made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def linear(out_f: int, in_f: int, fmt, mesh=None, style=None, seed: int = 0) -> nn.Module:
    """A bias-free bf16 ``Linear`` with N(0, 1/in_f) weights from ``seed``, quantized with ``fmt`` (None: bf16)
    and, given a ``style`` class (``ColwiseParallel``, ``RowwiseParallel``), parallelized over ``mesh``."""
    g = torch.Generator().manual_seed(seed)
    module = nn.Linear(in_f, out_f, bias=False)
    with torch.no_grad():
        module.weight.copy_(torch.randn(out_f, in_f, generator=g) * in_f**-0.5)
    module = module.to(torch.bfloat16)
    if fmt is not None:
        import dtensor_quant as dq

        dq.quantize_(module, fmt)
    if style is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        module = parallelize_module(module, mesh, style())
    return module
