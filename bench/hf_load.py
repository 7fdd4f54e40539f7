"""Loading a Hugging Face checkpoint into a quantized TP-2 model: peak memory and time per rank, one run.

    python bench/hf_load.py [--world 2] [--format int8] [--hidden 1024] [--intermediate 3072] [--layers 4]
                            [--vocab 32000] [--repeat 3] [--dir DIR]

A random Llama of that size is written once with ``save_pretrained`` (bf16,
sharded index). Then, in fresh ranks each time and interleaved ``repeat``
times, every rank builds the quantized tensor-parallel model two ways:

* ``dq.hf.load``: parameters on meta, ``quantize_``, transformers' TP plan,
  ``materialize``, then each rank reads and quantizes its own slices;
* baseline: ``from_pretrained`` of the dense model on every rank, then
  ``quantize_`` and the same TP plan (the only way in before ``dq.hf``).

It prints, per rank, the median peak resident memory the load adds (RSS
sampled every millisecond, minus the RSS before it) and the median time,
each as a ratio to the baseline measured in the same run, and the bytes each
rank read against the size of the checkpoint's files. Both models are checked
to hold the same quantized bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import dtensor_quant as dq
from dtensor_quant._model.format_spec import parse_format
from dtensor_quant.testing.rank_pool import run


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Peak resident memory above the level at entry, sampled every millisecond by a thread."""

    def __enter__(self):
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def added(self) -> int:
        return self.peak - self.base


def _load(path, cls, config, fmt, mesh, how):
    start = time.perf_counter()
    if how == "hf":
        with dq.hf.init_empty():
            model = cls(config)
        model.to(torch.bfloat16)
        dq.quantize_(model, fmt)
        parallelize_module(model, mesh, dq.hf.tp_plan(model))
        dq.hf.materialize(model, "cpu")
        read = dq.hf.load(model, path).bytes_read
    else:
        model = cls.from_pretrained(path, dtype=torch.bfloat16)
        dq.quantize_(model, fmt)
        parallelize_module(model, mesh, dq.hf.tp_plan(model))
        read = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    return model, read, time.perf_counter() - start


def build(path: str, fmt_name: str, how: str) -> dict:
    import transformers

    fmt = parse_format(fmt_name)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, config.architectures[0])
    torch.set_num_threads(1)
    for _ in ("warm-up", "measured"):  # the first pays for lazy imports and first-use caches
        model = None
        dist.barrier()
        with PeakRss() as mem:
            model, read, seconds = _load(path, cls, config, fmt, mesh, how)
    locals_ = {n: p._local_tensor if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    digest = [(n, hashlib.sha1(t.qdata.view(torch.uint8).numpy().tobytes()).hexdigest()) for n, t in locals_.items()
              if isinstance(t, dq.QuantizedTensor)]  # fmt: skip
    return {"peak": mem.added, "seconds": seconds, "read": read, "digest": digest,
            "file": sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))}  # fmt: skip


def write(path: Path, args) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cpu"):
        transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="200MB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--format", default="int8")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    # Allocations over 64 KiB are mmapped and given back when freed (glibc otherwise keeps them after the
    # warm-up), so that RSS above the level before a load is what that load holds. The ranks inherit it.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "llama"
        write(path, args)
        runs = {"hf": [], "dense": []}
        for _ in range(args.repeat):  # interleaved: both see the same machine load
            for how, results in runs.items():
                results.append(run(build, args.world, str(path), args.format, how))
    hf, dense = runs["hf"], runs["dense"]
    same = all(r["digest"] == d["digest"] for a, b in zip(hf, dense) for r, d in zip(a, b))
    file_bytes = hf[0][0]["file"]
    print(f"Llama hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab {args.vocab}: "
          f"{file_bytes / 2**20:.1f} MiB bf16 on disk; {args.format}, TP {args.world}, "
          f"{args.repeat} runs (medians)")  # fmt: skip
    print(f"same quantized bytes both ways: {same}")
    print(
        "rank | peak added: dq.hf.load / dense+quantize (ratio) | time: dq.hf.load / dense+quantize (ratio) | "
        "bytes read / file size"
    )
    for rank in range(args.world):
        med = {k: {f: statistics.median(r[rank][f] for r in v) for f in ("peak", "seconds", "read")}
               for k, v in runs.items()}  # fmt: skip
        h, d = med["hf"], med["dense"]
        print(f"{rank:4d} | {h['peak'] / 2**20:8.1f} MiB / {d['peak'] / 2**20:8.1f} MiB "
              f"({h['peak'] / d['peak']:.3f}x) | "
              f"{h['seconds']:6.2f} s / {d['seconds']:6.2f} s ({h['seconds'] / d['seconds']:.3f}x) | "
              f"{h['read'] / file_bytes:.3f}x")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
