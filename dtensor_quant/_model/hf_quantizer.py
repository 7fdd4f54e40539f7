"""``from_pretrained(..., quantization_config=dq.hf.QuantConfig("nf4"))``: transformers' quantizer for this library.

transformers >= 5 lets a library add a quantization method
(``register_quantization_config`` / ``register_quantizer``); this module is
that method, ``quant_method: "dtensor_quant"``. It imports transformers and is
imported only when transformers' quantizers are
(:mod:`~dtensor_quant._model.transformers_hook`).

How it runs inside ``from_pretrained`` (transformers' hooks, in their order):

1. ``_process_model_before_weight_loading`` (the model on the meta device,
   before ``tp_plan`` shards it): picks the weights to quantize, the ones
   :func:`~dtensor_quant.quantize_` would (every ``nn.Linear`` weight and
   fused expert stack, minus ``modules_to_not_convert`` and tied weights,
   which transformers fills after loading) and freezes them. For a directory
   this method wrote (pre-quantized), its ``config_groups`` name each
   weight's format instead.
2. transformers reads each tensor: under ``tp_plan`` only this rank's slice.
   A dense weight goes through :class:`_Quantize`: the slice is quantized
   into the weight's placement with the statistics of the full tensor (the
   library's sharded quantize: the bytes of quantizing the whole weight, then
   sharding it, as :func:`dtensor_quant.hf.load` gives). A weight stored
   quantized (``{key}.{inner}``, :func:`~dtensor_quant.hf.save` with
   ``quantization="dtensor_quant"``) goes through :class:`_Deserialize`,
   which places the stored bytes as they are. transformers' own
   shard-on-read would cut every stored inner tensor like the weight (wrong
   for a scale that is constant along the sharded dim, or a flat one), so
   for those weights the state dict transformers plans with shows a plain
   tensor and each rank reads them whole and keeps its chunk.
3. ``_process_model_after_weight_loading``: the frozen-weight checks and
   state-dict hooks :func:`~dtensor_quant.quantize_` installs.

``save_pretrained`` writes each quantized weight as its stored inner tensors
and ``config.json``'s ``quantization_config`` with every weight's format
(:func:`get_state_dict_and_metadata`); ``from_pretrained`` of that directory
and :func:`dtensor_quant.hf.load` read it back as stored.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module
from transformers.utils.quantization_config import QuantizationConfigMixin

from .._checkpoint.hf.producers.native import NATIVE, NATIVE_VERSION, native_groups, native_record, native_targets
from .._checkpoint.state_dict import (
    SPEC_KEY,
    format_of_record,
    from_entries,
    is_quantized,
    parse_spec,
    tensor_state_dicts,
    to_entries,
)
from .._core.format import QuantFormat
from .._core.tensor import contiguous_strides
from .._parallel.quantize import quantize
from .._training import trainable as trainable_weights
from . import placed
from .format_spec import parse_format
from .quantize_model import adopt_quantized, is_matmul_weight


def _as_format(value) -> QuantFormat:
    if isinstance(value, QuantFormat):
        return value
    if isinstance(value, str):
        return parse_format(value)
    if isinstance(value, Mapping):
        return format_of_record(value)
    raise TypeError(f"QuantConfig(format=...): a QuantFormat, a string such as 'nf4' or 'int4:128', or a record; "
                    f"got {type(value).__name__}")  # fmt: skip


class QuantConfig(QuantizationConfigMixin):
    """transformers' ``quantization_config`` for this library: ``quant_method = "dtensor_quant"``.

    ``format``: a :class:`~dtensor_quant.QuantFormat` or a string
    :func:`~dtensor_quant.parse_format` reads (``"nf4"``, ``"int4:128"``,
    ``"int8"``). ``modules_to_not_convert``: module names (or transformers'
    patterns) left dense. ``config_groups`` is what ``save_pretrained`` writes:
    the format of each stored weight (one group per format).

    ``trainable=True`` (formats with stochastic rounding: ``"int8"``,
    ``Float8Rowwise``, ``Float8Tensorwise``; 2-D weights) loads the weights as
    :func:`~dtensor_quant.quantize_` with ``trainable=True, seed=seed`` makes
    them: quantized parameters any ``torch.optim`` optimizer (fused ones
    included) updates in place, so ``transformers.Trainer`` fine-tunes them
    (docs/training.md). ``save_pretrained`` records both, so the checkpoint
    reloads trainable with the same seed.
    """

    def __init__(
        self,
        format: QuantFormat | str | dict | None = None,
        modules_to_not_convert: list[str] | None = None,
        config_groups: dict | None = None,
        quant_method: str = NATIVE,
        version: int = NATIVE_VERSION,
        trainable: bool = False,
        seed: int = 0,
        **kwargs,
    ):
        if quant_method != NATIVE:
            raise ValueError(f"QuantConfig is quant_method {NATIVE!r}, not {quant_method!r}")
        if version > NATIVE_VERSION:
            raise ValueError(
                f"this dtensor_quant reads quantization_config version <= {NATIVE_VERSION}, got {version}; upgrade it"
            )
        if format is None and not config_groups:
            raise ValueError(
                "QuantConfig(format): name the format, e.g. QuantConfig('nf4') or QuantConfig(dq.Int8Rowwise())"
            )
        if kwargs:
            raise TypeError(f"QuantConfig: unknown arguments {sorted(kwargs)}")
        self.quant_method = NATIVE
        self.format = None if format is None else _as_format(format)
        self.modules_to_not_convert = list(modules_to_not_convert) if modules_to_not_convert is not None else None
        self.config_groups = dict(config_groups) if config_groups else None
        self.version = NATIVE_VERSION
        self.trainable = bool(trainable)
        self.seed = int(seed)
        if self.config_groups:
            native_targets(self.to_dict())  # every group's format must build here, before any model exists
        if self.trainable:
            for fmt in [self.format, *self.targets().values()]:
                if fmt is not None and not trainable_weights.supports_training(fmt):
                    raise ValueError(
                        f"QuantConfig(trainable=True): {fmt} has no stochastic rounding, so optimizer updates could "
                        "not be requantized without losing them. Use 'int8' (Int8Rowwise), Float8Rowwise or "
                        "Float8Tensorwise, or train adapters (PEFT LoRA) on frozen weights"
                    )

    def to_dict(self) -> dict:
        out = {"quant_method": NATIVE, "version": self.version}
        if self.format is not None:
            out["format"] = native_record(self.format)
        out["modules_to_not_convert"] = self.modules_to_not_convert
        if self.config_groups:
            out["config_groups"] = json.loads(json.dumps(self.config_groups))
        if self.trainable:
            out["trainable"], out["seed"] = True, self.seed
        return out

    def __iter__(self):
        yield from self.to_dict().items()

    def targets(self) -> dict[str, QuantFormat]:
        """Weight key -> format of a pre-quantized checkpoint (``config_groups``)."""
        return native_targets(self.to_dict()) if self.config_groups else {}


class DtensorQuantHfQuantizer(HfQuantizer):
    """transformers' hooks for ``quant_method: "dtensor_quant"`` (the module docstring says what each does)."""

    requires_calibration = False
    quantization_config: QuantConfig

    def __init__(self, quantization_config: QuantConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.targets: dict[str, QuantFormat] = {}
        self._hook = None

    def validate_environment(self, device_map=None, **kwargs):
        if isinstance(device_map, Mapping) and len({str(d) for d in device_map.values()}) > 1:
            raise ValueError(
                f"dtensor_quant places each weight on this process's device; device_map={dict(device_map)} spreads "
                "the model over several (offloading is not supported). Pass no device_map (or one device), or shard "
                "with tp_plan='auto' under torchrun"
            )
        if self.pre_quantized and not self.quantization_config.config_groups:
            raise ValueError(f"the checkpoint's quantization_config says {NATIVE!r} but lists no weights "
                             "(config_groups); it was not written by save_pretrained or dq.hf.save")  # fmt: skip

    def _process_model_before_weight_loading(self, model, **kwargs):
        if self.pre_quantized:
            self.targets = dict(self.quantization_config.targets())
            params = dict(model.named_parameters())
            unknown = sorted(k for k in self.targets if k not in params)
            if unknown:
                raise ValueError(f"the checkpoint stores {unknown[:6]} quantized; {type(model).__name__} has no such "
                                 "parameters")  # fmt: skip
            targets = self.targets
            self._hook = model.register_state_dict_post_hook(
                lambda module, sd, prefix, meta: _plain_targets(targets, sd, prefix)
            )
        else:
            self.targets = self._pick(model)
        for key in self.targets:
            model.get_parameter(key).requires_grad_(False)  # frozen, as quantize_ leaves them (kept through tp_plan)

    def _pick(self, model) -> dict[str, QuantFormat]:
        fmt = self.quantization_config.format
        if fmt is None:
            raise ValueError("QuantConfig: this config lists stored weights (config_groups) but no format to quantize "
                             "a dense checkpoint into; pass QuantConfig(format)")  # fmt: skip
        skip = self.quantization_config.modules_to_not_convert
        tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        tied |= set((getattr(model, "all_tied_weights_keys", None) or {}).values())
        out = {}
        for fqn, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                key = f"{fqn}.{name}" if fqn else name
                if key in tied or not is_matmul_weight(module, name, param):
                    continue
                if not (should_convert_module(fqn, skip) and should_convert_module(key, skip)):
                    continue  # module names as transformers matches them ("down_proj" a suffix of the module's)
                if self.quantization_config.trainable and param.ndim != 2:
                    raise ValueError(f"QuantConfig(trainable=True): {key} is {param.ndim}-D; trainable quantized "
                                     "weights are 2-D [out, in]. Leave it with modules_to_not_convert")  # fmt: skip
                out[key] = fmt
        if not out:
            raise ValueError(f"QuantConfig({fmt}): {type(model).__name__} has no nn.Linear weight or fused expert "
                             f"stack left to quantize (modules_to_not_convert={skip})")  # fmt: skip
        return out

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return param_name in self.targets

    def get_quantize_ops(self):
        return _Quantize(self)

    @property
    def serialized_names(self) -> dict[str, list[str]]:
        if not self.pre_quantized:
            return {}
        out: dict[str, set[str]] = {}
        for key, fmt in self.targets.items():
            param = key.rsplit(".", 1)[-1]
            out.setdefault(param, set()).update(f"{param}.{n}" for n in fmt.inner_names)
        return {p: sorted(names) for p, names in out.items()}

    def update_parallel_plan(self, model, plan):
        pass  # the stored inner tensors are no parameters of their own: nothing of the plan to extend

    def get_load_operations(self) -> dict:
        return {"deserialize": _Deserialize}

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        left = [k for k in self.targets if not is_quantized(model.get_parameter(k))]
        if left:
            raise ValueError(f"dtensor_quant: {left[:6]} were not loaded quantized (the checkpoint lacks them?)")
        if self.quantization_config.trainable:
            seed = self.quantization_config.seed
            for key in self.targets:
                fqn, _, name = key.rpartition(".")
                module = model.get_submodule(fqn)
                getattr(module, name).requires_grad_(True)
                placed.own(module)
                trainable_weights.make_trainable(module, name, trainable_weights.weight_seed(seed, key))
            # A model loaded to be fine-tuned is checkpointed by Trainer through accelerate, whose FSDP2 checkpoints
            # cannot carry a tensor subclass on torch 2.13: FULL_STATE_DICT loads with broadcast_from_rank0 (the
            # other ranks make dense receive buffers for rank 0's quantized tensors: the broadcasts never match, a
            # hang) and SHARDED_STATE_DICT with DCP's default planners (refused). Both carry the entry form.
            tensor_state_dicts(model, enabled=False)
        # Reading is done: its converters describe no rename of this model's keys for save_pretrained to revert.
        conversions = getattr(model, "_weight_conversions", None)
        if conversions:
            model._weight_conversions = [c for c in conversions if not _ours(c)]
        return adopt_quantized(model)

    def get_state_dict_and_metadata(self, model):
        """Every quantized weight as its inner tensors ``{key}.{name}`` (DTensors under tp_plan: transformers
        gathers them), dense tensors as they are; ``config_groups`` records each weight's format.

        From the ``state_dict`` that ``save_pretrained`` was given, if any (see :func:`_given_state_dict`), else
        from the model's."""
        given = _given_state_dict(inspect.currentframe())
        out, weights = {}, {}
        for key, value in (model.state_dict() if given is None else given).items():
            if isinstance(value, torch.Tensor) and is_quantized(value):
                value = to_entries(value, key)
            if not isinstance(value, Mapping):
                out[key] = value
                continue
            fmt = format_of_record(parse_spec(value[SPEC_KEY], key))
            weights[key] = fmt
            out.update({f"{key}.{name}": value[name] for name in fmt.inner_names})
        self.quantization_config.config_groups = native_groups(weights) or None
        return out, {}

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # adapters (peft LoRA) train on the frozen quantized weights

    @property
    def is_qat_trainable(self) -> bool:
        return self.quantization_config.trainable  # Trainer fine-tunes the quantized weights themselves

    @property
    def is_compileable(self) -> bool:
        return False


def _given_state_dict(frame) -> Mapping | None:
    """The ``state_dict`` argument of the transformers ``save_pretrained`` call that called ``frame``'s function.

    transformers (5.x) replaces that argument by what the quantizer returns and gives the quantizer only the
    model. ``Trainer.save_model`` under FSDP (accelerate) gathers the full state dict on every rank, then calls
    ``save_pretrained(state_dict=full)`` on rank 0 alone, where the model's own parameters are shards that one
    rank cannot gather: writing from the model would hang or write shards. So the argument is read from the
    caller's frame -- only when the caller is transformers' own ``PreTrainedModel.save_pretrained`` (the same
    code object), else None and the model's state dict is used.
    """
    from transformers import PreTrainedModel

    caller = frame.f_back if frame is not None else None
    if caller is None or caller.f_code is not inspect.unwrap(PreTrainedModel.save_pretrained).__code__:
        return None
    given = caller.f_locals.get("state_dict")
    return given if isinstance(given, Mapping) else None


def _plain_targets(targets, state_dict, prefix) -> None:
    """The planning state dict shows stored-quantized weights as plain meta tensors: no shard-on-read of their
    inner tensors by the weight's placements (see the module docstring)."""
    for key in targets:
        value = state_dict.get(prefix + key)
        if isinstance(value, DTensor):
            state_dict[prefix + key] = torch.empty(value.shape, dtype=value.dtype, device="meta")


def _ours(conversion) -> bool:
    return any(isinstance(op, (_Quantize, _Deserialize)) for op in getattr(conversion, "operations", ()))


def _only(input_dict: dict, what: str) -> torch.Tensor:
    if len(input_dict) != 1:
        raise ValueError(f"{what}: expected one tensor, got {sorted(input_dict)}")
    value = next(iter(input_dict.values()))
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"{what}: expected one tensor, got {len(value)}")
        value = value[0]
    return value


