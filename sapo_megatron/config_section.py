"""The base of every config section, wherever the section lives (beside the feature that reads it).

Outside the ``config`` package on purpose: a section module imports it without running ``config/__init__``, which
imports every section (``config.run``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated, inf / nan refused."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
