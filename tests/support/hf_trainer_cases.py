"""transformers.Trainer + FSDP2 (accelerate) fine-tuning trainable int8 weights: checks run by the ranks of a pool.

Two fixes of accelerate 1.16, both in docs/frameworks.md:

* :func:`parameters_by_identity` (needed on any device): when accelerate
  prepares FSDP2 it swaps the optimizer's parameters for the sharded ones,
  matching them by ``data_ptr()``; that is 0 for every tensor subclass (a
  quantized weight, or a DTensor's quantized local tensor), so every
  quantized weight would map to one of them. The fix matches those by
  identity, as accelerate already does for meta tensors. Without it the
  library refuses the first step (``ValueError``), nothing is updated wrongly.
* :func:`cpu_fsdp` (CPU only): accelerate enables FSDP only on
  accelerators; on CPU ranks its state says ``MULTI_CPU`` and Trainer would
  wrap the model in DDP. The fix sets what accelerate's own branch sets on GPUs.

Everything else is Trainer's default: its fused AdamW (``adamw_torch_fused``),
its checkpoints, its ``save_model``.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.distributed.tensor import DTensor

import dtensor_quant as dq
from dtensor_quant import QuantizedTensor

LAYER = "LlamaDecoderLayer"


class Tokens(torch.utils.data.Dataset):
    """A few fixed token sequences (labels = inputs), the same on every rank; Trainer's sampler splits them."""

    def __init__(self, n: int = 16, seq: int = 8, vocab: int = 256):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n // 4, seq), generator=g).repeat(4, 1)  # repeated: something to learn

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def cpu_fsdp(trainer) -> None:
    """accelerate's FSDP on CPU ranks: set the state it sets on GPUs (``FSDP``, the plugin of the Trainer's args,
    its mixed precision under ``bf16=True``).

    Both shared states are set: a later ``AcceleratorState()`` copies ``PartialState``'s ``distributed_type``.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if state.distributed_type == DistributedType.MULTI_CPU and trainer.args.fsdp_plugin_args is not None:
        state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
        if state.mixed_precision != "no":  # bf16=True: FSDP2's MixedPrecisionPolicy, as accelerate's state sets it
            state.fsdp_plugin.set_mixed_precision(state.mixed_precision)
        trainer.is_fsdp_enabled = True


@contextlib.contextmanager
def parameters_by_identity():
    """While it lasts, accelerate keys a parameter whose ``data_ptr()`` is 0 by ``id()`` (as it keys meta ones)."""
    import accelerate.accelerator as acc

    by_pointer = acc._get_parameter_id

    def key(param):
        return by_pointer(param) or id(param)

    acc._get_parameter_id = key
    try:
        yield
    finally:
        acc._get_parameter_id = by_pointer


def make_trainer(
    path,
    out,
    steps: int,
    tensors: bool = False,
    state_dict_type: str = "FULL_STATE_DICT",
    model=None,
    **kwargs,
):
    """The model loaded with trainable int8 weights, a Trainer with FSDP2 over every decoder layer; defaults else.

    ``tensors``: the model's state dicts hold each quantized weight as a tensor (``tensor_state_dicts``), not as
    the entries a model loaded with ``QuantConfig(trainable=True)`` keeps. ``state_dict_type``: how accelerate
    writes Trainer's checkpoints (``FULL_STATE_DICT``: one file from rank 0; ``SHARDED_STATE_DICT``: DCP);
    ``save_model`` writes only under ``FULL_STATE_DICT``. ``model``: one made by the caller (a PEFT model)."""
    import transformers

    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, quantization_config=dq.hf.QuantConfig("int8", trainable=True, seed=0)
        )
    if tensors:
        dq.checkpoint.tensor_state_dicts(model)
    args = transformers.TrainingArguments(
        out,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=kwargs.pop("learning_rate", 1e-2),
        fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": [LAYER], "state_dict_type": state_dict_type},
        report_to=[],
        logging_steps=1,
        use_cpu=True,
        seed=0,
        **kwargs,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    cpu_fsdp(trainer)
    return trainer


def local_bytes(model) -> dict:
    """Each parameter's local bytes: a quantized one's inner tensors, else the tensor (copies)."""
    out = {}
    for name, p in model.named_parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        if isinstance(local, dq.QuantizedTensor):
            out[name] = {k: v.detach().clone() for k, v in local.inner.items()}
        else:
            out[name] = local.detach().clone()
    return out


def full_bytes(model) -> dict:
    """Each parameter gathered whole (every rank takes part), as :func:`local_bytes` gives it."""
    out = {}
    for name, p in model.named_parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = {k: v.clone() for k, v in whole.inner.items()} if isinstance(whole, dq.QuantizedTensor) else whole
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def differing(a: dict, b: dict) -> list[str]:
    """Names whose bytes differ (or whose inner tensors do)."""
    assert a.keys() == b.keys(), a.keys() ^ b.keys()

    def same(x, y):
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))

    bad = []
    for k, x in a.items():
        y = b[k]
        if isinstance(x, dict) != isinstance(y, dict):
            bad.append(k)
        elif isinstance(x, dict):
            if x.keys() != y.keys() or not all(same(x[i], y[i]) for i in x):
                bad.append(k)
        elif not same(x, y):
            bad.append(k)
    return bad


def train_save_reload(path, out, tensors: bool) -> dict:
    """Train, save_model, then read the directory back by from_pretrained and by dq.hf.load (on every rank)."""
    import transformers

    trainer = make_trainer(path, out, steps=6, tensors=tensors, save_strategy="no")
    start = full_bytes(trainer.model)
    with parameters_by_identity():
        trainer.train()
    optimizer = trainer.optimizer.optimizer  # accelerate's wrapper around the torch optimizer
    trained = full_bytes(trainer.model)
    weights = [p for p in trainer.model.parameters() if isinstance(p._local_tensor, dq.QuantizedTensor)]
    sr_steps = sorted({optimizer.state[p].get("sr_step") for p in weights}, key=str)
    final = os.path.join(out, "final")
    trainer.save_model(final)
    torch.distributed.barrier()

    again = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    config = again.config.quantization_config
    with dq.hf.init_empty():
        meta = transformers.LlamaForCausalLM(again.config).to(torch.float32)
    dq.hf.quantize_like_checkpoint(meta, final)
    dq.hf.load(dq.hf.materialize(meta), final)
    return {
        "optimizer": (type(optimizer).__name__, optimizer.defaults.get("fused")),
        "quantized": len(weights),
        "trainable": all(p.requires_grad for p in weights),
        "sr_steps": sr_steps,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "changed": differing(start, trained),
        "reloaded_differs": differing(trained, full_bytes(again)),
        "dq_load_differs": differing(trained, full_bytes(meta)),
        "reloaded_trainable": sorted({p.requires_grad for p in again.parameters() if isinstance(p, QuantizedTensor)}),
        "config": {k: config.get(k) if isinstance(config, dict) else getattr(config, k) for k in ("trainable", "seed")},
    }


def resume(path, out, tensors: bool, state_dict_type: str = "FULL_STATE_DICT") -> dict:
    """Four steps with a checkpoint at 2, against two steps resumed from that checkpoint: the same bytes."""
    a = make_trainer(
        path,
        os.path.join(out, "a"),
        steps=4,
        tensors=tensors,
        state_dict_type=state_dict_type,
        save_strategy="steps",
        save_steps=2,
    )
    with parameters_by_identity():
        a.train()
    continuous = local_bytes(a.model)
    torch.distributed.barrier()
    b = make_trainer(
        path, os.path.join(out, "b"), steps=4, tensors=tensors, state_dict_type=state_dict_type, save_strategy="no"
    )
    start = full_bytes(b.model)  # whole weights: Trainer shards the model only inside train()
    with parameters_by_identity():
        b.train(resume_from_checkpoint=os.path.join(out, "a", "checkpoint-2"))
    resumed = local_bytes(b.model)
    return {
        "differ": differing(continuous, resumed),
        "changed": differing(start, full_bytes(b.model)),
        "losses": [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (a, b)],
        "checkpoint": sorted(os.listdir(os.path.join(out, "a", "checkpoint-2"))),
    }


def unfixed_refused(path, out) -> str:
    """Without :func:`parameters_by_identity`: the library's refusal at the first step (the message)."""
    trainer = make_trainer(path, out, steps=1, save_strategy="no")
    start = full_bytes(trainer.model)
    try:
        trainer.train()
    except ValueError as e:
        assert differing(start, full_bytes(trainer.model)) == [], "a weight changed before the refusal"
        return str(e)
    raise AssertionError("accelerate's FSDP2 preparation mapped every quantized weight to one; not refused")