def _local_for(q: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """What transformers' loader sets: the local tensor when the parameter is a DTensor (it wraps it like the
    parameter), else a frozen Parameter."""
    if isinstance(param, DTensor):
        return q._local_tensor
    return nn.Parameter(q, requires_grad=False)


class _Quantize(ConversionOps):
    """A dense weight as read (this rank's slice under tp_plan, else whole) -> the parameter's format and placement."""

    def __init__(self, hf_quantizer: DtensorQuantHfQuantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, model=None, full_layer_name=None, **kwargs):
        key = full_layer_name
        value = _only(input_dict, key)
        param = model.get_parameter(key)
        fmt = self.hf_quantizer.targets[key]
        if isinstance(param, DTensor):
            mesh, placements, shape = param.device_mesh, param.placements, tuple(param.shape)
            if tuple(value.shape) == tuple(param._local_tensor.shape):
                dense = DTensor.from_local(value, mesh, placements, run_check=False, shape=shape,
                                           stride=contiguous_strides(shape))  # fmt: skip
            elif tuple(value.shape) == shape:
                dense = distribute_tensor(value, mesh, placements, src_data_rank=None)
            else:
                raise ValueError(f"{key}: read {list(value.shape)}, the parameter is {list(shape)} "
                                 f"({list(param._local_tensor.shape)} on this rank)")  # fmt: skip
        else:
            dense = value
        try:
            q = quantize(dense.to(param.dtype), fmt)
        except ValueError as e:
            raise type(e)(f"{key}: {e}") from None
        return {key: _local_for(q, param)}

    @property
    def reverse_op(self):
        raise NotImplementedError("dtensor_quant: save_pretrained writes quantized weights as stored, no reverse op")


class _Deserialize(ConversionOps):
    """A weight's stored inner tensors (``{key}.{name}``, read whole) -> the quantized parameter, this rank's chunk."""

    def __init__(self, hf_quantizer: DtensorQuantHfQuantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, model=None, full_layer_name=None, **kwargs):
        key = full_layer_name
        fmt = self.hf_quantizer.targets.get(key)
        if fmt is None:
            raise ValueError(f"{key}: stored as dtensor_quant inner tensors, but config_groups does not list it")
        entries = {}
        for pattern, tensors in input_dict.items():
            entries[pattern.rsplit(".", 1)[-1]] = tensors[0] if isinstance(tensors, list) else tensors
        if set(entries) != set(fmt.inner_names):
            raise ValueError(f"{key}: {fmt} stores {list(fmt.inner_names)}; the checkpoint has {sorted(entries)}")
        param = model.get_parameter(key)
        like = quantize(torch.empty(param.shape, dtype=param.dtype, device="meta"), fmt)
        q = from_entries(entries, like, key)
        if isinstance(param, DTensor):
            q = distribute_tensor(q, param.device_mesh, param.placements, src_data_rank=None)
        return {key: _local_for(q, param)}


def register() -> None:
    """Add the method to transformers' registry (once; a second call finds it there)."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(NATIVE) is not QuantConfig:
        register_quantization_config(NATIVE)(QuantConfig)
    if AUTO_QUANTIZER_MAPPING.get(NATIVE) is not DtensorQuantHfQuantizer:
        register_quantizer(NATIVE)(DtensorQuantHfQuantizer)
