"""``quant_method: "dtensor_quant"`` known to transformers as soon as transformers loads its quantizers.

transformers reads a checkpoint's ``quantization_config`` through its registry
(``transformers.quantizers.register_quantization_config`` /
``register_quantizer``, its extension point for libraries). A directory that
``save_pretrained`` wrote from a model loaded with
:class:`dtensor_quant.hf.QuantConfig` names ``"dtensor_quant"``; were it not
registered when ``from_pretrained`` reads it, transformers would warn and load
the stored inner tensors as unknown keys, leaving the weights random.

Importing transformers' quantizers takes seconds (it imports every backend it
knows), and transformers is an optional dependency, so ``import
dtensor_quant`` imports none of it: :func:`install` registers at once when
``transformers.quantizers`` is already imported, else it waits for that import
(a finder on ``sys.meta_path`` that steps aside after the one module) and
registers right after it. Nothing of transformers or torch is replaced.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "transformers.quantizers"
INSTALL_HINT = "pip install 'dtensor_quant[hf]'"


def quant_config_class():
    """``dtensor_quant.hf.QuantConfig`` (importing transformers, registering the method), or ImportError."""
    try:
        from . import hf_quantizer
    except ImportError as e:
        if "transformers" not in str(e):
            raise
        raise ImportError(
            f"dtensor_quant.hf.QuantConfig is transformers' quantization_config for this library and needs "
            f"transformers >= 5 ({e}); install it with: {INSTALL_HINT}"
        ) from e
    hf_quantizer.register()
    return hf_quantizer.QuantConfig


class _AfterImport(importlib.abc.MetaPathFinder):
    """Registers once ``transformers.quantizers`` has been executed; finds nothing itself."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once: the real finders answer from here on
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register_quietly()

        spec.loader.exec_module = exec_module  # this spec's own loader object, made for this import
        return spec


def _register_quietly() -> None:
    """Register, unless this transformers has no registry (< 5): then QuantConfig says why when asked for.

    When the quantizer module is itself being imported (QuantConfig asked for
    first: its import loads transformers' quantizers), that import registers.
    """
    if __name__.rpartition(".")[0] + ".hf_quantizer" in sys.modules:
        return
    try:
        quant_config_class()
    except ImportError:
        pass


def install() -> None:
    """Register now if transformers' quantizers are loaded, else right after they are (idempotent)."""
    if TARGET in sys.modules:
        _register_quietly()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
