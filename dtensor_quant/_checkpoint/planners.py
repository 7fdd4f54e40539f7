"""DCP planners for state dicts of quantized models: weights-only unpickling, and tensors-only state dicts.

A quantized weight held as itself in a state dict (``dq.checkpoint.tensor_state_dicts``)
needs one DCP key per inner tensor; DCP's default planners give a value one key, so
these planners turn such values into their entries (``state_dict.entries_from_state``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadItemType

from .state_dict import SPEC_KEY, entries_from_state, guard_state_dict


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, unpickling non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner for state dicts that hold quantized weights as tensors.

    ::

        dcp.save(model.state_dict(), checkpoint_id=path, planner=dq.checkpoint.SavePlanner())

    Each quantized value (a QuantizedTensor or a DTensor of one) is written as
    its entries -- one key per inner tensor, aliasing its bytes, plus the
    ``__quant__`` record (:mod:`.state_dict`) -- the files
    ``dq.checkpoint.save`` writes. Entry-form values pass through unchanged.
    """

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(entries_from_state(state_dict), storage_meta, is_coordinator)


class LoadPlanner(WeightsOnlyLoadPlanner):
    """DCP's default load planner for state dicts that hold quantized weights as tensors.

    ::

        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=path, planner=dq.checkpoint.LoadPlanner())  # into the weights' own bytes
        model.load_state_dict(sd)

    Each quantized value is read as its entries, which alias its inner
    tensors: the stored bytes land in the value (any layout into any other,
    as DCP reshards). A checkpoint whose ``__quant__`` record differs from the
    value's raises :class:`CheckpointFormatError` naming both, and nothing of
    the load is written: the records are read first, and whatever DCP reads
    before the last of them (another rank's file) waits in a scratch copy
    (:mod:`.load_guard`). Non-tensor entries are unpickled with ``weights_only=True``.
    """

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        entries = entries_from_state(state_dict)
        self._guard = guard_state_dict(entries)  # DCP's set-up below assigns each record: they join this guard
        super().set_up_planner(entries, metadata, is_coordinator)
        self._user_state_dict = state_dict  # entries_from_state copied its dicts: non-tensor values go here

    def create_local_plan(self):
        plan = super().create_local_plan()
        # the records (bytes) first: in each file DCP reads them before any tensor, so nothing waits to be checked
        return dataclasses.replace(plan, items=sorted(plan.items, key=lambda i: i.type != LoadItemType.BYTE_IO))

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        if fqn.endswith("." + SPEC_KEY):  # a weight's record: into its entries, where the guard checks it
            return super().load_bytes(read_item, value)
        obj = torch.load(value, weights_only=True)  # another non-tensor value (an optimizer's step count, say)
        if self.flatten_state_dict:
            set_element(self._user_state_dict, self.mappings[fqn], obj)
        else:
            self._user_state_dict[fqn] = obj
        return None
