"""Save and load quantized models with torch.distributed.checkpoint: atomic, any layout, bit-exact.

::

    dtensor_quant.checkpoint.save(model, "ckpt/step100")        # every rank writes its own shards
    dtensor_quant.checkpoint.load(model, "ckpt/step100")        # any mesh, any legal placement

What this adds to plain ``dcp.save``/``dcp.load`` on ``model.state_dict()``
(which also work, see :mod:`dtensor_quant.checkpoint`):

* **Atomic saves.** Ranks write into ``<path>.partial``; the coordinator
  moves it to ``<path>`` only after every rank's data and the metadata are on
  disk (inside DCP's final step, so every rank returns after the move). A rank
  that dies mid-save leaves the previous checkpoint at ``<path>`` untouched and
  the surviving ranks raise :class:`CheckpointSaveError`. Plain DCP overwrites
  a checkpoint's files in place, so an interrupted save there leaves old
  metadata pointing at new, half-written files.
* **Checks before any collective.** The format of every quantized entry is
  read from the checkpoint (no collective: each rank reads the small records
  itself) and compared with the model's; a mismatch raises
  :class:`~dtensor_quant.checkpoint.CheckpointFormatError` naming both, on
  every rank.
* **Dense checkpoints quantize on load.** A weight stored dense (a plain
  model's save) is read as a dense shard in the target's placement and
  quantized with the scale reductions the layout needs: the result is
  bit-identical to quantizing the full tensor.
* **weights_only loading.** Non-tensor entries are unpickled with
  ``weights_only=True``.

This module holds the two entry points and their checks; each job they use
has its own module: :mod:`.atomic` (the staging directory and its move),
:mod:`.checksums` (a CRC32 per chunk), :mod:`.planners` (DCP planners) and
:mod:`.errors`.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from .._core.tensor import contiguous_strides
from .._parallel import liveness
from .._parallel.agree import raise_together
from .atomic import AtomicFileSystemWriter, check_target, staging_path
from .checksums import CHECKSUM_SUFFIX, VerifyingFileSystemReader
from .errors import CheckpointCorruptError, CheckpointLoadError, CheckpointSaveError
from .planners import LoadPlanner, SavePlanner, WeightsOnlyLoadPlanner
from .state_dict import (
    SPEC_KEY,
    CheckpointFormatError,
    check_spec,
    entries_from_state,
    is_quantized,
    parse_spec,
    quantize_like,
    register,
    to_entries,
)

__all__ = [
    "CHECKSUM_SUFFIX",
    "AtomicFileSystemWriter",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "LoadPlanner",
    "SavePlanner",
    "VerifyingFileSystemReader",
    "WeightsOnlyLoadPlanner",
    "async_save",
    "load",
    "save",
    "staging_path",
]


# -- saving ---------------------------------------------------------------------------


# -- checksums ----------------------------------------------------------------------------


def _to_save(state) -> dict:
    if isinstance(state, nn.Module):
        return entries_from_state(register(state).state_dict())  # either form of state dict
    if not isinstance(state, dict):
        raise TypeError(f"dq.checkpoint.save takes a model (nn.Module) or a state dict, got {type(state).__name__}")
    return entries_from_state(state)


def _prepared(state, path, process_group) -> dict:
    """The state dict to save; a model one rank cannot checkpoint (a Partial weight, a flattened view), or a
    ``path`` the commit would destroy, raises on every rank here, not only on one while the others wait in DCP's
    first collective."""

    def prepare():
        coordinator = not dist.is_initialized() or dist.get_rank(process_group) == 0  # DCP's: it moves the directory
        if coordinator:
            check_target(Path(path))
        return _to_save(state)

    return raise_together(prepare, process_group)


def save(state, path, *, process_group=None) -> Metadata:
    """Save a model (or a state dict) to directory ``path`` with DCP, atomically.

    Every rank calls it. Quantized weights are saved as their stored bytes,
    one entry per inner tensor (``docs/checkpoint.md``). Raises
    :class:`CheckpointSaveError` on every surviving rank if the save does not
    complete; ``path`` then still holds the previous checkpoint.
    """
    state_dict = _prepared(state, path, process_group)
    writer = AtomicFileSystemWriter(path)
    try:
        with _quiet_single_process():
            return dcp.save(
                state_dict, storage_writer=writer, process_group=process_group, no_dist=not dist.is_initialized()
            )
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise _save_error(path, e, process_group, writer) from e


def async_save(state, path, *, process_group=None) -> Future:
    """:func:`save` in the background: returns once the state is copied to CPU memory.

    The returned future completes (on every rank) after the checkpoint has
    been moved to ``path``; its ``result()`` raises :class:`CheckpointSaveError`
    if the save failed. Wait for it before the next save.

    The background save's own collectives run on a separate gloo group
    (created once, by every rank, on the first call) unless
    ``process_group`` is given: on the default group they would interleave
    with the training loop's collectives and deadlock.
    """
    state_dict = _prepared(state, path, process_group)
    writer, group = AtomicFileSystemWriter(path), process_group or _background_group()
    with _quiet_single_process():
        inner = dcp.async_save(
            state_dict, storage_writer=writer, process_group=group, no_dist=not dist.is_initialized()
        )
    outer: Future = Future()

    def done(f):
        try:
            outer.set_result(f.result())
        except BaseException as e:
            outer.set_exception(_save_error(path, e, group, writer))

    inner.add_done_callback(done)
    return outer


_background_groups: dict = {}


def _background_group():
    """A gloo group over all ranks for background saves, one per default process group."""
    if not dist.is_initialized():
        return None
    default = dist.distributed_c10d._get_default_group()
    if default not in _background_groups:
        _background_groups[default] = dist.new_group(backend="gloo")
    return _background_groups[default]


def _save_error(path, e: BaseException, process_group, writer: AtomicFileSystemWriter) -> CheckpointSaveError:
    """The error every surviving rank raises: what failed, which ranks stopped answering, what ``path`` holds.

    A failure that DCP gathered (a rank's write raised) comes as a ``CheckpointException`` on every rank. A rank
    that died makes a collective fail instead, on the ranks that talk to it (every rank, in DCP's gathers and
    all-gathers): then a roll call names the ranks that are gone (:mod:`.._parallel.liveness`).
    """
    failures = getattr(e, "failures", None) if isinstance(e, CheckpointException) else None
    lost, who = [], ""
    if failures:  # name the first failing rank's own error, not DCP's wrapper
        _, failure = min(failures.items())
        e = failure[0] if isinstance(failure, tuple) else failure
    elif dist.is_initialized() and liveness.is_collective_failure(e):
        group = process_group or dist.distributed_c10d._get_default_group()
        lost, how = liveness.roll_call(group)
        who = liveness.describe(lost, how) + "; "
        for default, background in list(_background_groups.items()):
            if background is group:  # it has a member that is gone: never reuse it
                del _background_groups[default]
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if writer.committed:
        held = f"{path} holds this save's checkpoint, complete (the move into place was done)"
    elif lost and _coordinator(process_group) in lost:
        held = (
            f"{path} holds the previous checkpoint (if there was one), or this save's if the coordinator (rank "
            f"{_coordinator(process_group)}) died right after moving it into place: a complete one either way"
        )
    else:
        held = f"{path} still holds the previous checkpoint, if there was one"
    return CheckpointSaveError(
        f"saving to {path} did not complete: {who}{type(e).__name__}: {first[:300]}. {held}; the partial files "
        f"in {staging_path(path)} are removed by the next save.",
        lost,
    )


def _coordinator(process_group) -> int:
    """The global rank of DCP's coordinator (rank 0 of the save's group)."""
    return dist.get_global_rank(process_group, 0) if process_group is not None else 0


def _read_metadata(path) -> Metadata:
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        partial = staging_path(path)
        hint = f"; {partial} holds the files of a save that did not complete" if partial.exists() else ""
        raise FileNotFoundError(f"no complete checkpoint at {path} (its .metadata is missing){hint}") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError) as e:
        raise CheckpointCorruptError(f"{Path(path) / '.metadata'} is damaged ({type(e).__name__}: {e})") from None


def _leaves(state: dict, prefix: str = ""):
    """``(container, key, flat_key, value)`` for every value, not descending into quantized groups."""
    for k, v in state.items():
        flat = f"{prefix}{k}"
        if isinstance(v, dict) and SPEC_KEY not in v:
            yield from _leaves(v, flat + ".")
        else:
            yield state, k, flat, v


def _read_specs(path, keys: list[str]) -> dict[str, dict]:
    """The ``__quant__`` records of ``keys``, read by this rank alone (no collective)."""
    if not keys:
        return {}
    records = {k + "." + SPEC_KEY: "" for k in keys}
    with _quiet_single_process():
        try:
            dcp.load(
                records, storage_reader=VerifyingFileSystemReader(path), planner=WeightsOnlyLoadPlanner(), no_dist=True
            )
        except CheckpointException as e:
            raise _load_error(path, e) from None
    return {k: parse_spec(records[k + "." + SPEC_KEY], k) for k in keys}


def _dense_placeholder(group: dict, spec: dict, dtype: torch.dtype) -> torch.Tensor:
    """An empty dense shard, placed like the quantized group's weight, to read a dense checkpoint into."""
    shape = tuple(spec["shape"])
    entries = [v for k, v in group.items() if k != SPEC_KEY]
    mesh_entries = [e for e in entries if isinstance(e, DTensor)]
    if not mesh_entries:
        return torch.empty(shape, dtype=dtype, device=entries[0].device)
    mesh = mesh_entries[0].device_mesh
    placements = []
    for m in range(mesh.ndim):
        shards = [e.placements[m] for e in mesh_entries if isinstance(e.placements[m], (Shard, _StridedShard))]
        placements.append(shards[0] if shards else Replicate())
    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    local = torch.empty(local_shape, dtype=dtype, device=mesh_entries[0].device)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=contiguous_strides(shape))


