"""checkpoint/dcp on live ranks: save quantized models in one layout, load them in another, bit-exactly.

Every load is checked against the single-process quantization of the same
seed (``tests.support.ckpt_cases.check_against``): each rank's local inner tensors must be
byte-identical to DTensor's own shard of the reference, and so must the
gathered weight. The loading model starts from different random weights, so
a load that silently skipped a tensor fails.
"""

import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

import dtensor_quant as dq
from dtensor_quant import checkpoint as ckpt
from dtensor_quant.testing import FORMATS, assert_same_bits, mesh, weight
from tests.support import ckpt_cases as cc
from tests.support.ckpt_cases import OTHER, SEED, load_model, on, save_model

# Plain dcp calls in this process (no process group) say they assume a single process: that is the intent.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def roundtrip(ranks, fmt_name, src, dst, path, api="dq"):
    on(ranks, src, save_model, fmt_name, src, str(path), api)
    on(ranks, dst, load_model, fmt_name, dst, str(path), api)


# -- save under one layout, load under another ----------------------------------------

RESHARDS = [
    ("tp2", "fsdp4"),  # TP=2 -> FSDP=4 (uneven rows, an empty shard)
    ("2x2", "single"),  # 2x2 mesh -> one process without a process group
    ("single", "2x2"),
    ("s0_2", "s1_2"),  # Shard(0) <-> Shard(1)
    ("s1_2", "s0_2"),
    ("s0_2", "s0_3"),  # world size 2 -> 3, uneven shards
    ("fsdp4", "s0_3"),  # saved with an empty shard (5 rows over 4 ranks)
    ("fsdp_tp", "tp2"),  # FSDP2 + TP (_StridedShard) -> TP
]


@pytest.mark.slow
@pytest.mark.parametrize("fmt_name", ["int8", "int4g32"])
@pytest.mark.parametrize("src,dst", RESHARDS, ids=[f"{a}->{b}" for a, b in RESHARDS])
def test_reshard_bit_exact(ranks, tmp_path, fmt_name, src, dst):
    roundtrip(ranks, fmt_name, src, dst, tmp_path / "ckpt")


def test_uneven_column_shards_int8(ranks, tmp_path):
    """Per-row scales are replicated along columns: Shard(1) on 2 -> 3 ranks (86/85/85 columns)."""
    roundtrip(ranks, "int8", "s1_2", "s1_3", tmp_path / "ckpt")


@pytest.mark.parametrize("api", ["dcp", "dsd"])
@pytest.mark.parametrize("src,dst", [("tp2", "fsdp4"), ("2x2", "single"), ("s0_2", "s0_3")])
def test_plain_dcp_and_distributed_state_dict_apis(ranks, tmp_path, api, src, dst):
    """``dcp.save(model.state_dict())`` and ``get/set_model_state_dict`` work unchanged."""
    roundtrip(ranks, "int4g32", src, dst, tmp_path / "ckpt", api)


def full_state_dict_roundtrip(options: dict):
    """get_model_state_dict(full_state_dict=True) gathers each quantized weight (its stored bytes, a plain
    QuantizedTensor); set_model_state_dict shards it again."""
    src = cc.placed(SEED, "int4g32", "tp2")
    full = get_model_state_dict(src, options=StateDictOptions(full_state_dict=True))
    weight = full["a.weight"]
    assert isinstance(weight, dq.QuantizedTensor) and weight.qdata.dtype == torch.uint8
    assert weight.shape == cc.SHAPES["a"]
    if options.get("broadcast_from_rank0"):  # torch's broadcast makes the receivers' buffers dense from
        full = ckpt.entries_from_state(full)  # size and dtype: rank 0 sends the entry form (docs/checkpoint.md)
    dst = cc.placed(OTHER, "int4g32", "s1_2")
    set_model_state_dict(dst, full, options=StateDictOptions(**options))
    cc.check_against(dst, SEED, "int4g32", "s1_2")


@pytest.mark.parametrize("options", [dict(full_state_dict=True), dict(full_state_dict=True, broadcast_from_rank0=True)])
def test_full_state_dict(ranks, options):
    ranks(2).run(full_state_dict_roundtrip, options)


def test_mixed_apis(ranks, tmp_path):
    """A checkpoint written by plain dcp.save loads with checkpoint.load, and the other way round."""
    ranks(2).run(save_model, "int8", "tp2", str(tmp_path / "a"), "dcp")
    ranks(4).run(load_model, "int8", "fsdp4", str(tmp_path / "a"), "dq")
    ranks(2).run(save_model, "int8", "tp2", str(tmp_path / "b"), "dq")
    ranks(3).run(load_model, "int8", "s0_3", str(tmp_path / "b"), "dsd")


# -- what is on disk ------------------------------------------------------------------


def stored_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.name.endswith(".distcp"))


def payload_bytes(fmt_name) -> int:
    net = cc.reference(SEED, fmt_name)
    return sum(p.nbytes_stored if isinstance(p, dq.QuantizedTensor) else p.nbytes for p in net.parameters())


