"""torchtitan (0.3.0): trainable quantized weights, AdamW8bit/4bit and checkpoints, through torchtitan's own hooks.

torchtitan builds a model from a config tree, on the meta device, then
parallelizes it (TP through each module's ``parallelize``, FSDP2 through
``fully_shard``), allocates it (``to_empty``) and initialises it in place
(``init_weights``: each module's ``param_init``, ``nn.init`` functions). Each
of the three pieces here plugs into that order at a point torchtitan offers
for it, without patching torchtitan:

* :class:`QuantizedLinearConverter` is a ``ModelConfigConverter`` (the
  registry torchtitan's float8/MX/LoRA converters use: a user lists its
  ``Config`` in ``model_registry(..., converters=[...])``). It swaps each
  ``Linear.Config`` of the tree for the config of a subclass of that module's
  own class whose constructor quantizes its weight trainable
  (``quantize_(..., trainable=True)``): on meta at build time, layout only;
  the parallelization shards the quantized weight; ``to_empty`` allocates its
  inner tensors; ``init_weights`` runs the module's ``param_init`` on it
  (``trunc_normal_`` quantized in place: the dense init, quantized, per shard
  with the mesh's statistics). Each weight's rounding seed comes from the
  converter's ``seed`` and the weight's path in the tree, the same on every
  rank and world size. A fused ``wqkv`` stays dense (listed in
  ``left_dense``): torchtitan's state-dict hook splits its rows through a 4-D
  ``reshape`` that a quantized weight's layout does not offer.
* :class:`OptimizersContainer` is torchtitan's container with two more names
  for ``ParamGroupConfig.optimizer_name``: ``"AdamW8bit"`` and
  ``"AdamW4bit"`` (torchtitan resolves names in the container's
  ``_resolve_optimizer_factory``, which its docstring invites subclasses to
  extend; the config's ``_owner`` builds the subclass). The container's
  ``implementation`` (fused/foreach) does not apply to them: they have one.
* :class:`CheckpointManager` is torchtitan's DCP checkpoint manager whose DCP
  calls receive each quantized weight in its entry form
  (``entries_from_state``), so DCP's default planners write the library's
  on-disk format and read it back in place, any layout into any other.
  torchtitan's own manager passes the model's state dict (tensors, as torch's
  contract says) to DCP's default planners, which refuse a quantized tensor
  (docs/checkpoint.md says why no tensor extension point can avoid that), and
  it takes no planner and no other ``ModelWrapper`` from its config; kept, it
  stops in its ``ModelWrapper`` on a quantized weight's storage, whose
  ``data_ptr()`` error names this class (docs/frameworks.md).

``spmd_types::replicate_to_varying`` (torchtitan's default ``spmd_types``
backend converts weights with it) is registered for quantized tensors here:
a rank's chunk, cut by the layout.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field

import torch
from torchtitan.components.checkpointer.base import MODEL, ModelWrapper
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.components.checkpointer.dcp import CheckpointManager as _TitanCheckpointManager
from torchtitan.components.optimizer import OptimizersContainer as _TitanOptimizers
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.attention import FusedQKVLinear
from torchtitan.models.common.linear import Linear
from torchtitan.tools.logging import logger

from .._checkpoint.state_dict import entries_from_state, is_quantized
from .._core.dispatch import implements
from .._model.format_spec import parse_format
from .._model.quantize_model import quantize_
from .._optim.adamw import AdamW4bit, AdamW8bit
from .._training.trainable import supports_training

__all__ = ["CheckpointManager", "OptimizersContainer", "QuantizedLinearConverter", "quantized_linear_class"]


# -- the converter -----------------------------------------------------------------------------

_CLASSES: dict[type, type] = {}


def quantized_linear_class(base: type) -> type:
    """The subclass of torchtitan Linear class ``base`` whose weight is quantized, trainable, when built."""
    if base in _CLASSES:
        return _CLASSES[base]

    class QuantizedLinear(base):
        @dataclass(kw_only=True, slots=True)
        class Config(base.Config):
            quant_format: str = "int8"
            """The weight's format (``dq.parse_format`` spelling); one with stochastic rounding."""
            quant_seed: int = 0
            """This weight's stochastic-rounding seed (the converter derives it from its path)."""

        def __init__(self, config):
            super().__init__(config)
            quantize_(self, parse_format(config.quant_format), trainable=True, seed=config.quant_seed)

    QuantizedLinear.__name__ = QuantizedLinear.__qualname__ = f"Quantized{base.__name__}"
    _CLASSES[base] = QuantizedLinear
    return QuantizedLinear


