"""torchtitan's own components driven as a user script would, on the ranks of a pool (importable by them).

torchtitan's trainer needs CUDA-only pieces and a tokenizer/dataset stack, so
this builds its Llama3 debug model (2 layers) the way ``Trainer.__init__``
does: the model config from ``model_registry`` with the library's converter,
its sharding config, the meta build, ``parallelize_llama``, ``to_empty``,
``init_weights``; then torchtitan's optimizer container (the library's
subclass, ``AdamW8bit``) and its DCP ``CheckpointManager`` (the library's
subclass). The device type is a module attribute in torchtitan: set to
``cpu`` here. Each rank returns every weight's and optimizer state's full
stored bytes, so the test process compares runs byte for byte.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

VOCAB, SEQ, BATCH = 2048, 16, 4  # the debug model's vocabulary; a global batch of 4 sequences


def _cpu() -> None:
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as utils

    utils.device_type = parallel_dims.device_type = "cpu"


def build(dp: int, tp: int, fmt: str = "int8", layers: int = 2, backend: str = "partial_dtensor", dense=()):
    """The converted, parallelized, initialised debug model and its ParallelDims (torchtitan's order)."""
    _cpu()
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.parallelize import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    import dtensor_quant.torchtitan as dqt

    converter = dqt.QuantizedLinearConverter.Config(format=fmt, seed=3, filter_fqns=list(dense))
    spec = model_registry("debugmodel", converters=[converter])
    config = spec.model
    config.layers = config.layers[:layers]
    for layer in config.layers:  # FlexAttention has no backward on CPU: the maskless SDPA config (causal)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp, tensor_parallel_degree=tp, spmd_backend=backend)
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)  # update_from_config's part
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    with torch.device("meta"):
        model = config.build()
    training = TrainingConfig(mixed_precision_param="float32", seq_len=SEQ, local_batch_size=BATCH // dp)
    model = parallelize_llama(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    for module in model.modules():  # torchtitan's divide factor 1.0 makes FSDP2 reduce with PREMUL_SUM: not on gloo
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model, dims


def optimizer(model, name: str = "AdamW8bit"):
    from torchtitan.components.optimizer import ParamGroupConfig

    import dtensor_quant.torchtitan as dqt

    kwargs = {"lr": 3e-3, "weight_decay": 0.1, "block_size": 128} if name != "AdamW" else {"lr": 3e-3}
    config = dqt.OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name=name, optimizer_kwargs=kwargs)]
    )
    return config.build(model_parts=[model])


def checkpointer(model, optimizers, folder: str, stock: bool = False, **config):
    """The library's checkpoint manager, or torchtitan's own (``stock``); ``config``: more of its Config's fields."""
    import dtensor_quant.torchtitan as dqt

    if stock:
        from torchtitan.components.checkpointer.dcp import CheckpointManager as Manager
    else:
        Manager = dqt.CheckpointManager
    config = Manager.Config(enable=True, folder="checkpoint", interval=1, **config)
    return config.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder=folder,
    )


def _batch(step: int, dims) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    if dims.dp_shard > 1:
        rank = dims.get_mesh("fsdp").get_local_rank()
        per = BATCH // dims.dp_shard
        tokens = tokens[rank * per : (rank + 1) * per]
    return tokens[:, :-1], tokens[:, 1:]


def step(model, optimizers, dims, i: int) -> float:
    inputs, labels = _batch(i, dims)
    positions = torch.arange(SEQ).expand(inputs.shape[0], SEQ)  # one document per sequence
    logits = model(inputs, positions=positions)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    optimizers.step()
    optimizers.zero_grad()
    return loss.detach().item()


def _full(t) -> dict[str, torch.Tensor]:
    import dtensor_quant as dq

    t = t.full_tensor() if isinstance(t, DTensor) else t
    if isinstance(t, dq.QuantizedTensor):
        return {k: v.clone() for k, v in t.inner.items()}
    return {"": t.detach().clone()}


def stored(model, optimizers) -> dict[str, torch.Tensor]:
    """Every weight's and optimizer state's full stored bytes (quantized: each inner tensor), by name."""
    out = {}
    for name, p in model.named_parameters():
        out.update({f"model.{name}.{k}": v for k, v in _full(p).items()})
    names = {p: n for n, p in model.named_parameters()}
    for opt in optimizers.optimizers:
        for p, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out.update({f"optim.{names[p]}.{key}.{k}": v for k, v in _full(value).items()})
                else:
                    out[f"optim.{names[p]}.{key}"] = torch.tensor(value)
    return out


def quantized_names(model) -> list[str]:
    import dtensor_quant as dq

    return [n for n, p in model.named_parameters() if isinstance(getattr(p, "_local_tensor", p), dq.QuantizedTensor)]