@pytest.mark.parametrize("fmt_name", ["int8", "int4g32"])
def test_checkpoint_holds_the_quantized_bytes(ranks, tmp_path, fmt_name):
    """The files hold each stored byte once: about the quantized payload, never a dense copy."""
    path = tmp_path / "ckpt"
    ranks(2).run(save_model, fmt_name, "s1_2", str(path))
    dense = sum(p.nbytes for p in cc.dense_net(SEED).parameters())
    payload = payload_bytes(fmt_name)
    md = dcp.FileSystemReader(str(path)).read_metadata()
    entries = {k: v for k, v in md.state_dict_metadata.items() if k.startswith("a.weight")}
    assert set(entries) == {f"a.weight.{n}" for n in FORMATS[fmt_name].inner_names} | {"a.weight.__quant__"}
    # Exactly: the chunks the metadata declares (one per rank's piece; replicas saved once) are the payload.
    declared = sum(
        math.prod(chunk.sizes) * m.properties.dtype.itemsize
        for m in md.state_dict_metadata.values()
        if isinstance(m, TensorStorageMetadata)
        for chunk in m.chunks
    )
    assert declared == payload, (declared, payload)
    # On disk: torch.save framing costs about a kilobyte per stored chunk
    n_chunks = len(md.storage_data)
    assert payload <= stored_bytes(path) <= payload + 1600 * n_chunks, (stored_bytes(path), payload, n_chunks)
    if fmt_name == "int4g32":
        assert stored_bytes(path) - 1600 * n_chunks < 0.4 * dense


# -- checkpoint.save/load of state dicts (not modules) ---------------------------------


def save_state(fmt_name, layout, path):
    net = cc.placed(SEED, fmt_name, layout)
    ckpt.save({"model": net.state_dict(), "step": 5}, path)


def load_state(fmt_name, layout, path, form):
    """Into a nested state dict: entry form (model.state_dict()) or raw quantized parameters."""
    net = cc.placed(OTHER, fmt_name, layout)
    if form == "entries":
        state = {"model": net.state_dict(), "step": 0}
        ckpt.load(state, path)
        net.load_state_dict(state["model"])
    else:
        state = {"model": {k: p.detach() for k, p in net.named_parameters()}, "step": 0}
        ckpt.load(state, path)  # in place: the detached parameters share net's tensors
    assert state["step"] == 5
    cc.check_against(net, SEED, fmt_name, layout)


@pytest.mark.parametrize("form", ["entries", "raw"])
@pytest.mark.parametrize("fmt_name", ["int4g32", None])  # None: a dense checkpoint, quantized on load
def test_load_into_state_dict(ranks, tmp_path, form, fmt_name):
    path = str(tmp_path / "ckpt")
    ranks(2).run(save_state, fmt_name, "tp2", path)
    ranks(2).run(load_state, "int4g32", "s1_2", path, form)


# -- a transposed view of a weight ---------------------------------------------------


def transposed_roundtrip(path, src_dim, dst_dim):
    """A parameter holding ``q.t()`` is saved in the canonical orientation and comes back transposed."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    fmt = FORMATS["int4g32"]

    def holder(seed, dim):
        q = dq.quantize(weight((12, 128), seed), fmt).t()  # logical [128, 12]
        module = nn.Module()
        module.w = nn.Parameter(distribute_tensor(q, mesh(2), [Shard(dim)], src_data_rank=None), requires_grad=False)
        return dq.checkpoint.register(module), q

    saved, expected = holder(SEED, src_dim)
    ckpt.save(saved, path)
    loaded, _ = holder(OTHER, dst_dim)
    ckpt.load(loaded, path)
    assert loaded.w.to_local().dims == ((1,), (0,))
    assert_same_bits(loaded.w.full_tensor(), expected, "transposed")


@pytest.mark.parametrize("src_dim,dst_dim", [(0, 1), (1, 0)])
def test_transposed_weight(ranks, tmp_path, src_dim, dst_dim):
    ranks(2).run(transposed_roundtrip, str(tmp_path / "ckpt"), src_dim, dst_dim)


# -- the large-model workflow: meta init, quantize_, shard, to_empty, load -------------------------


def build_on_meta_and_load(path, fmt_name, how):
    """The large-model workflow: meta init -> quantize_ -> shard -> to_empty -> load (docs/checkpoint.md)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from dtensor_quant import checkpoint as ckpt

    fmt = FORMATS[fmt_name]

    def net():
        return torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False), torch.nn.Linear(128, 64, bias=False))

    torch.manual_seed(4)
    ref = dq.quantize_(net().bfloat16(), fmt)
    ckpt.save(ref, path)
    with torch.device("meta"):
        model = net().bfloat16()
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    if how == "tp_after":
        dq.quantize_(model, fmt)
        parallelize_module(model, mesh(2), plan)
    elif how == "tp_before":
        parallelize_module(model, mesh(2), plan)
        dq.quantize_(model, fmt)
    else:
        dq.quantize_(model, fmt)
        dq.fsdp.fully_shard(model, mesh=mesh(2))
    model.to_empty(device="cpu")
    ckpt.load(model, path)

    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        assert_same_bits(got.full_tensor(), want.detach(), name)
    model(torch.randn(3, 256).bfloat16())  # and it runs


@pytest.mark.parametrize("how", ["tp_after", "tp_before", "fsdp"])
@pytest.mark.parametrize("fmt_name", ["int8", "int4g32", "f8tensor"])
def test_meta_init_quantize_to_empty_load(ranks, tmp_path, fmt_name, how):
    path = str(tmp_path / "ckpt")
    ranks(2).run(build_on_meta_and_load, path, fmt_name, how, timeout=120)
