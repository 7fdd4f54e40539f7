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

from typing import NamedTuple

import torch

from .._core.tensor import QuantizedTensor
from .._core.torch_patches import TorchPatchError, replace
from .all_gather import KEEPING_OUTPUTS
from .gather_quantized import GatherQuantized

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
# rebuilds the same parameter bit for bit, from bytes that stayed quantized. The replacements below
# do exactly that for this library's parameters (QuantizedTensor, GatherQuantized) sharded along dim 0
# that are not DTensors (torch refuses those for every parameter), and call torch's own code for
# everything else, torchao's tensors with all-gather hooks included.
#
# At init, ``FSDPParam._init_sharded_post_forward_param_metadata`` chunks the whole parameter over
# the k ranks of the post-forward group only to read one chunk's size. A quantized tensor refuses a
# cut its layout forbids -- NF4 [30, 14336] is legal at 4 ranks (8 rows each, whole factors) but not
# cut in 2 at row 15: "legal for n = 1, 4" while 4 was the size in use -- although the post-forward
# shard above never makes that cut (it keeps whole rank inputs, so whatever is legal over the shard
# world is legal for every k). For this library's parameters the sizes come from a meta tensor of
# the parameter's shape instead.


class _PostForwardShard(NamedTuple):
    """What an extension parameter keeps after the forward (in ``FSDPParam._sharded_post_forward_param_data``)."""

    inputs: list[torch.Tensor]  # 1-D: this rank's chunk of each all-gather output
    metadata: object  # fsdp_pre_all_gather's metadata of the forward's all-gather
    input_sizes: tuple  # one rank's all-gather input sizes then, to unflatten the outputs again


#: torch 2.13.0's sources of the four members the patch replaces (core.torch_patches.fingerprint).
TORCH_2_13 = {
    "FSDPParam.to_sharded_post_forward": "f94c718551a43084",
    "FSDPParam.all_gather_inputs": "8f5e2c41a746e987",
    "FSDPParam._init_sharded_post_forward_param_metadata": "3de1420d14eb6d04",
    "FSDPParamGroup.reshard": "f8de8fedc4e3b5e1",
}
# What the replacements read on FSDPParam and its group besides the replaced members.
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


def handles(fsdp_param) -> bool:
    """Whether the patch handles ``fsdp_param`` (an ``FSDPParam``), else torch's own code does.

    Only this library's tensors (not torchao's, not dense ones), sharded on dim 0 and not DTensors.
    """
    if not isinstance(fsdp_param.sharded_param._local_tensor, (QuantizedTensor, GatherQuantized)):
        return False
    lacking = [n for n in _FSDP_PARAM_FIELDS if not hasattr(fsdp_param, n)]
    if lacking:
        raise TorchPatchError(f"torch {torch.__version__}'s FSDPParam has no {', '.join(lacking)}: see {__name__}")
    return not fsdp_param.is_dtensor and fsdp_param.fsdp_placement.dim == 0


def install_fsdp_post_forward_reshard():
    """Let FSDP2 reshard this library's parameters to a smaller mesh after the forward.

    Needed for an integer ``reshard_after_forward`` (other than 1 and the
    shard world size, which torch maps to False and True);
    :func:`dtensor_quant.fsdp.fully_shard` calls it. Groups with such
    parameters also reshard fully after a forward without grad (no backward
    will use that shard). Call it yourself before using torch's own
    ``fully_shard`` that way. Every other parameter (dense, torchao's) runs
    torch's own code. Raises :class:`~dtensor_quant._core.torch_patches.TorchPatchError`
    on a torch whose FSDP2 members differ from the 2.13 ones the patch was
    written for. Returns the installed :class:`~dtensor_quant._core.torch_patches.Patch`.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    param_cls, group_cls = _fsdp_param.FSDPParam, _fsdp_param_group.FSDPParamGroup
    state = _fsdp_param.ShardedState
    return replace(
        "fsdp_post_forward_reshard",
        "FSDP2 integer reshard_after_forward for parameters with all-gather hooks",
        {
            (param_cls, "to_sharded_post_forward"): (
                TORCH_2_13["FSDPParam.to_sharded_post_forward"],
                lambda torch_fn: _to_sharded_post_forward(torch_fn, state),
            ),
            (param_cls, "all_gather_inputs"): (
                TORCH_2_13["FSDPParam.all_gather_inputs"],
                lambda torch_fn: _all_gather_inputs(torch_fn, state),
            ),
            (param_cls, "_init_sharded_post_forward_param_metadata"): (
                TORCH_2_13["FSDPParam._init_sharded_post_forward_param_metadata"],
                _init_post_forward_metadata,
            ),
            (group_cls, "reshard"): (
                TORCH_2_13["FSDPParamGroup.reshard"],
                lambda torch_fn: _reshard(torch_fn, _fsdp_param_group.TrainingState),
            ),
        },
    )


def _to_sharded_post_forward(torch_to_sharded_post_forward, state):
    def to_sharded_post_forward(self) -> None:
        if not handles(self):
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

    return to_sharded_post_forward


def _all_gather_inputs(torch_all_gather_inputs, state):
    def all_gather_inputs(self) -> list[torch.Tensor]:
        if not handles(self):
            return torch_all_gather_inputs(self)
        if self.sharded_state == state.SHARDED_POST_FORWARD:
            shard = self._sharded_post_forward_param_data
            self._extensions_data.all_gather_metadata = shard.metadata
            self._extensions_data.all_gather_input_sizes = shard.input_sizes
            return list(shard.inputs)
        # (FSDPParam's own setting: set_reshard_after_forward changes only its group's, and then the
        # outputs are merely kept until the group's full reshard after the forward, which frees them.)
        group = self.post_forward_mesh_info
        token = KEEPING_OUTPUTS.set(group is not None and group != self.mesh_info)
        try:
            inputs = torch_all_gather_inputs(self)
        finally:
            KEEPING_OUTPUTS.reset(token)
        data = self._extensions_data
        self._dq_forward_all_gather = (data.all_gather_metadata, tuple(data.all_gather_input_sizes))
        return inputs

    return all_gather_inputs


def _init_post_forward_metadata(torch_init):
    def _init_sharded_post_forward_param_metadata(self, param) -> None:
        # At init only the sharded parameter and its placement exist (not the fields handles() reads).
        local = getattr(self.sharded_param, "_local_tensor", None)
        if isinstance(local, (QuantizedTensor, GatherQuantized)) and not self.is_dtensor:
            if self.fsdp_placement.dim == 0:
                param = torch.empty(param.shape, dtype=param.dtype, device="meta")  # sizes only: no cut
        return torch_init(self, param)

    return _init_sharded_post_forward_param_metadata


def _reshard(torch_reshard, training_state):
    # A forward without grad has no backward to serve, yet torch keeps its post-forward shard: a
    # no_grad eval between a backward and optimizer.step() leaves the pre-step values there, and the
    # next forward is gathered from them (the step silently missing from that forward). Groups with
    # all-gather hooks reshard fully after such a forward, as with reshard_after_forward=True.
    def reshard(self) -> None:
        if (
            not torch.is_grad_enabled()
            and self._training_state == training_state.FORWARD
            and any(handles(p) for p in self.fsdp_params)
        ):
            return self._to_sharded()
        return torch_reshard(self)

    return reshard