def train(dp: int, tp: int, folder: str, steps: int, save_at: int | None = None, resume_at: int | None = None):
    """Build, optionally resume from step ``resume_at``, train to ``steps``, saving at ``save_at``.

    Returns a dict: ``losses``; ``end``: the stored bytes at the end; ``saved``: at the save; ``loaded``: right
    after the resume; ``initial``: before any step or load; ``quantized``: the names of the quantized weights;
    ``linears``: every Linear's weight.
    """
    model, dims = build(dp, tp)
    opts = optimizer(model)
    ckpt = checkpointer(model, opts, folder)
    linears = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    out = {"losses": [], "quantized": quantized_names(model), "linears": linears, "initial": stored(model, opts)}
    start = 0
    if resume_at is not None:
        assert ckpt.load(step=resume_at)
        start, out["loaded"] = resume_at, stored(model, opts)
    for i in range(start, steps):
        out["losses"].append(step(model, opts, dims, i))
        if save_at is not None and i + 1 == save_at:
            ckpt.save(curr_step=save_at)
            out["saved"] = stored(model, opts)
    out["end"] = stored(model, opts)
    ckpt.close()
    return out


def stock_manager(dp: int, tp: int, folder: str) -> dict:
    """torchtitan's own CheckpointManager on the quantized model: its save, then its load of a checkpoint the
    library's manager wrote. Returns each attempt's error (type, message) and the files under the folder after the
    refused save."""
    import os

    model, dims = build(dp, tp)
    opts = optimizer(model)
    step(model, opts, dims, 0)
    out = {}
    stock = checkpointer(model, opts, folder, stock=True)
    try:
        stock.save(curr_step=1)
        out["save"] = None
    except Exception as e:  # the test checks what it is
        out["save"] = (type(e).__name__, str(e))
    dist.barrier()
    root = os.path.join(folder, "checkpoint")
    out["files"] = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(root) for f in fs)
    dist.barrier()
    ours = checkpointer(model, opts, folder)
    ours.save(curr_step=1)
    try:
        stock.load(step=1)
        out["load"] = None
    except Exception as e:
        out["load"] = (type(e).__name__, str(e))
    dist.barrier()
    stock.close()
    ours.close()
    return out


def export_last(dp: int, tp: int, folder: str, steps: int, export_dtype: str = "bfloat16") -> dict:
    """Train ``steps`` steps, then torchtitan's end-of-training save (``save(last_step=True)``, model only, in
    ``export_dtype``). Returns ``trained``: every weight's full stored bytes at the save; ``written``: the
    checkpoint's keys with their dtypes (from its metadata); ``dense``: the names of the dense weights."""
    import os

    from torch.distributed.checkpoint import FileSystemReader

    model, dims = build(dp, tp)
    opts = optimizer(model)
    ckpt = checkpointer(model, opts, folder, last_save_model_only=True, export_dtype=export_dtype)
    for i in range(steps):
        step(model, opts, dims, i)
    assert ckpt.save(curr_step=steps, last_step=True)
    dist.barrier()
    metadata = FileSystemReader(os.path.join(folder, "checkpoint", f"step-{steps}")).read_metadata()
    written = {k: str(m.properties.dtype) for k, m in metadata.state_dict_metadata.items() if hasattr(m, "properties")}
    quantized = set(quantized_names(model))
    out = {
        "trained": {k: v for k, v in stored(model, opts).items() if k.startswith("model.")},
        "written": written,
        "dense": [n for n, _ in model.named_parameters() if n not in quantized],
        "quantized": sorted(quantized),
        "logical_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }
    ckpt.close()
    return out


def load_export(dp: int, tp: int, folder: str, path: str, how: str) -> dict:
    """A fresh model loads the export at ``path``: through torchtitan's ``initial_load_path`` (``how="titan"``,
    the library's manager) or ``dq.checkpoint.load`` (``how="dq"``). Returns every weight's full stored bytes,
    or the error (type, message) the load raised."""
    from torch.distributed.checkpoint.api import CheckpointException

    import dtensor_quant as dq

    model, _ = build(dp, tp)
    try:
        if how == "titan":
            opts = optimizer(model)
            ckpt = checkpointer(model, opts, folder, initial_load_path=path, initial_load_model_only=True)
            assert ckpt.load()
            ckpt.close()
        else:
            dq.checkpoint.load(model, path)
    except (Exception, CheckpointException) as e:  # the test checks what it is (DCP's is a BaseException)
        return {"error": (type(e).__name__, str(e))}
    return {"loaded": {f"model.{n}.{k}": v for n, p in model.named_parameters() for k, v in _full(p).items()}}