def _prepare(state_dict: dict, metadata: Metadata, path, strict: bool) -> list:
    """Check the checkpoint against ``state_dict`` and swap in dense placeholders; no collective.

    The format records, once checked, leave the state dict for the load
    (nothing to read twice); returns ``(group, record)`` pairs to put back.
    """
    stored = metadata.state_dict_metadata
    quantized, dense = [], []
    for container, key, flat, value in _leaves(state_dict):
        if isinstance(value, dict):  # a quantized group
            if flat + "." + SPEC_KEY in stored:
                quantized.append((flat, value))
            elif isinstance(stored.get(flat), TensorStorageMetadata):
                dense.append((container, key, flat, value))
            elif strict:
                raise CheckpointFormatError(
                    f"{flat}: the checkpoint at {path} has neither quantized entries ({flat}.qdata, ...) nor a "
                    "dense tensor for this quantized weight"
                )
        elif flat + "." + SPEC_KEY in stored and not isinstance(stored.get(flat), TensorStorageMetadata):
            raise CheckpointFormatError(
                f"{flat}: the checkpoint at {path} holds this weight quantized, but the model's is "
                f"{'dense' if isinstance(value, torch.Tensor) else type(value).__name__}. Quantize the model "
                "the same way before loading (dtensor_quant.quantize_); quantized bytes are never silently "
                "dequantized."
            )
    found = _read_specs(path, [flat for flat, _ in quantized])
    held = []
    for flat, group in quantized:
        check_spec(found[flat], parse_spec(group[SPEC_KEY], flat), flat)
        held.append((group, group.pop(SPEC_KEY)))
    for container, key, flat, group in dense:
        dtype = stored[flat].properties.dtype
        container[key] = _dense_placeholder(group, parse_spec(group[SPEC_KEY], flat), dtype)
    return held


