"""checkpoint/hf/safetensors_io: slices read as stored; damaged safetensors files and indexes:
each refused before any tensor is read, naming the file and the fault.

Every case starts from a valid checkpoint written by the safetensors package
and breaks one thing, the way a truncated download, a bad tool or a hostile
file would. Before the checks, several of these loaded silently wrong values
(a header length one byte short shifts every tensor by a byte; negative or
overlapping offsets read header bytes or another tensor's bytes) and the rest
failed with errors that named no file (``struct.error``, ``JSONDecodeError``,
``KeyError: 'weight_map'``, an empty ``MemoryError``).
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant.checkpoint import CheckpointFormatError

pytest.importorskip("safetensors")

A = torch.arange(12, dtype=torch.float32).reshape(3, 4)
B = torch.arange(6, dtype=torch.int16).reshape(2, 3)


def write_valid(path) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({"a": A, "b": B}, str(path / "model.safetensors"), metadata={"format": "pt"})


def parts(file):
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :], n


def rewrite(file, header=None, data=None, length=None) -> None:
    """``file`` with its header object, data area or header length replaced (the text padded as safetensors does)."""
    old_header, old_data, _ = parts(file)
    text = json.dumps(old_header if header is None else header).encode()
    text += b" " * (-len(text) % 8)
    n = len(text) if length is None else length
    file.write_bytes(struct.pack("<Q", n) + text + (old_data if data is None else data))


def entries(file) -> dict:
    return parts(file)[0]


def with_entry(file, key, **changes) -> dict:
    header = entries(file)
    header[key] = dict(header[key], **changes)
    return header


def damage(kind: str, root) -> str:
    """Break the checkpoint at ``root`` in one way; returns the name of the file the error must name."""
    f = root / "model.safetensors"
    raw = f.read_bytes()
    _, _, n = parts(f)
    a_begin, a_end = entries(f)["a"]["data_offsets"]
    b_begin, b_end = entries(f)["b"]["data_offsets"]
    if kind == "shorter_than_8_bytes":
        f.write_bytes(raw[:5])
    elif kind == "truncated_header":
        f.write_bytes(raw[: 8 + n // 2])
    elif kind == "truncated_data":
        f.write_bytes(raw[:-3])
    elif kind == "appended_bytes":
        f.write_bytes(raw + b"\0" * 8)
    elif kind == "header_length_one_short":  # the JSON still parses (its last byte is padding): every tensor shifts
        f.write_bytes(struct.pack("<Q", n - 1) + raw[8:])
    elif kind == "header_length_one_long":
        f.write_bytes(struct.pack("<Q", n + 1) + raw[8:])
    elif kind == "header_length_zero":
        f.write_bytes(struct.pack("<Q", 0) + raw[8:])
    elif kind == "header_length_2_62":
        f.write_bytes(struct.pack("<Q", 2**62) + raw[8:])
    elif kind == "not_json":
        text = b"{not json" + b" " * (n - 9)
        f.write_bytes(raw[:8] + text + raw[8 + n :])
    elif kind == "json_list":
        rewrite(f, header=[1, 2, 3])
    elif kind == "entry_not_object":
        rewrite(f, header=dict(entries(f), a=[1, 2]))
    elif kind == "negative_offsets":
        rewrite(f, header=with_entry(f, "a", data_offsets=[a_begin - 8, a_end - 8]))
    elif kind == "overlapping_offsets":  # b's 12 bytes inside a's 48: same sizes, shared bytes
        rewrite(f, header=with_entry(f, "b", data_offsets=[a_begin, a_begin + (b_end - b_begin)]))
    elif kind == "offsets_past_the_end":
        rewrite(f, header=with_entry(f, "b", data_offsets=[b_begin + 64, b_end + 64]))
    elif kind == "wrong_size":
        rewrite(f, header=with_entry(f, "a", shape=[3, 5]))
    elif kind == "negative_shape":
        rewrite(f, header=with_entry(f, "a", shape=[-3, -4]))
    elif kind == "unknown_dtype":
        rewrite(f, header=with_entry(f, "a", dtype="Q4_K"))
    elif kind == "gap":
        header = with_entry(f, "b", data_offsets=[b_begin + 8, b_end + 8])
        rewrite(f, header=header, data=f.read_bytes()[8 + n :] + b"\0" * 8)
    elif kind == "duplicate_key":
        text = f.read_bytes()[8 : 8 + n].decode().rstrip()
        dup = text[:-1] + ',"a":' + json.dumps(entries(f)["a"]) + "}"
        body = dup.encode() + b" " * (-len(dup) % 8)
        f.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    elif kind == "bad_metadata":
        rewrite(f, header=dict(entries(f), __metadata__={"format": 1}))
    else:
        raise AssertionError(kind)
    return f.name


FILE_DAMAGE = [
    ("shorter_than_8_bytes", "too short"),
    ("truncated_header", "past the end"),
    ("truncated_data", "past the .*data area"),
    ("appended_bytes", "cover"),
    ("header_length_one_short", "cover|belong to no tensor"),
    ("header_length_one_long", "JSON|cover"),
    ("header_length_zero", "header length is 0"),
    ("header_length_2_62", "header length is 4611686018427387904"),
    ("not_json", "not valid UTF-8 JSON"),
    ("json_list", "not an object"),
    ("entry_not_object", "tensor a: expected an object"),
    ("negative_offsets", "data_offsets .* non-negative"),
    ("overlapping_offsets", "overlap"),
    ("offsets_past_the_end", "past the"),
    ("wrong_size", r"needs 60 bytes"),
    ("negative_shape", "non-negative integers"),
    ("unknown_dtype", "Q4_K"),
    ("gap", "belong to no tensor"),
    ("duplicate_key", "twice"),
    ("bad_metadata", "__metadata__"),
]


def test_damage_cases_start_from_a_readable_file(tmp_path):
    write_valid(tmp_path)
    with dq.hf.Checkpoint(tmp_path) as ck:
        assert torch.equal(ck.read("a"), A) and torch.equal(ck.read("b"), B)


@pytest.mark.parametrize("kind,words", FILE_DAMAGE, ids=[k for k, _ in FILE_DAMAGE])
def test_damaged_file_is_refused_naming_it(tmp_path, kind, words):
    write_valid(tmp_path)
    name = damage(kind, tmp_path)
    with pytest.raises(CheckpointFormatError, match=words) as e:
        dq.hf.Checkpoint(tmp_path)
    assert isinstance(e.value, ValueError)
    assert str(tmp_path / name) in str(e.value), str(e.value)


# -- index files --------------------------------------------------------------------------------


def write_sharded(root) -> None:
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    save_file({"a": A}, str(root / "model-00001-of-00002.safetensors"))
    save_file({"b": B}, str(root / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def break_index(kind: str, root) -> None:
    index = root / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    if kind == "not_json":
        index.write_text('{"weight_map": ')
        return
    if kind == "not_an_object":
        data = ["a", "b"]
    elif kind == "no_weight_map":
        del data["weight_map"]
    elif kind == "weight_map_not_object":
        data["weight_map"] = ["model-00001-of-00002.safetensors"]
    elif kind == "missing_file":
        data["weight_map"]["b"] = "model-00003-of-00003.safetensors"
    elif kind == "path_outside":
        data["weight_map"]["b"] = "../elsewhere/model.safetensors"
    elif kind == "wrong_file_for_key":
        data["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    elif kind == "key_in_no_file":
        data["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    elif kind == "empty_map":
        data["weight_map"] = {}
    else:
        raise AssertionError(kind)
    index.write_text(json.dumps(data))


INDEX_DAMAGE = [
    ("not_json", "not valid JSON"),
    ("not_an_object", "'weight_map' object"),
    ("no_weight_map", "'weight_map' object"),
    ("weight_map_not_object", "'weight_map' object"),
    ("missing_file", r"do not exist: \['model-00003-of-00003.safetensors'\]"),
    ("path_outside", "not the name of a file in the checkpoint directory"),
    ("wrong_file_for_key", "b to model-00001-of-00002.safetensors"),
    ("key_in_no_file", "c to model-00001-of-00002.safetensors .no file holds it"),
    ("empty_map", "empty"),
]


@pytest.mark.parametrize("kind,words", INDEX_DAMAGE, ids=[k for k, _ in INDEX_DAMAGE])
def test_damaged_index_is_refused_naming_it(tmp_path, kind, words):
    write_sharded(tmp_path)
    with dq.hf.Checkpoint(tmp_path) as ck:  # the undamaged index reads
        assert torch.equal(ck.read("b"), B)
    break_index(kind, tmp_path)
    with pytest.raises(CheckpointFormatError, match=words) as e:
        dq.hf.Checkpoint(tmp_path)
    assert str(tmp_path / "model.safetensors.index.json") in str(e.value), str(e.value)


def test_a_damaged_file_behind_an_index_is_named(tmp_path):
    write_sharded(tmp_path)
    name = "model-00002-of-00002.safetensors"
    raw = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(raw[:-1])
    with pytest.raises(CheckpointFormatError, match=r"past the .*data area") as e:
        dq.hf.Checkpoint(tmp_path)
    assert str(tmp_path / name) in str(e.value)


def test_our_own_exports_pass_the_checks(tmp_path):
    """dq.hf.save's files (padded headers, an index) and the safetensors package's read back alike."""
    from safetensors.torch import load_file

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16)).to(torch.bfloat16)
    dq.hf.save(model, tmp_path, max_shard_bytes=2048)
    assert (tmp_path / "model.safetensors.index.json").exists()
    with dq.hf.Checkpoint(tmp_path) as ck:
        for f in tmp_path.glob("*.safetensors"):
            for k, v in load_file(str(f)).items():
                assert torch.equal(ck.read(k), v), k


def test_reads_only_the_slice(tmp_path):
    """A column slice reads one run per row; a row slice one run; counted bytes are the slice's."""
    from safetensors.torch import save_file

    t = torch.arange(6 * 10 * 4, dtype=torch.float32).reshape(6, 10, 4)
    save_file({"t": t}, str(tmp_path / "model.safetensors"))
    with dq.hf.Checkpoint(tmp_path) as ck:
        assert torch.equal(ck.read("t", (1, 3, 0), (2, 5, 4)), t[1:3, 3:8])
        assert ck.bytes_read == 2 * 5 * 4 * 4
        assert torch.equal(ck.read("t", (2, 0, 1), (3, 10, 2)), t[2:5, :, 1:3])
        assert torch.equal(ck.read("t"), t)


def test_a_file_given_for_the_checkpoint_directory_is_named(tmp_path):
    """Before: NotADirectoryError about '<file>/.dq_hf_save.commit'."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match=r"model.safetensors is a file: .*the directory that holds it"):
        dq.hf.Checkpoint(tmp_path / "model.safetensors")