class QuantizedLinearConverter(QuantizationConverter):
    """Swap torchtitan ``Linear`` configs for ones whose weights are trainable quantized tensors (module docstring).

    ::

        model_registry("debugmodel", converters=[dq.torchtitan.QuantizedLinearConverter.Config(format="int8")])
    """

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        format: str = "int8"
        """The weights' format: one that rounds stochastically (int8, float8 rowwise/tensorwise)."""
        seed: int = 0
        """The run's stochastic-rounding seed; each weight's own comes from it and the weight's path."""
        filter_fqns: list[str] = field(default_factory=list)
        """Linears whose path contains one of these strings stay dense (e.g. ``["lm_head"]``)."""

    def __init__(self, config: Config, **kwargs):
        fmt = parse_format(config.format)
        if not supports_training(fmt):
            raise ValueError(
                f"QuantizedLinearConverter: {fmt} has no stochastic rounding, so its weights cannot be trained; "
                "use int8 (Int8Rowwise), float8 rowwise or float8 tensorwise"
            )
        self.config = config
        self.left_dense: list[tuple[str, str]] = []

    def convert(self, model_config):
        converted = []
        for fqn, cfg, parent, attr in list(model_config.traverse(Linear.Config)):
            if isinstance(parent, FusedQKVLinear.Config):
                self.left_dense.append((fqn, "a fused wqkv: torchtitan's state-dict hook reshapes its rows to 4-D"))
                continue
            if any(f in fqn for f in self.config.filter_fqns):
                self.left_dense.append((fqn, "filter_fqns"))
                continue
            cls = quantized_linear_class(type(cfg)._owner)
            values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
            seed = zlib.crc32(f"{self.config.seed}:{fqn}".encode())
            new = cls.Config(**values, quant_format=self.config.format, quant_seed=seed)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            converted.append(fqn)
        logger.info(
            f"dtensor_quant: {len(converted)} Linear weights quantized trainable ({self.config.format}); "
            f"left dense: {[f for f, _ in self.left_dense]}"
        )
        return model_config


# -- spmd_types: the conversions a weight goes through -------------------------------------------


@implements("spmd_types::replicate_to_varying")
def _replicate_to_varying(func, x, world_size: int, split_dim: int, rank: int, stack: bool):
    """spmd_types' Replicate -> Varying of a quantized weight: this rank's chunk (a copy), cut by the layout.

    spmd_types' own op takes ``torch.chunk(x, world_size, split_dim)[rank]``
    (or ``select`` along a stacked dim) and never aliases its input; so does
    this, through the layout's slicing, which refuses a cut through a pack or
    a block by name.
    """
    piece = x.select(split_dim, rank) if stack else torch.chunk(x, world_size, dim=split_dim)[rank]
    return piece.clone()


# -- the optimizer container -----------------------------------------------------------------

_OURS = {"AdamW8bit": AdamW8bit, "AdamW4bit": AdamW4bit}
_IMPLEMENTATION_KEYS = ("fused", "foreach")  # what the container adds to every group from its `implementation`


def _factory(cls):
    def build(param_groups, **kwargs):
        groups = [{k: v for k, v in g.items() if k not in _IMPLEMENTATION_KEYS} for g in param_groups]
        return cls(groups, **kwargs)

    return build