def train_bf16(path, out, precision: str = "bf16") -> dict:
    """Trainer's ``bf16=True`` (accelerate's mixed precision) on the trainable int8 weights: train, save_model,
    reload (on every rank). ``precision="fp16"``: ``fp16=True`` instead."""
    import transformers

    trainer = make_trainer(path, out, steps=6, save_strategy="no", **{precision: True})
    start = full_bytes(trainer.model)
    with parameters_by_identity():
        trainer.train()
    trained = full_bytes(trainer.model)
    weights = [p for p in trainer.model.parameters() if isinstance(p._local_tensor, dq.QuantizedTensor)]
    optimizer = trainer.optimizer.optimizer
    final = os.path.join(out, "final")
    trainer.save_model(final)
    torch.distributed.barrier()
    again = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    from torch.distributed.fsdp import FSDPModule

    policies = {m._get_fsdp_state()._mp_policy for m in trainer.model.modules() if isinstance(m, FSDPModule)}
    return {
        "mixed_precision": trainer.accelerator.mixed_precision,
        "scaler": type(trainer.accelerator.scaler).__name__,  # fp16 on GPUs: a GradScaler; on CPU: none
        "fsdp_param_dtypes": sorted(str(p.param_dtype) for p in policies),
        "quantized": len(weights),
        "formats": sorted({str(p._local_tensor.fmt) for p in weights}),
        "dtypes": sorted({str(p.dtype) for p in weights}),
        "trainable": all(p.requires_grad for p in weights),
        "sr_steps": sorted({optimizer.state[p].get("sr_step") for p in weights}, key=str),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "changed": differing(start, trained),
        "reloaded_differs": differing(trained, full_bytes(again)),
    }


