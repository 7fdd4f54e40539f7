"""dtensor_quant demo: a quantized weight through DTensor on 2 local CPU ranks.

    python examples/demo.py

Quantizes a 2048x2048 bf16 weight with each built-in format, distributes it
over 2 gloo ranks, redistributes it between row and column sharding, gathers
it back and prints, for each step, the bytes each rank sent against the same
DTensor in bf16 and whether the gathered weight is bit-identical to the
single-process quantized weight.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_quant as dq
from dtensor_quant import wire
from dtensor_quant.launch import run

SHAPE = (2048, 2048)
FORMATS = [None, dq.Int8Rowwise(), dq.Int4Groupwise(128)]


def same_bits(a: dq.QuantizedTensor, b: dq.QuantizedTensor) -> bool:
    return all(
        torch.equal(getattr(a, n).contiguous().view(torch.uint8), getattr(b, n).contiguous().view(torch.uint8))
        for n in b.fmt.inner_names
    )


def story():
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    weight = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    rows = []
    for fmt in FORMATS:
        full = weight if fmt is None else dq.quantize(weight, fmt)
        with wire.record() as scatter:
            dt = distribute_tensor(full, mesh, [Shard(0)])
        with wire.record() as move:
            dt = dt.redistribute(mesh, [Shard(1)])
        with wire.record() as gather:
            back = dt.full_tensor()
        exact = torch.equal(back, full) if fmt is None else same_bits(back, full)
        local = dt.to_local()
        local_bytes = local.numel() * local.element_size() if fmt is None else local.nbytes_stored
        rows.append((str(fmt or "bf16"), local_bytes, scatter.nbytes, move.nbytes, gather.nbytes, exact))
    return rows


def main():
    print(f"dtensor_quant demo: a {SHAPE[0]}x{SHAPE[1]} bf16 weight on 2 local CPU ranks (gloo)")
    print("starting 2 ranks ...", flush=True)
    rows = run(story, 2)[0]
    base = rows[0]
    head = ["format", "bytes per rank", "scatter to S0", "S0 -> S1", "full_tensor", "bit-exact"]
    print("\n" + f"{head[0]:<31}" + "".join(f"{h:>20}" for h in head[1:5]) + f"{head[5]:>11}")
    for name, local, scatter, move, gather, exact in rows:
        cells = [f"{v / 2**20:.2f} MiB ({v / b:.2f}x)" for v, b in zip((local, scatter, move, gather), base[1:5])]
        print(f"{name:<31}" + "".join(f"{c:>20}" for c in cells) + f"{str(exact):>11}")
    print("\nbytes are what each rank sent (wire.record), ratios against the same DTensor in bf16")


if __name__ == "__main__":
    main()
