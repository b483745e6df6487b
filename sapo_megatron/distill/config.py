"""The ``teachers`` config section and the checks that tie it to ``algorithm.fusion`` (run before any process
group exists; :class:`~sapo_megatron.config.RunConfig` calls :func:`check_distillation`).

A teacher scores the student's own samples (teacher log-probs of the sampled tokens, at temperature 1). It is a
rollout server of the same kind as the rollout engine: ``engine: cpu`` loads an HF checkpoint into the CPU engine
in process, ``engine: cpu_http`` serves it behind its SGLang-compatible HTTP server; ``engine: sglang`` talks to
SGLang workers (``urls``, a ``router_url`` or an ``endpoints_file``, as ``rollout`` does). Each teacher serves the
prompt ``domains`` it lists; the one marked ``default`` (or the only teacher) serves every other prompt.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sapo_megatron.algo import Fusion, PolicyLoss, check_fusion_loss
from sapo_megatron.errors import UserError
from sapo_megatron.rollout.config import CPU_ENGINES, EngineKind

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
"""Teacher names: they appear in metric names (``teacher/<name>/...``) and directory names."""


class DistillConfigError(UserError, ValueError):
    """Prompts that no teacher serves (found when the prompt data is built, before the model)."""

    exit_code = 2


class TeacherConfig(BaseModel):
    """One teacher: where it runs, which prompt domains it serves."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: str = Field(pattern=NAME_PATTERN, description="names the teacher in metrics and errors")
    engine: EngineKind = Field(
        default="cpu",
        description="cpu (the CPU engine in process), cpu_http (served from an in-process CPU server and scored "
        "over HTTP, exactly as an SGLang teacher would be) or sglang (SGLang servers)",
    )
    model_path: str | None = Field(
        default=None,
        description="engine cpu / cpu_http: the teacher's HF checkpoint directory (config + safetensors)",
    )
    urls: list[str] = Field(default_factory=list, description="engine sglang: the teacher's worker URLs")
    router_url: str | None = Field(default=None, description="engine sglang: an sglang-router for /generate")
    endpoints_file: str | None = Field(
        default=None, description="engine sglang: JSON with router_url and workers, written by a rollout job"
    )
    api_key_env: str = Field(
        default="SAPO_TEACHER_API_KEY",
        description="environment variable holding the teacher servers' API key (sent as a Bearer token when set)",
    )
    tokenizer: str | None = Field(
        default=None,
        description="the teacher's tokenizer ('char' or a directory), checked equal to the student's at start; "
        "default: the teacher's model_path (cpu) or the tokenizer_path its server reports in /get_model_info",
    )
    domains: list[str] = Field(
        default_factory=list, description="prompt domains (PromptRow.domain) it serves"
    )
    default: bool = Field(default=False, description="serves every prompt whose domain no teacher lists")
    timeout_s: float = Field(default=600.0, gt=0.0, description="per scoring request")
    max_retries: int = Field(default=3, ge=0, description="further attempts of a failed scoring request")
    concurrency: int = Field(default=64, ge=1, description="scoring requests in flight at once (HTTP)")
    startup_timeout_s: float = Field(default=900.0, gt=0.0, description="wait for healthy servers at start")
    threads: int | None = Field(default=None, ge=1, description="engine cpu: torch threads of the teacher")

    @model_validator(mode="after")
    def _check_engine(self) -> TeacherConfig:
        where = f"teachers[{self.name}]"
        servers = [key for key in ("urls", "router_url", "endpoints_file") if getattr(self, key)]
        if self.engine in CPU_ENGINES:
            if not self.model_path:
                raise ValueError(
                    f"{where}: engine {self.engine} needs model_path (the teacher's HF checkpoint directory)"
                )
            if servers:
                raise ValueError(
                    f"{where}: {servers[0]} is for engine sglang; remove it or set engine: sglang"
                )
        else:
            if not servers:
                raise ValueError(
                    f"{where}: engine sglang needs urls (worker URLs), router_url or endpoints_file"
                )
            if self.model_path:
                raise ValueError(
                    f"{where}: model_path is for engine cpu / cpu_http; an SGLang teacher serves the model "
                    "it was launched with"
                )
            if self.endpoints_file and (self.urls or self.router_url):
                raise ValueError(f"{where}: endpoints_file already names the servers; drop urls / router_url")
        repeated = sorted({d for d in self.domains if self.domains.count(d) > 1})
        if repeated:
            raise ValueError(f"{where}: domains {repeated} listed twice")
        return self