def load(state, path, *, process_group=None, strict: bool = True):
    """Load checkpoint directory ``path`` into a model (or a state dict, in place), in any layout.

    Every rank calls it. Quantized entries are read straight into the
    parameters' inner tensors (DCP reshards them at block granularity); dense
    weights are quantized on load with the scales of the full tensor. A model
    quantized differently from the checkpoint raises
    :class:`CheckpointFormatError` naming both, on every rank, before any
    collective. For a model, returns ``load_state_dict``'s result.

    A state dict is filled in place: quantized values (raw or in entry form)
    receive the stored bytes; an entry-form group the checkpoint holds dense
    is replaced by the dense tensor, which the model's ``load_state_dict``
    quantizes.
    """
    if isinstance(state, nn.Module):
        model = register(state)
        state_dict = entries_from_state(model.state_dict())  # either form: entries alias the parameters
        _on_every_rank(lambda: _prepare(state_dict, _read_metadata(path), path, strict), process_group)
        _dcp_load(state_dict, path, process_group, strict)
        return model.load_state_dict(state_dict, strict=strict)
    raw, held, loaded = _to_entry_form(state), [], False
    try:
        held = _on_every_rank(lambda: _prepare(state, _read_metadata(path), path, strict), process_group)
        _dcp_load(state, path, process_group, strict)
        loaded = True
    finally:
        for group, record in held:
            group[SPEC_KEY] = record
        for container, key, original in raw:
            value, container[key] = container[key], original
            if loaded and isinstance(value, torch.Tensor):  # read dense: quantize into the original
                original.copy_(quantize_like(value, original, key))
    return None


def _on_every_rank(check, process_group):
    """``check()``, whose failure on any rank is raised on every rank (one small all-gather per load).

    The checks before a load read files but run no collective; a rank whose
    check fails must not leave the others waiting in DCP's first collective.
    """
    return raise_together(check, process_group, fallback=CheckpointLoadError)


def _load_error(path, e: CheckpointException) -> CheckpointLoadError:
    """DCP's BaseException as the documented type, with the first failing rank's error."""
    failures = getattr(e, "failures", None) or {}
    for rank, failure in sorted(failures.items()):
        original = failure[0] if isinstance(failure, tuple) else failure  # (exception, stack summary)
        if isinstance(original, CheckpointCorruptError):
            return CheckpointCorruptError(f"rank {rank}: {original}")
        if isinstance(original, BaseException):
            return CheckpointLoadError(f"loading {path} failed on rank {rank}: {type(original).__name__}: {original}")
    return CheckpointLoadError(f"loading {path} failed: {e}")


def _to_entry_form(state: dict) -> list:
    """Replace raw quantized values of ``state`` by their entries, in place; returns what to restore."""
    replaced = []
    for container, key, flat, value in list(_leaves(state)):
        if isinstance(value, torch.Tensor) and is_quantized(value):
            container[key] = to_entries(value, flat)
            replaced.append((container, key, value))
    return replaced


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes' a single process whenever ``no_dist`` is set; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp_load(state_dict: dict, path, process_group, strict: bool) -> None:
    with _quiet_single_process():
        try:
            dcp.load(
                state_dict,
                storage_reader=VerifyingFileSystemReader(path),
                planner=WeightsOnlyLoadPlanner(allow_partial_load=not strict),
                process_group=process_group,
                no_dist=not dist.is_initialized(),
            )
        except CheckpointException as e:
            raise _load_error(path, e) from None