def _nf4_lora(path):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=dq.hf.QuantConfig("nf4")
    )
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(base, config)


def qlora_resume(path, out, state_dict_type: str) -> dict:
    """QLoRA: four steps with a Trainer checkpoint at 2, against two steps resumed from it (every rank's bytes)."""
    kwargs = dict(state_dict_type=state_dict_type, learning_rate=5e-3)
    a = make_trainer(
        path, os.path.join(out, "a"), 4, model=_nf4_lora(path), save_strategy="steps", save_steps=2, **kwargs
    )
    with parameters_by_identity():
        a.train()
    continuous = local_bytes(a.model)
    torch.distributed.barrier()
    b = make_trainer(path, os.path.join(out, "b"), 4, model=_nf4_lora(path), save_strategy="no", **kwargs)
    start = full_bytes(b.model)  # whole tensors: comparable before and after FSDP2 shards them
    with parameters_by_identity():
        b.train(resume_from_checkpoint=os.path.join(out, "a", "checkpoint-2"))
    resumed = local_bytes(b.model)
    return {
        "differ": differing(continuous, resumed),
        "changed": differing(start, full_bytes(b.model)),
        "adapters": sorted(n for n, _ in b.model.named_parameters() if "lora_" in n),
        "losses": [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (a, b)],
        "checkpoint": sorted(os.listdir(os.path.join(out, "a", "checkpoint-2"))),
    }


