"""Runs in every Python process started with tools/sglang_cpu/shim on PYTHONPATH (SGLang's scheduler and detokenizer
are spawned processes, so a patch made only in the launcher would not reach them).

Two pieces:

- When ``sglang.srt.mem_cache.pool_host.common`` is imported: SGLang 0.5.23's ``ALLOC_MEMORY_FUNCS`` (that file,
  line 453) maps every device without an entry to ``alloc_with_host_register``, which calls ``cudaHostRegister``;
  ``--enable-return-routed-experts`` allocates its host buffer through it (``srt/state_capturer/base.py:67``). On
  the CPU, host memory is the device memory: a plain ``torch.empty``.
- Only where no torchvision is installed (install.sh's CPU-torch virtualenv; install_vl.sh's has a real one, whose
  ``torchvision.*`` submodules then all load as they are: PyPI's torchvision is built against
  CUDA torch and cannot load beside the CPU build): an inert ``torchvision`` whose every attribute is a placeholder.
  SGLang imports it at start for image models only (``srt/configs/__init__.py`` -> ``multimodal/internvl_utils.py:5``,
  ``configs/deepseek_ocr.py:7``); a text model never calls it, and using a placeholder raises. transformers sees version 0.0.0 and
  keeps to its PIL image processors.

Nothing happens where CUDA is available (the shim's ``sgl_kernel`` refuses to load there).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types

_TARGET = "sglang.srt.mem_cache.pool_host.common"


def _alloc_cpu(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    import torch

    del pin_memory, allocator, registration_granularity_bytes  # nothing to pin or register on a CPU
    return torch.empty(dims, dtype=dtype, device=device)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_cpu

        spec.loader.exec_module = exec_and_patch
        return spec


class _Placeholder:
    """Stands for any torchvision object at import time; calling it on real data raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name}: torchvision is not installed (tools/sglang_cpu serves text models only)"
        )


def _placeholder_attr(module_name: str, attr: str) -> _Placeholder:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Placeholder(f"{module_name}.{attr}")


@functools.lru_cache(maxsize=1)
def _real_torchvision() -> bool:
    return importlib.machinery.PathFinder.find_spec("torchvision") is not None


class _InertTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "torchvision":
            return None
        if _real_torchvision():
            return None  # a real torchvision is installed (install_vl.sh): use it and all its submodules
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        if spec.name == "torchvision":
            # transformers finds the module, then asks its version (no distribution: ``__version__``); below 0.27 it
            # keeps its PIL image processors and imports nothing from torchvision for a text model.
            module.__version__ = "0.0.0"
        module.__getattr__ = functools.partial(_placeholder_attr, spec.name)
        return module

    def exec_module(self, module) -> None:
        pass


for _finder in (_PatchAfterImport(), _InertTorchvision()):
    if not any(type(f) is type(_finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _finder)