class OptimizersContainer(_TitanOptimizers):
    """torchtitan's optimizer container, with ``optimizer_name="AdamW8bit"`` / ``"AdamW4bit"`` (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanOptimizers.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name in _OURS:
            return _factory(_OURS[name])
        return _TitanOptimizers._resolve_optimizer_factory(name)


# -- the checkpoint manager ------------------------------------------------------------------


class QuantizedModelWrapper(ModelWrapper):
    """torchtitan's ``ModelWrapper`` without its storage cache, which a quantized weight cannot take part in.

    torchtitan's wrapper keeps the state dict of its first call and, on each
    later call, compares every value's storage with the cached one
    (``untyped_storage().data_ptr()``) to copy hook-made tensors in place. A
    quantized weight is a wrapper tensor subclass with no storage of its own
    (its bytes are its inner tensors), so that comparison raises. Here every
    call returns the model's state dict afresh: each value is the parameter
    itself (or a hook's tensor made from it), so nothing goes stale. The
    cache exists to let async staging reuse pinned buffers; the synchronous
    save does not need it.
    """

    def state_dict(self):
        self.cached_state_dict = self._get_state_dict()
        return self.cached_state_dict


class CheckpointManager(_TitanCheckpointManager):
    """torchtitan's DCP checkpoint manager for models with quantized weights (module docstring).

    Saves and loads the library's on-disk format (each quantized weight as
    its inner tensors and a format record), in place, resharding. The
    Hugging Face export and import paths (``last_save_in_hf``,
    ``initial_load_in_hf``) are refused: they go through a state-dict adapter
    written for dense weights.

    The model-only export at the end of training (``last_save_model_only``)
    casts the dense tensors to ``export_dtype`` and writes each quantized
    weight as it is: its stored bytes and its logical dtype. torchtitan's
    own export casts every floating-point value, and a quantized weight's
    ``.to(bfloat16)`` keeps its bytes but records a bfloat16 weight, which
    the float32 model the same config builds then refuses to load
    (``CheckpointFormatError``: the logical dtypes differ), e.g. through
    ``initial_load_path``. Left as they are, the export loads back into that
    model with the trained bytes (the dense tensors cast back up by DCP).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanCheckpointManager.Config):
        pass

    def __init__(self, config: Config, *, model_parts, **kwargs):
        super().__init__(config, model_parts=model_parts, **kwargs)
        if self.enable:
            self.states[MODEL] = QuantizedModelWrapper(model_parts)

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        if to_hf:
            raise ValueError(
                "dtensor_quant's CheckpointManager: last_save_in_hf is not supported for quantized weights "
                "(torchtitan's state-dict adapter expects dense ones); export with dtensor_quant.hf.save"
            )
        return super().dcp_save(entries_from_state(state_dict), checkpoint_id, async_mode, enable_garbage_collection)

    @torch.no_grad()
    def _save_last_step(self, curr_step: int) -> None:
        """torchtitan's end-of-training save; model only: ``export_dtype`` for the dense tensors alone (class doc)."""
        if not self.last_save_model_only:
            return super()._save_last_step(curr_step)
        states = {
            k: v.to(self.export_dtype)
            if isinstance(v, torch.Tensor)
            and not is_quantized(v)
            and v.is_floating_point()
            and v.dtype != self.export_dtype
            else v
            for k, v in self.states[MODEL].state_dict().items()
        }
        logger.info(
            f"Saving a model only checkpoint at last step, step {curr_step}: dense tensors in {self.export_dtype}, "
            "quantized weights as stored"
        )
        self.dcp_save(
            states,
            checkpoint_id=self._create_checkpoint_id(curr_step),
            async_mode=AsyncMode.DISABLED,
            enable_garbage_collection=True,
            to_hf=self.last_save_in_hf,
        )

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        if from_hf:
            raise ValueError(
                "dtensor_quant's CheckpointManager: initial_load_in_hf is not supported for quantized weights; "
                "load a Hugging Face directory with dtensor_quant.hf.load"
            )
        return super().dcp_load(entries_from_state(state_dict), checkpoint_id, from_hf, from_quantized)
