"""Ranks that hold a weight in different formats get a clear error on every rank.

A collective on quantized bytes is only meaningful when every rank lays its
bytes out the same way. If configs differ between ranks (Int8Rowwise on one,
Int4Groupwise on another; group size 64 against 128), the byte counts differ
and gloo aborts a rank, or they happen to match and every rank decodes the
others' bytes with its own format. So before the first collective of a given
layout on a given process group, the ranks exchange an 8-byte fingerprint of
that layout (format and its constants, relations, orientation, logical shape
and dtype, inner dtypes and shapes). If any differs, every rank gathers the
others' descriptions and raises :class:`~dtensor_quant.LayoutError` naming
what each rank holds -- on every rank, before the real collective.

Cost: one all-gather of 8 bytes per rank the first time a (process group,
layout) pair is seen; afterwards building the layout key and a set lookup
(``bench/agree.py`` measures it). Under ``torch.compile`` tracing no check is made.

Gathers do not send an inner tensor that is constant along the joined dims
(a per-tensor scale, NF4's mean): every piece takes the receiver's own copy,
which is right only if every rank's copy holds the same bytes. Shards
quantized one by one and joined with ``DTensor.from_local`` break that (each
rank's mean or scale is its own: the gathered weight came back 23-35 units
off on weights of ~10). Those bytes cannot join the fingerprint: it is cached
per layout, and a key that holds data lets one rank find it agreed while
another does not, so one rank exchanges and the other does not (seen: gloo
aborting on a collective mismatch). So the gathers carry each such tensor's
few bytes beside the data instead (one more 8-byte column per rank), and every
rank compares all the copies it received -- the same copies on every rank --
and raises :func:`constants_differ` after the collective, on all of them.
:func:`check_digests` does the same on request (``dq.check_consistent``).

What it cannot catch: ranks that disagree on a layout which each of them
already used successfully with the others on the same group (both layouts
are in the agreed set) skip the exchange. With equal byte counts those still
mix; with unequal ones gloo still fails. That takes two ranks whose configs
agree on one weight of a shape and disagree on another of the same shape.
``DTENSOR_QUANT_AGREE_EVERY_CALL=1`` checks every collective instead (one
8-byte all-gather each), which closes that gap.

What was agreed belongs to one world: ``destroy_process_group()`` and a new
``init_process_group`` in the same process make groups that torch names as
it named the old ones ("0", "1", ...), so a name alone would let a new group
skip its check on the strength of the old one's. :func:`world` notices a new
default process group and starts the agreed set over.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group, _world
from torch.utils._python_dispatch import _disable_current_modes

from .._core import config
from .._core.bits import is_tracing
from .._core.layout import LayoutError
from . import wire

# The (group name, layout key) pairs every rank of the group has agreed on: checked once, then a set lookup.
# Only valid in the world (default process group) :func:`world` last saw: read it through :func:`agreed`.
AGREED: set = set()
_WORLD: list = [None, object()]  # [weakref to the default process group AGREED belongs to, that world's token]
# Check every collective, not only the first per layout (one 8-byte all-gather each): closes the gap
# described above, for debugging configs. Set DTENSOR_QUANT_AGREE_EVERY_CALL=1, or this attribute.
EVERY_CALL = config.get("agree_every_call")


def world() -> object:
    """A token for the current default process group, new when that group is (after ``destroy_process_group``
    and ``init_process_group``: torch then hands out the old group names again). Seeing a new one empties
    :data:`AGREED`. Holders of an "agreed" mark (a gather plan's) keep the token and compare it by identity:
    about 0.2 us, against an 8-byte all-gather skipped."""
    pg = _world.default_pg
    seen = _WORLD[0]
    if seen is None or seen() is not pg:
        AGREED.clear()
        _WORLD[0], _WORLD[1] = (None if pg is None else weakref.ref(pg)), object()
    return _WORLD[1]


def agreed(group_name: str, key: tuple) -> bool:
    """Whether every rank of ``group_name`` has agreed on ``key`` in this world (and checks are not forced on
    every call)."""
    world()
    return not EVERY_CALL and (group_name, key) in AGREED


def layout_key(q) -> tuple:
    """What must be the same on every rank for ``q``'s bytes to mean the same (hashable, cheap)."""
    inner = tuple((t.dtype, tuple(t.shape)) for t in q.inner.values())
    # Relations are frozen dataclasses: hashable, and printed the same on every rank for the fingerprint.
    return (q.fmt, q.rels, q.dims, q.dtype, tuple(q.shape), inner)


def describe_key(key: tuple) -> str:
    fmt, rels, dims, dtype, shape, inner = key[0], key[1], key[2], key[3], key[4], key[5]
    parts = ", ".join(
        f"{n}={s}:{str(d).removeprefix('torch.')} {[str(x) for x in r]}"
        for n, (d, s), r in zip(fmt.inner_names, inner, rels)
    )
    orient = "" if dims == tuple((i,) for i in range(len(dims))) else f", dims={dims}"
    return f"{fmt!r} of shape {shape}, {str(dtype).removeprefix('torch.')}{orient} ({parts})"


def check_same(
    group_name: str, key: tuple, sample: torch.Tensor, what: str, describe: Callable[[tuple], str] = describe_key
) -> None:
    """Raise ``LayoutError`` on every rank of ``group_name`` unless all of them pass the same ``key``.

    Every rank of the group must call this at the same point (it is a
    collective the first time a key is seen). ``what`` names the operation;
    ``sample`` is a tensor on the group's device.
    """
    if agreed(group_name, key):
        return
    if is_tracing(sample):
        return
    text = describe(key)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(sample.device)
    group = _resolve_process_group(group_name)
    # Recorded once, as what it is (not as one of the data all-gathers a wire log selects).
    wire.note("dtensor_quant::agree", mine, quantized=False, group=group)
    c10d = torch.ops._c10d_functional
    with _disable_current_modes():
        got = c10d.wait_tensor(c10d.all_gather_into_tensor(mine, group.size(), group_name))
    if bool((got.view(-1, 8) == mine).all()):
        AGREED.add((group_name, key))
        return
    texts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(texts, text, group=group)
    held = "; ".join(f"rank {dist.get_global_rank(group, i)}: {t}" for i, t in enumerate(texts))
    raise LayoutError(
        f"{what}: the ranks hold this tensor in different layouts ({held}). Every rank must quantize the same "
        "weight with the same format and constants; check that all ranks run with the same configuration."
    )


def group_name_of(process_group) -> str:
    """The name functional collectives use for a c10d ``ProcessGroup`` (or a name already)."""
    if isinstance(process_group, str):
        return process_group
    if isinstance(process_group, torch.ScriptObject):  # what c10d ops receive
        process_group = dist.ProcessGroup.unbox(process_group)
    return process_group.group_name


def constants_differ(what: str, names, values: list[list[torch.Tensor]], ranks: list[int]) -> LayoutError:
    """The error for ranks whose copies of the inner tensors ``names`` differ (``values[i]``: rank ``ranks[i]``'s)."""
    held = "; ".join(
        f"rank {r}: " + ", ".join(f"{n}={_preview(t)}" for n, t in zip(names, row)) for r, row in zip(ranks, values)
    )
    names = ", ".join(names)
    return LayoutError(
        f"{what}: the ranks' copies of {names} differ ({held}). Gathers do not send {names} (constant across "
        "shards: every rank keeps its own), so these shards cannot be joined without giving every piece one "
        "rank's value. Shards quantized one by one (DTensor.from_local of each rank's dq.quantize) have "
        "statistics of their own; quantize the sharded dense DTensor instead "
        "(dq.quantize(distribute_tensor(w, mesh, placements), fmt)), whose statistics span every shard."
    )


def _preview(t: torch.Tensor) -> str:
    flat = t.detach().reshape(-1)
    values = ", ".join(f"{v:.6g}" for v in flat[:4].float().tolist())
    return f"[{values}{', ...' if flat.numel() > 4 else ''}]"


def check_digests(group_name: str, named: dict[str, torch.Tensor], what: str) -> None:
    """Raise :func:`constants_differ` on every rank of ``group_name`` unless every rank holds the same bytes in
    each of ``named``'s tensors. A collective: one all-gather of 8 bytes per tensor (a digest), every call."""
    if not named:
        return
    tensors = list(named.values())
    digests = b"".join(
        hashlib.blake2b(
            t.detach().contiguous().reshape(-1).cpu().view(torch.uint8).numpy().tobytes(), digest_size=8
        ).digest()
        for t in tensors
    )
    mine = torch.frombuffer(bytearray(digests), dtype=torch.uint8).to(tensors[0].device)
    group = _resolve_process_group(group_name)
    wire.note("dtensor_quant::agree", mine, quantized=False, group=group)
    c10d = torch.ops._c10d_functional
    with _disable_current_modes():
        got = c10d.wait_tensor(c10d.all_gather_into_tensor(mine, group.size(), group_name))
    if bool((got.view(group.size(), -1) == mine).all()):
        return
    values: list = [None] * group.size()
    dist.all_gather_object(values, [t.detach().reshape(-1)[:4].cpu() for t in tensors], group=group)
    ranks = [dist.get_global_rank(group, i) for i in range(group.size())]
    raise constants_differ(what, list(named), values, ranks)


class RankFailure(RuntimeError):
    """Another rank's failure, raised here because its exception type cannot be rebuilt from a message."""


LOCAL = "local"  # raise_together(..., process_group=LOCAL): only this process takes part, nothing to agree on


def raise_together(
    step: Callable, process_group=None, what: str = "", fallback: type[Exception] = RankFailure, mesh=None
):
    """``step()`` on this rank; if it raised on any rank, raise on every rank (small all-gathers).

    Work that runs no collective (checks, file writes) can fail on some ranks
    only; a rank that raises alone leaves the others waiting in the next
    collective until the process group's timeout. Every rank that takes part
    calls this at the same point: the failing rank re-raises its own
    exception, the others raise one of the same type (builtin
    ``OSError``/``ValueError`` kinds and the library's own types, else
    ``fallback``) whose message names the first failing rank and its error.

    Who takes part: the ranks of ``mesh`` when one is given (one all-gather
    per mesh dim, over that dim's group, so a model on part of the world
    agrees among its own ranks), else those of ``process_group`` (default:
    all). With ``process_group=LOCAL``, or without a process group, it is
    ``step()``.
    """
    error = result = None
    try:
        result = step()
    except Exception as e:  # every kind must reach the other ranks
        error = e
    local = not dist.is_initialized() or process_group is LOCAL
    if mesh is not None and mesh.get_coordinate() is None:
        local = True  # this rank holds no part of the mesh: nobody waits for it
    if local:
        if error is not None:
            raise error
        return result
    me = dist.get_rank()
    errors = [] if error is None else [(me, type(error).__module__, type(error).__qualname__, str(error))]
    for group in [mesh.get_group(d) for d in range(mesh.ndim)] if mesh is not None else [process_group]:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, errors, group=group)
        errors = sorted({e for part in gathered for e in part})
    if error is not None:
        raise error
    if errors:
        rank, module, name, msg = errors[0]
        raise _rebuilt(module, name, f"{what}{': ' if what else ''}rank {rank} failed: {name}: {msg}", fallback)
    return result


def _rebuilt(module: str, name: str, message: str, fallback: type[Exception]) -> Exception:
    """An exception of the class ``module.name`` with ``message``: a builtin one or one of this library's."""
    import builtins
    import sys

    if module == "builtins":
        cls = getattr(builtins, name, None)
    else:
        cls = getattr(sys.modules.get(module), name, None) if module.split(".")[0] == "dtensor_quant" else None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # a constructor that wants other arguments
            pass
    return fallback(message)