def qlora(path, out) -> dict:
    """QLoRA through Trainer + FSDP2: PEFT LoRA adapters on a frozen NF4 base loaded by ``QuantConfig("nf4")``.

    Trains with Trainer's defaults, saves the adapter with ``save_model``, loads it onto a fresh NF4 base with
    PEFT's ``PeftModel.from_pretrained`` (on every rank)."""
    import peft
    import transformers

    def base():
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, quantization_config=dq.hf.QuantConfig("nf4")
        )

    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base(), config)
    trainer = make_trainer(path, out, steps=6, save_strategy="no", model=model, learning_rate=5e-3)
    start = full_bytes(trainer.model)
    trainer.train()  # no parameters_by_identity: the optimizer holds only the adapters, plain tensors
    trained = full_bytes(trainer.model)
    changed = differing(start, trained)
    frozen = [n for n, p in trainer.model.named_parameters() if isinstance(p._local_tensor, dq.QuantizedTensor)]
    adapter_names = [n for n, p in trainer.model.named_parameters() if "lora_" in n]
    final = os.path.join(out, "adapter")
    trainer.save_model(final)
    torch.distributed.barrier()
    again = peft.PeftModel.from_pretrained(base(), final)
    reloaded = {n: p.detach() for n, p in again.named_parameters() if "lora_" in n}
    return {
        "optimizer": (type(trainer.optimizer.optimizer).__name__, trainer.optimizer.optimizer.defaults.get("fused")),
        "base_formats": sorted({str(p._local_tensor.fmt) for n, p in trainer.model.named_parameters() if n in frozen}),
        "base_frozen": not any(p.requires_grad for n, p in trainer.model.named_parameters() if n in frozen),
        "base_changed": [n for n in changed if n in frozen],
        "adapters": len(adapter_names),
        "adapters_changed": sorted(n for n in changed if n in adapter_names) == sorted(adapter_names),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "saved": sorted(os.listdir(final)),
        "reloaded_differs": differing(
            {n.replace(".default", ""): trained[n] for n in adapter_names},
            {n.replace(".default", ""): v for n, v in reloaded.items()},
        ),
    }


@contextlib.contextmanager
def parallelism_on_cpu():
    """While it lasts, accelerate's ``ParallelismConfig`` check lets CPU ranks (``MULTI_CPU``) through.

    accelerate 1.16 takes a parallelism config (the one Trainer makes for a model that transformers loaded
    tensor-parallel) only for ``FSDP``, multi-accelerator or DeepSpeed states; on CPU ranks ``Accelerator()``
    raises ``ValueError: ParallelismConfig is only compatible ... but got DistributedType.MULTI_CPU``. Every
    other state is checked as accelerate checks it."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    check = ParallelismConfig._validate_accelerator

    def on_cpu(self, accelerator):
        if accelerator.distributed_type != DistributedType.MULTI_CPU:
            check(self, accelerator)

    ParallelismConfig._validate_accelerator = on_cpu
    try:
        yield
    finally:
        ParallelismConfig._validate_accelerator = check


def train_fsdp_tp(path, out, steps: int = 4) -> dict:
    """Trainable int8 weights loaded by transformers on a 2-D mesh (``DistributedConfig(tp_size=2,
    fsdp_size=2)``: its TP plan, then its FSDP2), then Trainer with its defaults on the model as loaded (no
    ``fsdp`` arguments: accelerate leaves a model transformers distributed as it is)."""
    import transformers
    from torch.distributed.fsdp import FSDPModule
    from transformers.distributed import DistributedConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        quantization_config=dq.hf.QuantConfig("int8", trainable=True, seed=0),
        distributed_config=DistributedConfig(tp_size=2, fsdp_size=2),
    )
    args = transformers.TrainingArguments(
        out,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        logging_steps=1,
        use_cpu=True,
        seed=0,
        save_strategy="no",
    )
    with parallelism_on_cpu():
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    start = full_bytes(model)
    trainer.train()  # accelerate prepares only the optimizer here: no parameter remap, no parameters_by_identity
    weights = {n: p for n, p in model.named_parameters() if isinstance(p._local_tensor, dq.QuantizedTensor)}
    optimizer = trainer.optimizer.optimizer
    config = trainer.accelerator.parallelism_config
    return {
        "optim": trainer.args.optim.value,
        "parallelism": (config.dp_shard_size, config.tp_size),
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "mesh_dims": sorted({str(p.device_mesh.mesh_dim_names) for p in weights.values()}),
        "quantized": len(weights),
        "formats": sorted({str(p._local_tensor.fmt) for p in weights.values()}),
        "sr_steps": sorted({optimizer.state[p].get("sr_step") for p in weights.values()}, key=str),
        "changed": [n for n in differing(start, full_bytes(model)) if n in weights],
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
