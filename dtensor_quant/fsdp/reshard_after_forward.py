"""FSDP2 integer ``reshard_after_forward`` for parameters with all-gather hooks (a scoped torch patch).

torch 2.13 refuses an integer ``reshard_after_forward`` for every parameter
whose local tensor defines ``fsdp_pre_all_gather`` (this library's, and
torchao's): ``FSDPParam.to_sharded_post_forward`` assumes one dense
all-gather output. :func:`install_fsdp_post_forward_reshard` replaces the few
FSDP2 members involved so that the library's own parameters keep their
quantized chunk instead; every other parameter runs torch's own code.
:func:`dtensor_quant.fsdp.fully_shard` installs it when asked for an integer.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import NamedTuple

import torch

# -- FSDP2: integer reshard_after_forward for parameters with all-gather hooks ------------------
#
# torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_param.py. With ``reshard_after_forward=k``
# (1 < k < shard world) FSDP2 keeps, after the forward, this rank's 1/k of the unsharded parameter
# and all-gathers it over a group of k ranks for the backward. ``FSDPParam.to_sharded_post_forward``
# does that by cutting ``all_gather_outputs[0]`` -- the dense unsharded parameter -- and asserts there
# is exactly one output; ``FSDPParam.all_gather_inputs`` then raises ``NotImplementedError`` for a
# parameter with ``fsdp_pre_all_gather`` in that state. So no parameter with all-gather hooks
# (quantized, or torchao's) can use it.
#
# The same cut works on any number of outputs. FSDP2's all-gather output ``i`` is ``world`` rank
# inputs end to end, and the post-forward group of ranks ``k·g .. k·g+k-1`` splits it into k
# contiguous chunks, chunk ``j`` (``world/k`` whole rank inputs) going to the group's rank ``j``.
# Keeping chunk ``j`` of every output and all-gathering those chunks over the group refills every
# output with the same bytes, so ``fsdp_post_all_gather`` -- called with the forward's metadata --
# rebuilds the same parameter bit for bit, from bytes that stayed quantized. The two replacements
# below do exactly that for parameters with all-gather hooks sharded along dim 0 that are not
# DTensors (torch refuses those for every parameter), and call torch's own code for everything else.


class _PostForwardShard(NamedTuple):
    """What an extension parameter keeps after the forward (in ``FSDPParam._sharded_post_forward_param_data``)."""

    inputs: list[torch.Tensor]  # 1-D: this rank's chunk of each all-gather output
    metadata: object  # fsdp_pre_all_gather's metadata of the forward's all-gather
    input_sizes: tuple  # one rank's all-gather input sizes then, to unflatten the outputs again


_KEEPING_OUTPUTS: ContextVar[bool] = ContextVar("dtensor_quant_fsdp_keeping_outputs", default=False)


def fsdp_keeps_all_gather_outputs() -> bool:
    """Whether the FSDP2 all-gather being prepared must leave its outputs allocated until the reshard.

    True while FSDP2 calls ``fsdp_pre_all_gather`` for a parameter that reshards to a smaller mesh
    after the forward: its post-forward shard is cut from the all-gather outputs, so a post hook
    that frees them early (dtensor_quant's dequantizing one does) must not.
    """
    return _KEEPING_OUTPUTS.get()


_FSDP_PARAM_NEEDS = ("to_sharded_post_forward", "all_gather_inputs", "free_unsharded_param", "_setattr_on_modules")
_FSDP_PARAM_FIELDS = (
    "all_gather_outputs",
    "post_forward_mesh_info",
    "mesh_info",
    "fsdp_placement",
    "is_dtensor",
    "sharded_param",
    "sharded_state",
    "_extensions_data",
)


def install_fsdp_post_forward_reshard() -> None:
    """Let FSDP2 reshard parameters with all-gather hooks to a smaller mesh after the forward.

    Needed for an integer ``reshard_after_forward`` (other than 1 and the shard world size, which
    torch maps to False and True); :func:`dtensor_quant.fsdp.fully_shard` calls it. Groups with such
    parameters also reshard fully after a forward without grad (no backward will use that shard). Call it yourself
    before using torch's own ``fully_shard`` that way. Raises ``RuntimeError`` if this torch lacks
    the FSDP2 internals it replaces (written against torch 2.13).
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    cls = getattr(_fsdp_param, "FSDPParam", None)
    state = getattr(_fsdp_param, "ShardedState", None)
    missing = [f"FSDPParam.{n}" for n in _FSDP_PARAM_NEEDS if cls is None or not hasattr(cls, n)]
    missing += [] if hasattr(state, "SHARDED_POST_FORWARD") else ["ShardedState.SHARDED_POST_FORWARD"]
    group_cls = getattr(_fsdp_param_group, "FSDPParamGroup", None)
    missing += [f"FSDPParamGroup.{n}" for n in ("reshard", "_to_sharded") if not hasattr(group_cls, n)]
    missing += [] if hasattr(_fsdp_param_group, "TrainingState") else ["_fsdp_param_group.TrainingState"]
    if not missing and not isinstance(cls.__dict__.get("all_gather_inputs"), property):
        missing.append("FSDPParam.all_gather_inputs as a property")
    if missing:
        raise RuntimeError(
            f"dtensor_quant cannot enable an integer reshard_after_forward for quantized parameters on "
            f"torch {torch.__version__}: its FSDP2 lacks {', '.join(missing)} (the fix is written against "
            "torch 2.13's torch/distributed/fsdp/_fully_shard/_fsdp_param.py). Use reshard_after_forward=True "
            "or False."
        )
    if getattr(cls.to_sharded_post_forward, "keeps_extension_chunks", False):
        return  # already installed
    torch_to_sharded_post_forward = cls.to_sharded_post_forward
    torch_all_gather_inputs = cls.__dict__["all_gather_inputs"].fget

    def extension_on_dim0(self) -> bool:
        if not hasattr(self.sharded_param._local_tensor, "fsdp_pre_all_gather"):
            return False
        lacking = [n for n in _FSDP_PARAM_FIELDS if not hasattr(self, n)]
        if lacking:
            raise RuntimeError(f"torch {torch.__version__}'s FSDPParam has no {', '.join(lacking)}: see {__name__}")
        return not self.is_dtensor and self.fsdp_placement.dim == 0

    def to_sharded_post_forward(self) -> None:
        if not extension_on_dim0(self):
            return torch_to_sharded_post_forward(self)
        self._assert_in_states(state.UNSHARDED)
        if not hasattr(self, "_dq_forward_all_gather"):
            raise RuntimeError(
                f"FSDP2 parameter {self._param_fqn} was all-gathered before install_fsdp_post_forward_reshard(): "
                "call it (or dtensor_quant.fsdp.fully_shard) before the first forward"
            )
        group = self.post_forward_mesh_info
        size, rank = group.shard_mesh_size, group.shard_mesh_rank
        chunks = []
        for out in self.all_gather_outputs:
            if out.untyped_storage().nbytes() < out.numel() * out.element_size():
                raise RuntimeError(
                    f"FSDP2 parameter {self._param_fqn}: its all-gather outputs were freed before the "
                    "post-forward reshard, so its post-forward shard cannot be cut from them; its "
                    "fsdp_post_all_gather must keep them while fsdp_keeps_all_gather_outputs() is True"
                )
            assert out.numel() % size == 0, (out.numel(), size)  # world rank inputs, world % size == 0
            n = out.numel() // size
            chunks.append(out.narrow(0, n * rank, n).clone())  # clone: the outputs are freed below
        metadata, input_sizes = self._dq_forward_all_gather
        self._sharded_post_forward_param_data = _PostForwardShard(chunks, metadata, input_sizes)
        self._sharded_post_forward_param = None
        # Between forward and backward the module shows the parameter's own shard (the quantized
        # bytes or master rows FSDP2 keeps anyway) rather than a DTensor on the post-forward mesh.
        self._setattr_on_modules(self.sharded_param)
        self.free_unsharded_param()
        self.sharded_state = state.SHARDED_POST_FORWARD

    def all_gather_inputs(self) -> list[torch.Tensor]:
        if not extension_on_dim0(self):
            return torch_all_gather_inputs(self)
        if self.sharded_state == state.SHARDED_POST_FORWARD:
            shard = self._sharded_post_forward_param_data
            self._extensions_data.all_gather_metadata = shard.metadata
            self._extensions_data.all_gather_input_sizes = shard.input_sizes
            return list(shard.inputs)
        # (FSDPParam's own setting: set_reshard_after_forward changes only its group's, and then the
        # outputs are merely kept until the group's full reshard after the forward, which frees them.)
        group = self.post_forward_mesh_info
        token = _KEEPING_OUTPUTS.set(group is not None and group != self.mesh_info)
        try:
            inputs = torch_all_gather_inputs(self)
        finally:
            _KEEPING_OUTPUTS.reset(token)
        data = self._extensions_data
        self._dq_forward_all_gather = (data.all_gather_metadata, tuple(data.all_gather_input_sizes))
        return inputs

    # A forward without grad has no backward to serve, yet torch keeps its post-forward shard: a
    # no_grad eval between a backward and optimizer.step() leaves the pre-step values there, and the
    # next forward is gathered from them (the step silently missing from that forward). Groups with
    # all-gather hooks reshard fully after such a forward, as with reshard_after_forward=True.
    group_cls = _fsdp_param_group.FSDPParamGroup
    torch_reshard = group_cls.reshard

    def reshard(self) -> None:
        if (
            not torch.is_grad_enabled()
            and self._training_state == _fsdp_param_group.TrainingState.FORWARD
            and any(extension_on_dim0(p) for p in self.fsdp_params)
        ):
            return self._to_sharded()
        return torch_reshard(self)

    to_sharded_post_forward.keeps_extension_chunks = True
    to_sharded_post_forward.__doc__ = torch_to_sharded_post_forward.__doc__
    cls.to_sharded_post_forward = to_sharded_post_forward
    cls.all_gather_inputs = property(all_gather_inputs, doc=cls.__dict__["all_gather_inputs"].__doc__)
    reshard.__doc__ = torch_reshard.__doc__
    group_cls.reshard = reshard
