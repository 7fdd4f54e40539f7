"""torchtitan 0.3.0's own components with the library's converter, optimizer and checkpoint manager, on gloo ranks.

The Llama3 debug model (2 layers) built in torchtitan's order (meta -> convert
-> parallelize -> to_empty -> init_weights) trains with int8 trainable
weights and AdamW8bit; torchtitan's CheckpointManager (the library's
subclass) saves at step 2, fresh ranks resume from it, and every weight's and
optimizer state's stored bytes equal the uninterrupted run's, step for step
(``tests/support/titan_cases.py``). Skipped without torchtitan (the test
extras install it).
"""

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is a test extra")

from tests.support import titan_cases as tc

pytestmark = pytest.mark.filterwarnings("ignore")


def same(a: dict, b: dict) -> list[str]:
    """The names whose stored bytes differ (or that one side lacks)."""
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            bad.append(k)
        elif not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            bad.append(k)
    return bad


def resume_case(ranks, dp, tp, folder, timeout=600):
    n = dp * tp
    straight = ranks(n).run(tc.train, dp, tp, folder, 4, 2, timeout=timeout)[0]
    resumed = ranks(n).run(tc.train, dp, tp, folder, 4, None, 2, timeout=timeout)[0]
    return straight, resumed


@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)], ids=["fsdp2", "tp2"])
def test_trains_and_resumes_byte_identically(ranks, tmp_path, dp, tp):
    straight, resumed = resume_case(ranks, dp, tp, str(tmp_path))
    # every Linear weight is quantized but the fused wqkv (its state-dict hook reshapes it to 4-D)
    assert straight["quantized"] == [n for n in straight["linears"] if ".wqkv." not in n]
    assert any(".wo." in n for n in straight["quantized"]) and "lm_head.weight" in straight["quantized"]
    assert all(torch.isfinite(torch.tensor(straight["losses"])))
    assert same(straight["initial"], straight["saved"])  # the steps changed the weights: the resume has work to do
    keys = set(straight["saved"])
    assert any(".sr_step" in k for k in keys) and any(".exp_avg_sq." in k for k in keys), sorted(keys)[:20]
    assert not same(straight["saved"], resumed["loaded"])  # the checkpoint restores every byte
    assert not same(straight["end"], resumed["end"])  # and the resumed run continues bit for bit
    assert straight["losses"][2:] == resumed["losses"]
    stored = {p.name for p in (tmp_path / "checkpoint" / "step-2").iterdir()}
    assert ".metadata" in stored


def test_a_checkpoint_loads_on_another_world_size(ranks, tmp_path):
    """Saved under FSDP2 on 2 ranks, loaded under TP 2 and on 1 rank: every stored byte as saved."""
    folder = str(tmp_path)
    saved = ranks(2).run(tc.train, 2, 1, folder, 2, 2, timeout=600)[0]["saved"]
    for dp, tp in [(1, 2), (1, 1)]:
        loaded = ranks(dp * tp).run(tc.train, dp, tp, folder, 2, None, 2, timeout=600)[0]["loaded"]
        assert not same(saved, loaded), (dp, tp)


def test_torchtitans_own_manager_is_refused_on_every_rank_naming_the_librarys(ranks, tmp_path):
    """torchtitan's stock CheckpointManager cannot take quantized weights (docs/frameworks.md says why): its save
    and its load raise on every rank, before DCP starts (no file written), naming dq.torchtitan.CheckpointManager."""
    results = ranks(2).run(tc.stock_manager, 2, 1, str(tmp_path), timeout=600)
    for rank, out in enumerate(results):
        for what in ("save", "load"):
            assert out[what] is not None, (rank, what)
            kind, message = out[what]
            assert kind == "RuntimeError" and "dtensor_quant.torchtitan.CheckpointManager" in message, (rank, out)
        assert out["files"] == [], (rank, out["files"])


@pytest.mark.slow  # 4 ranks on 2 cores
def test_fsdp2_x_tp2_resumes_byte_identically(ranks, tmp_path):
    straight, resumed = resume_case(ranks, 2, 2, str(tmp_path), timeout=900)
    assert not same(straight["saved"], resumed["loaded"])
    assert not same(straight["end"], resumed["end"])


def test_the_model_only_export_casts_dense_tensors_only_and_loads_back_with_the_trained_bytes(ranks, tmp_path):
    """torchtitan's end-of-training save (``save(last_step=True)``, ``last_save_model_only``, ``export_dtype``
    bfloat16) under FSDP2 on 2 ranks: each quantized weight is written as stored (its inner tensors' dtypes), every
    dense tensor in bfloat16. The float32 model the same config builds loads it back, through torchtitan's
    ``initial_load_path`` (2 ranks) and ``dq.checkpoint.load`` (1 rank): the trained quantized bytes exactly, the
    dense tensors as the trained ones cast to bfloat16 and back."""
    out = ranks(2).run(tc.export_last, 2, 1, str(tmp_path), 2, timeout=600)[0]
    trained, written = out["trained"], out["written"]
    assert out["quantized"] and out["logical_dtypes"] == [str(torch.float32)], out["logical_dtypes"]
    inner = {f"{n}.{k.rsplit('.', 1)[1]}" for n in out["quantized"] for k in trained if k.startswith(f"model.{n}.")}
    assert inner and inner <= set(written), sorted(inner - set(written))
    for key in inner:
        assert written[key] == str(trained[f"model.{key}"].dtype), (key, written[key])
    dense = set(written) - inner
    assert dense and all(written[k] == str(torch.bfloat16) for k in dense), {k: written[k] for k in dense}

    path = str(tmp_path / "checkpoint" / "step-2")
    quantized = {k for k in trained if any(k.startswith(f"model.{n}.") for n in out["quantized"])}
    for n, how in [(2, "titan"), (1, "dq")]:
        result = ranks(n).run(tc.load_export, n, 1, str(tmp_path / how), path, how, timeout=600)[0]
        assert "error" not in result, result.get("error")
        loaded = result["loaded"]
        assert set(loaded) == set(trained)
        assert not same({k: trained[k] for k in quantized}, {k: loaded[k] for k in quantized}), how
        exported = {k: trained[k].to(torch.bfloat16).float() for k in set(trained) - quantized}
        assert not same(exported, {k: loaded[k] for k in exported}), how
        assert same({k: trained[k] for k in exported}, exported)  # the cast changed the dense tensors
