"""core/torch_patches: a patch replaces only the torch code it was written for, loudly, and can be undone.

The behaviour each real patch fixes has its own test that fails the day torch changes under it:
tests/distributed/parallel/test_compile_key.py::test_dtensor_cache_key_names_the_quantized_local (_parallel/compile_key)
tests/distributed/fsdp/test_reshard_after_forward.py::test_torch_still_needs_the_reshard_patch
(fsdp/reshard_after_forward) and tests/parallel/test_replicate_to_shard.py::test_one_step_without_dispatch
(_parallel/replicate_to_shard, a patch for speed: torch's code still chunks every piece and clones) and
tests/distributed/parallel/test_shard_to_shard.py::test_one_gather_and_one_cut_without_dispatch
(_parallel/shard_to_shard, for speed: torch's code still splits the gathered tensor into every piece).
"""

import types
import warnings

import pytest
import torch

import dtensor_quant as dq
from dtensor_quant._core.torch_patches import PATCHES, TorchPatchError, fingerprint, replace
from dtensor_quant._fsdp.reshard_after_forward import handles, install_fsdp_post_forward_reshard


class Target:
    def method(self):
        return "torch"

    @property
    def prop(self):
        return "torch"


def wrapped(original):
    def method(self):
        return "patched+" + original(self)

    return method


@pytest.fixture
def target():
    """A fresh class per test, and the registry left as it was."""
    before = dict(PATCHES)
    cls = type("Target", (Target,), {"method": Target.method, "prop": Target.__dict__["prop"]})
    yield cls
    PATCHES.clear()
    PATCHES.update(before)


def test_replaces_the_member_it_was_written_for_and_can_be_undone(target):
    patch = replace("t1", "test", {(target, "method"): (fingerprint(Target.method), wrapped)})
    assert target().method() == "patched+torch"
    assert patch.original(target, "method")(target()) == "torch"
    with patch.removed():
        assert target().method() == "torch"
    assert target().method() == "patched+torch"
    assert replace("t1", "test", {}) is patch  # installed once


def test_a_property_stays_a_property(target):
    replace("t2", "test", {(target, "prop"): (fingerprint(Target.__dict__["prop"].fget), wrapped)})
    assert isinstance(target.__dict__["prop"], property) and target().prop == "patched+torch"


def test_other_source_or_missing_member_raises_before_replacing_anything(target, monkeypatch):
    monkeypatch.delenv("DTENSOR_QUANT_UNTESTED_TORCH", raising=False)
    good = (fingerprint(Target.method), wrapped)
    with pytest.raises(TorchPatchError, match=r"Target\.prop is not the code the patch was written for"):
        replace("t3", "test", {(target, "method"): good, (target, "prop"): ("0000000000000000", wrapped)})
    assert target().method() == "torch" and "t3" not in PATCHES  # nothing replaced
    with pytest.raises(TorchPatchError, match=r"Target\.gone does not exist"):
        replace("t4", "test", {(target, "gone"): good})


def test_untested_torch_installs_with_a_warning_only_when_asked(target, monkeypatch):
    monkeypatch.setenv("DTENSOR_QUANT_UNTESTED_TORCH", "1")
    with pytest.warns(RuntimeWarning, match="written against torch 2.13"):
        replace("t5", "test", {(target, "method"): ("0000000000000000", wrapped)})
    assert target().method() == "patched+torch"


def test_a_wrapping_patch_on_a_torch_without_the_member_warns_that_it_is_not_installed(target):
    with pytest.warns(RuntimeWarning, match="NOT installed"):
        assert replace("t6", "test", {(target, "gone"): ("0", wrapped)}, strict=False) is None


def test_the_real_patches_are_installed_against_this_torch():
    """The first quantized tensor installs the compile key; fully_shard's integer reshard installs the FSDP2 one.

    (``import dtensor_quant`` alone installs nothing: tests/test_import.py checks that in a fresh process.)"""
    dq.quantize(torch.randn(8, 64), dq.Int8Rowwise())
    assert "compile_key" in PATCHES and "redistribute_check" in PATCHES
    assert install_fsdp_post_forward_reshard() is PATCHES["fsdp_post_forward_reshard"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # this torch is the tested one: no warning
        install_fsdp_post_forward_reshard()


def fsdp_param(local, dim=0, is_dtensor=False):
    """What the FSDP2 patch reads off an FSDPParam."""
    fields = dict.fromkeys(
        ("all_gather_outputs", "post_forward_mesh_info", "mesh_info", "sharded_state", "_extensions_data")
    )
    return types.SimpleNamespace(
        sharded_param=types.SimpleNamespace(_local_tensor=local),
        is_dtensor=is_dtensor,
        fsdp_placement=types.SimpleNamespace(dim=dim),
        **fields,
    )


def test_fsdp_patch_handles_only_this_librarys_parameters():
    q = dq.quantize(torch.randn(8, 64), dq.Int8Rowwise())
    assert handles(fsdp_param(q))
    assert handles(fsdp_param(dq.GatherQuantized(torch.randn(8, 64), dq.Int8Rowwise())))
    assert not handles(fsdp_param(q, dim=1)) and not handles(fsdp_param(q, is_dtensor=True))
    assert not handles(fsdp_param(torch.randn(8, 64)))

    class OtherLibrarysTensor(torch.Tensor):  # e.g. torchao's NF4Tensor: it has the hooks, it is not ours
        def fsdp_pre_all_gather(self, mesh):
            return (self,), None

    assert not handles(fsdp_param(torch.randn(8, 64).as_subclass(OtherLibrarysTensor)))
