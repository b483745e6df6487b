"""Modules that moved when the package was grouped by role (docs/architecture.md): importing an old name raises
``ModuleNotFoundError`` that names the new one, instead of a bare "No module named ...". Installed by the
package's ``__init__``; it answers only for the names below."""

from __future__ import annotations

import importlib.abc
import sys

MOVED = {
    "trainer": "loop.trainer",
    "session": "loop.session",
    "rollout_pipeline": "loop.pipeline",
    "replay": "loop.replay",
    "checkpointing": "loop.checkpointing",
    "step_metrics": "loop.step_metrics",
    "inputs": "loop.inputs",
    "run_dir": "runtime.run_dir",
    "interrupts": "runtime.interrupts",
    "tracking": "runtime.tracking",
    "logs": "runtime.logs",
    "step_health": "runtime.step_health",
    "local_launch": "runtime.local_launch",
    "arch": "model.arch",
    "tiny": "model.tiny",
    "precision": "model.precision",
    "batching": "model.batching",
    "packing": "model.packing",
    "serve_flags": "rollout.cpu.flags",
    "eval.training": "loop.evaluation",
    "rollout.sglang_client": "rollout.sglang.client",
    "rollout.topology": "rollout.sglang.topology",
    "rollout.cpu_engine": "rollout.cpu.engine",
    "rollout.cpu_server": "rollout.cpu.server",
    "rollout.cpu_server_http": "rollout.cpu.http",
    "rollout.cpu_server_weights": "rollout.cpu.weights",
    "rollout.server_process": "rollout.cpu.process",
}
"""Old module (relative to ``sapo_megatron``) → where it lives now."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Raises for the old names of moved modules; every other import goes on to the next finder."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, rest = fullname.partition(".")
        if package == "sapo_megatron" and rest in MOVED:
            raise ModuleNotFoundError(
                f"{fullname} moved to sapo_megatron.{MOVED[rest]} (docs/architecture.md)", name=fullname
            )
        return None


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
