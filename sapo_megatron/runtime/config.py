"""The ``launch`` section: how many processes a job runs on (read by the command line, the local launcher and
the process-group setup)."""

from __future__ import annotations

from pydantic import Field

from sapo_megatron.config_section import Section
from sapo_megatron.model.precision import GpuTypeName


class LaunchConfig(Section):
    """How many processes the job runs on: nodes × processes per node (one per GPU on clusters)."""

    nodes: int = Field(default=1, ge=1)
    procs_per_node: int = Field(default=1, ge=1)
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch threads per process on CPU machines (tiny models: 1 is fastest)",
    )
    timeout_minutes: int = Field(
        default=60,
        ge=1,
        description="process-group timeout: how long ranks wait in a collective (e.g. while rank 0 rolls out)",
    )
    gpu_type: GpuTypeName | None = Field(
        default=None,
        description="the GPU model of the job (h100, h200, b200, ...): refuses FP8 recipes it cannot run (mxfp8 "
        "on Hopper) and gives the planner its memory; training also checks the GPU it finds",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node
