"""DCP planners for state dicts of quantized models: weights-only unpickling, and tensors-only state dicts.

A quantized weight held as itself in a state dict (``dq.checkpoint.tensor_state_dicts``)
needs one DCP key per inner tensor; DCP's default planners give a value one key, so
these planners turn such values into their entries (``state_dict.entries_from_state``).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from .state_dict import SPEC_KEY, check_spec, entries_from_state, parse_spec


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
    value's raises :class:`CheckpointFormatError` naming both -- after DCP
    read it, so use ``dq.checkpoint.load`` to be refused before any byte moves.
    Non-tensor entries are unpickled with ``weights_only=True``.
    """

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(entries_from_state(state_dict), metadata, is_coordinator)
        self._user_state_dict = state_dict  # entries_from_state copied its dicts: non-tensor values go here
        suffix = "." + SPEC_KEY
        self._records = {k: v for k, v in self.state_dict.items() if k.endswith(suffix)}

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        expected = self._records.get(fqn)
        if expected is None:  # a non-tensor value (an optimizer's step count, say): into the caller's dict
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self._user_state_dict, self.mappings[fqn], obj)
            else:
                self._user_state_dict[fqn] = obj
            return None
        found = torch.load(value, weights_only=True)
        key = fqn[: -len(SPEC_KEY) - 1]
        check_spec(parse_spec(found, key), parse_spec(expected, key), key)
        value.seek(0)
        return super().load_bytes(read_item, value)  # into the entries: commits chunks read before the record
