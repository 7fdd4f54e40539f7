"""``save``: every rank computes the same file layout, rank 0 writes the headers, each rank writes its own slices.

Weights in a format's Hugging Face layout are written as stored; every other
weight is dense, with LoRA adapters merged into their base weights on the way.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ...core.tensor import QuantizedTensor
from ..state_dict import canonical_view, entry_placements, entry_shape
from .safetensors_io import INDEX, NAMES, SINGLE, byte_runs
from .tensors import describe, local_slice, local_tensor, model_tensors, stored_suffixes


def _export_tensors(model: nn.Module, dtype: torch.dtype, merge_lora: bool):
    """``(key, dtype, global shape, offset, writes, fetch)`` for every tensor of the export.

    ``fetch()`` makes this rank's slice (dequantized, merged) only when it is
    written, so a rank holds one dense slice at a time.
    """
    for key, lora, t in model_tensors(model):
        writes = _owns(t)
        if key is None:  # an adapter
            if not merge_lora:
                name = next(n for n, p in lora.named_parameters() if p is t)
                yield from _dense_item(_lora_key(model, lora) + name, t, dtype, writes, lambda t=t: local_tensor(t))
            continue
        suffixes = stored_suffixes(t)
        if suffixes is not None and lora is not None and merge_lora:
            raise ValueError(
                f"{key}: merging LoRA adapters changes this {describe(t)} weight, whose stored bytes are "
                "written as they are; save with merge_lora=False (adapters as their own tensors), or merge "
                "into a dense copy of the model"
            )
        if suffixes is not None:  # the stored layout, as it is
            q, inner, to_canonical, shape = canonical_view(t, key)
            for name, rels in q.fmt.layout_for(shape).items():
                g_shape = entry_shape(rels, shape)
                offset, writes_e = (0,) * len(g_shape), writes
                if isinstance(t, DTensor):
                    placements = entry_placements(t.placements, rels, to_canonical)
                    _, offset = compute_local_shape_and_global_offset(g_shape, t.device_mesh, placements)
                    coord = t.device_mesh.get_coordinate()
                    writes_e = writes and all(c == 0 for c, p in zip(coord, placements) if not p.is_shard())
                yield key + suffixes[name], inner[name].dtype, g_shape, offset, writes_e, lambda x=inner[name]: x
            continue
        if lora is not None and merge_lora and t is lora.base.weight:
            fetch = functools.partial(_merged, t, lora, dtype)
        else:
            fetch = functools.partial(local_tensor, t)
        yield from _dense_item(key, t, dtype, writes, fetch)


def _dense_item(key, t, dtype, writes, fetch):
    out_dtype = dtype if t.is_floating_point() else t.dtype

    def cast():
        local = fetch()
        if isinstance(local, QuantizedTensor):
            return local.dequantize(dtype)
        return local.to(out_dtype)

    yield key, out_dtype, tuple(t.shape), local_slice(t)[1], writes, cast


def _lora_key(model: nn.Module, lora: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is lora) + "."


def _merged(weight: torch.Tensor, lora, dtype: torch.dtype) -> torch.Tensor:
    """This rank's slice of ``W + scaling * B @ A`` in fp32 (adapters are small: DTensor's mm moves them)."""
    a, b = lora.lora_a.weight.detach(), lora.lora_b.weight.detach()
    if isinstance(a, DTensor) != isinstance(b, DTensor):
        raise ValueError("LoRA adapters of one layer must both be DTensors or both plain tensors to merge")
    delta = torch.mm(b.float(), a.float()) * lora.scaling
    if isinstance(weight, DTensor):
        if not isinstance(delta, DTensor):
            delta = distribute_tensor(delta, weight.device_mesh, weight.placements, src_data_rank=None)
        elif delta.device_mesh != weight.device_mesh:
            raise ValueError("the LoRA adapters live on another mesh than their base weight; cannot merge")
        delta = delta.redistribute(weight.device_mesh, weight.placements)._local_tensor
    base = local_tensor(weight)
    base = base.dequantize(torch.float32) if isinstance(base, QuantizedTensor) else base.float()
    return (base + delta).to(dtype)


def _owns(t: torch.Tensor) -> bool:
    """Whether this rank writes ``t``'s slice: the first replica of it (a plain tensor: rank 0)."""
    if not isinstance(t, DTensor):
        return not dist.is_initialized() or dist.get_rank() == 0
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, t.placements) if not p.is_shard())