def default_teacher(teachers: Sequence[TeacherConfig]) -> TeacherConfig | None:
    """The teacher of prompts whose domain no teacher lists: the one marked ``default``, else the only
    teacher when it lists no domains; None when there is none (such a prompt is then an error)."""
    marked = [t for t in teachers if t.default]
    if marked:
        return marked[0]
    if len(teachers) == 1 and not teachers[0].domains:
        return teachers[0]
    return None


def domain_teachers(teachers: Sequence[TeacherConfig]) -> dict[str, str]:
    """Domain → name of the teacher serving it (listed domains only)."""
    return {domain: t.name for t in teachers for domain in t.domains}


def prompt_domains(rows: Sequence) -> list[str]:
    """The domains of ``rows`` (``PromptRow.domain``, None left out), sorted: the distillation step's domain ids."""
    return sorted({row.domain for row in rows if row.domain is not None})


def check_domains_served(teachers: Sequence[TeacherConfig], rows: Sequence, source: str) -> None:
    """Every prompt of ``rows`` has a teacher: its domain is listed, or a default teacher exists."""
    if not teachers or default_teacher(teachers) is not None:
        return
    served = domain_teachers(teachers)
    for index, row in enumerate(rows):
        if row.domain not in served:
            raise DistillConfigError(
                f"{source} row {index}: no teacher serves its domain {row.domain!r} (teachers list "
                f"{sorted(served)})",
                hint="add the domain to a teacher's domains, or mark one teacher default: true",
            )


def check_distillation(
    teachers: Sequence[TeacherConfig],
    fusion: Fusion,
    loss: PolicyLoss,
    correction_name: str,
    *,
    student_logp: str = "trainer",
    temperature: float = 1.0,
) -> None:
    """Config-time checks of ``teachers`` with ``algorithm.fusion`` (raise ValueError naming the fields)."""
    check_fusion_loss(fusion, loss)
    if teachers and student_logp == "engine" and temperature != 1.0:
        raise ValueError(
            f"algorithm.opd_student_logp='engine' takes the rollout engine's log-probs, which are at "
            f"rollout.temperature={temperature}, while teachers score at temperature 1 (an identical teacher would "
            "give A_opd != 0); use algorithm.opd_student_logp: trainer (computed at temperature 1) or "
            "rollout.temperature: 1.0"
        )
    names = [t.name for t in teachers]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"teachers: names {repeated} are used twice; every teacher needs its own name")
    served: dict[str, str] = {}
    for teacher in teachers:
        for domain in teacher.domains:
            if domain in served:
                raise ValueError(
                    f"teachers: domain {domain!r} is listed by {served[domain]!r} and {teacher.name!r}; "
                    "one teacher per domain (MOPD routes each prompt to exactly one teacher)"
                )
            served[domain] = teacher.name
    marked = [t.name for t in teachers if t.default]
    if len(marked) > 1:
        raise ValueError(f"teachers: {marked} are all marked default; mark one")
    if fusion.mode != "rl" and not teachers:
        raise ValueError(
            f"algorithm.fusion.mode={fusion.mode!r} distils from a teacher, and the config has no teachers; "
            "add a teachers section (name, engine, model_path or urls) or use algorithm.fusion.mode 'rl'"
        )
    if fusion.mode == "mopd" and correction_name != "none":
        raise ValueError(
            f"algorithm.fusion.mode='mopd' applies its own masked importance weight (eps_low..eps_high), and "
            f"algorithm.correction={correction_name!r} would weight the tokens a second time; set "
            "algorithm.correction: {name: none}"
        )


def safe_metric_name(text: str) -> str:
    """A domain name usable as a metric-name part (``/`` and spaces would split it)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text) or "_"