def save(
    model: nn.Module,
    path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    merge_lora: bool = True,
    max_shard_bytes: int = 5 << 30,
) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory that ``from_pretrained`` reads.

    Every rank calls it; each writes the bytes of its own slices. Weights in a
    format with a Hugging Face layout (``checkpoint_suffixes``, e.g. FP8 block
    scales) are written as stored, with the format's ``quantization_config``;
    every other weight is dense ``dtype``. LoRA adapters (:mod:`dtensor_quant.lora`)
    are merged into their weights (``merge_lora``; otherwise written as
    ``<layer>.lora_a.weight``/``lora_b.weight`` beside the base weight).
    ``model.config`` (transformers) is saved alongside. Files over
    ``max_shard_bytes`` are split with an index.
    """
    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    items = list(_export_tensors(model, dtype, merge_lora))
    files = _layout(items, max_shard_bytes)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        # A previous export's files would otherwise stay, and a stale index would point readers at them.
        for stale in [*path.glob("*.safetensors"), path / INDEX]:
            stale.unlink(missing_ok=True)
        for name, (header, size) in files.items():
            with open(path / name, "wb") as f:
                f.write(header)
                f.truncate(size)
        if len(files) > 1:
            weight_map = {k: name for name, (h, _) in files.items() for k in _keys(h)}
            total = sum(size - len(h) for h, size in files.values())
            (path / INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        _save_config(model, path)
    if dist.is_initialized():
        dist.barrier()
    where = {k: (name, len(h) + e["data_offsets"][0]) for name, (h, _) in files.items() for k, e in _keys(h).items()}
    fds = {}
    try:
        for key, g_dtype, g_shape, offset, writes, fetch in items:
            local = fetch()  # on every rank: merging adapters may need a collective
            if not writes or local.numel() == 0:
                continue
            name, start = where[key]
            fd = fds.get(name) or fds.setdefault(name, os.open(path / name, os.O_WRONLY))
            data = local.contiguous().reshape(-1).view(torch.uint8).numpy()
            for pos, at, n in byte_runs(g_shape, offset, tuple(local.shape), g_dtype.itemsize):
                os.pwrite(fd, memoryview(data)[pos : pos + n], start + at)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    if dist.is_initialized():
        dist.barrier()


def _keys(header: bytes) -> dict:
    return {k: v for k, v in json.loads(header[8:]).items() if k != "__metadata__"}


def _layout(items, max_shard_bytes: int) -> dict[str, tuple[bytes, int]]:
    """File name -> (header bytes, file size), the same on every rank."""
    groups, size = [[]], 0
    for key, g_dtype, g_shape, *_ in items:
        n = math.prod(g_shape) * g_dtype.itemsize
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((key, g_dtype, g_shape, n))
        size += n
    out = {}
    for i, group in enumerate(groups, 1):
        name = SINGLE if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        header, at = {"__metadata__": {"format": "pt"}}, 0
        for key, g_dtype, g_shape, n in group:
            header[key] = {"dtype": NAMES[g_dtype], "shape": list(g_shape), "data_offsets": [at, at + n]}
            at += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
        out[name] = (struct.pack("<Q", len(text)) + text, 8 + len(text) + at)
    return out


def _save_config(model: nn.Module, path: Path) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    quant = {}
    for _, _, t in model_tensors(model):
        if stored_suffixes(t) is not None:
            local = t._local_tensor if isinstance(t, DTensor) else t
            quant = local.fmt.hf_quantization_config or quant
    previous = getattr(config, "quantization_config", None)
    if quant:
        config.quantization_config = quant
    try:
        config.save_pretrained(path)
    finally:
        if quant:
            config.quantization_config = previous
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(path)
