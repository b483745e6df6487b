"""Teachers on the main rank: built from the ``teachers`` config section, checked against the student's
tokenizer, and asked to score each RL step's samples while the rewards are being computed.

Scoring is the rollout interface's :meth:`~sapo_megatron.rollout.base.RolloutEngine.score`: SGLang's
``/generate`` with the whole prompt + response as ``input_ids``, ``max_new_tokens: 0``, ``return_logprob: true``,
``logprob_start_len: 0``, reading ``meta_info.input_token_logprobs[1:]`` over the response span (the CPU engine
and the CPU server answer the same request the same way). Those are log-probs of the raw logits, i.e. at
temperature 1: SGLang ignores the sampling temperature for input log-probs, and so do we.

A teacher over HTTP has the rollout client's retries and failover; a teacher that still fails raises
:class:`TeacherError` naming it. A sample is never trained without its teacher log-probs.

MOPD: each prompt goes to the teacher of its ``domain`` (one teacher per sample, no averaging); prompts of a
domain no teacher lists go to the default teacher.

Images: a sample of a prompt with images is scored with them (the engines' ``score(..., images=)``: the prompt's
PNGs, the image-pad targets masked, which are prompt positions and never trained). A response in which the policy
sampled ``<|image_pad|>`` itself is scored up to that token only: SGLang takes every pad id of ``input_ids`` for an
image placeholder (HTTP 500 when there are more pads than images), so no teacher can score the rest; those tokens
get the rollout's own log-prob (a distillation advantage of ~0) and are counted in ``teacher/unscored_tokens``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from sapo_megatron.data.prompts import PromptRow
from sapo_megatron.data.tokenizer import load_tokenizer
from sapo_megatron.distill.config import TeacherConfig, default_teacher, domain_teachers
from sapo_megatron.errors import UserError
from sapo_megatron.model.batching import TrainSequence
from sapo_megatron.rollout.base import LocalServer, RolloutEngine, RolloutError
from sapo_megatron.rollout.collect import RolloutBatch, prompt_images
from sapo_megatron.rollout.types import ImageInputs, Sample

Log = Callable[[str], None]
_CLIENT_COUNTERS = ("rollout/transient_errors", "rollout/retries", "rollout/failovers")


class TeacherError(UserError, RuntimeError):
    """A teacher that cannot be used: its tokenizer differs from the student's, it has no model or servers, or
    it failed to score samples after its retries (the step stops rather than train without them)."""


@dataclass
class Teacher:
    """One built teacher: its config, its engine (CPU engine or SGLang client) and, for ``cpu_http``, the
    in-process CPU server the client talks to."""

    cfg: TeacherConfig
    engine: RolloutEngine
    server: LocalServer | None = None
    model_info: dict | None = None
    """An SGLang teacher's ``GET /get_model_info`` (its ``tokenizer_path`` / ``model_path``)."""

    @property
    def name(self) -> str:
        return self.cfg.name

    def score(
        self, samples: Sequence[Sample], images: Sequence[ImageInputs | None] | None = None
    ) -> list[list[float]]:
        """Teacher log-probs of each sample's response tokens (``len(response_ids)`` values, all finite);
        ``images[i]``: the images of sample ``i``'s prompt. Tokens from a sampled image pad on get the rollout's
        log-prob (see the module docstring)."""
        if not samples:
            return []
        images = list(images) if images is not None else [None] * len(samples)
        cuts = [scorable_tokens(s, image) for s, image in zip(samples, images, strict=True)]
        ids = [[*s.prompt_ids, *s.response_ids[:cut]] for s, cut in zip(samples, cuts)]
        try:
            starts = [len(s.prompt_ids) for s in samples]
            with_images = {"images": images} if any(i is not None for i in images) else {}
            scored = self.engine.score(ids, starts, **with_images)
        except RolloutError as exc:
            raise TeacherError(
                f"teacher {self.name!r} failed to score {len(samples)} samples: {exc}",
                hint=f"check the teacher's servers, or raise teachers[{self.name}].max_retries / timeout_s; "
                "no sample is trained without its teacher log-probs, so the run stops here",
            ) from exc
        values = [
            [*logp, *s.rollout_logp[cut:]] if len(logp) == cut else logp
            for s, logp, cut in zip(samples, scored, cuts, strict=True)
        ]
        for sample, logp in zip(samples, values, strict=True):
            if len(logp) != len(sample.response_ids) or not all(math.isfinite(v) for v in logp):
                raise TeacherError(
                    f"teacher {self.name!r} returned {len(logp)} log-probs (finite: "
                    f"{all(math.isfinite(v) for v in logp)}) for the {len(sample.response_ids)} response tokens "
                    f"of group {sample.group_id} sample {sample.sample_index}"
                )
        return values

    def counters(self) -> dict[str, float]:
        """The client's cumulative error counters (empty for the in-process engine, which has none)."""
        metrics = self.engine.metrics()
        return {key: float(metrics.get(key, 0.0)) for key in _CLIENT_COUNTERS}

    def close(self) -> None:
        self.engine.close()
        if self.server is not None:
            self.server.stop()


def scorable_tokens(sample: Sample, images: ImageInputs | None) -> int:
    """How many of the sample's response tokens a teacher can score: all, unless the prompt has images and the
    policy sampled an image pad (then those before it)."""
    response = sample.response_ids
    if images is None or images.pad_id not in response:
        return len(response)
    return response.index(images.pad_id)


class Teachers:
    """The run's teachers and the domain → teacher routing. ``scoring`` is held while a rollout's samples are
    scored: the fully-async producer's chunks in flight score one after the other, each counting its own errors."""

    def __init__(self, teachers: Sequence[Teacher]) -> None:
        if not teachers:
            raise ValueError("Teachers needs at least one teacher")
        self.teachers = {t.name: t for t in teachers}
        self.scoring = threading.Lock()
        configs = [t.cfg for t in teachers]
        self._by_domain = domain_teachers(configs)
        fallback = default_teacher(configs)
        self._default = None if fallback is None else self.teachers[fallback.name]

    def teacher_for(self, domain: str | None) -> Teacher:
        """The teacher of a prompt of ``domain``; :class:`TeacherError` when no teacher serves it."""
        name = self._by_domain.get(domain) if domain is not None else None
        if name is not None:
            return self.teachers[name]
        if self._default is None:
            raise TeacherError(
                f"no teacher serves prompts of domain {domain!r} (teachers list {sorted(self._by_domain)})",
                hint="add the domain to a teacher's domains, or mark one teacher default: true",
            )
        return self._default

    def check_rows(self, rows: Sequence[PromptRow], source: str) -> None:
        """Every prompt of ``rows`` has a teacher (raises :class:`TeacherError` naming the first that has none)."""
        for index, row in enumerate(rows):
            try:
                self.teacher_for(row.domain)
            except TeacherError as exc:
                raise TeacherError(f"{source} row {index}: {exc}", hint=exc.hint) from None

    def counters(self) -> dict[str, float]:
        total = dict.fromkeys(_CLIENT_COUNTERS, 0.0)
        for teacher in self.teachers.values():
            for key, value in teacher.counters().items():
                total[key] += value
        return total

    def close(self) -> None:
        for teacher in self.teachers.values():
            teacher.close()


# ------------------------------------------------------------------------------------------------ building


def build_teachers(
    configs: Sequence[TeacherConfig], student_tokenizer, *, seed: int, log: Log = print
) -> Teachers | None:
    """The teachers of the run (main rank), each checked for the student's tokenizer; None without teachers."""
    if not configs:
        return None
    built: list[Teacher] = []
    try:
        for cfg in configs:
            teacher = _build_teacher(cfg, seed=seed, log=log)
            built.append(teacher)
            check_tokenizer(cfg, _teacher_tokenizer_spec(teacher), student_tokenizer)
    except BaseException:
        for teacher in built:
            teacher.close()
        raise
    return Teachers(built)


def _build_teacher(cfg: TeacherConfig, *, seed: int, log: Log) -> Teacher:
    if cfg.engine == "sglang":
        return _sglang_teacher(cfg, log)
    from sapo_megatron.rollout.cpu.engine import CPUEngine

    if not cfg.model_path:  # TeacherConfig refuses this for engine cpu
        raise TeacherError(f"teachers[{cfg.name}] (engine {cfg.engine}) needs model_path")
    path = Path(cfg.model_path)
    if not (path / "config.json").is_file():
        raise TeacherError(
            f"teachers[{cfg.name}].model_path {cfg.model_path} holds no HF checkpoint (config.json)",
            hint="point it at a teacher's HF directory (a run's <output_dir>/hf, e.g. made by "
            "`sapo-megatron compare --teachers ...`)",
        )
    cpu = CPUEngine.from_pretrained(path, seed=seed, num_threads=cfg.threads)
    if cfg.engine == "cpu":
        return Teacher(cfg, cpu)
    from sapo_megatron.rollout.cpu.server import CPUServer
    from sapo_megatron.rollout.sglang.client import SGLangClient

    server = CPUServer(cpu).start()
    client = SGLangClient(
        [server.url], max_concurrency=cfg.concurrency, timeout_s=cfg.timeout_s, max_retries=cfg.max_retries
    )
    return Teacher(cfg, client, server)


def _sglang_teacher(cfg: TeacherConfig, log: Log) -> Teacher:
    import httpx

    from sapo_megatron.rollout.sglang.client import SGLangClient
    from sapo_megatron.rollout.sglang.topology import auth_headers, resolve_topology

    api_key = os.environ.get(cfg.api_key_env) or None
    topology = resolve_topology(
        urls=cfg.urls,
        router_url=cfg.router_url,
        endpoints_file=cfg.endpoints_file,
        api_key=api_key,
        timeout_s=cfg.startup_timeout_s,
        log=lambda line: log(f"teacher {cfg.name}: {line}"),
    )
    worker = topology.workers[0]
    try:
        reply = httpx.get(worker + "/get_model_info", headers=auth_headers(api_key), timeout=60.0)
        info = reply.json() if reply.status_code == 200 else {}
    except (httpx.TransportError, ValueError):
        info = {}
    client = SGLangClient(
        list(topology.workers),
        router_url=topology.router if topology.generate_via_router else None,
        api_key=api_key,
        tp_size=list(topology.tp_sizes) or 1,
        max_concurrency=cfg.concurrency,
        timeout_s=cfg.timeout_s,
        max_retries=cfg.max_retries,
    )
    return Teacher(cfg, client, model_info=info if isinstance(info, dict) else {})


def _teacher_tokenizer_spec(teacher: Teacher) -> str:
    """Where the teacher's tokenizer is: the configured one, the CPU teacher's model directory, or the
    ``tokenizer_path`` (else ``model_path``) that an SGLang worker reports in ``GET /get_model_info``."""
    cfg = teacher.cfg
    if cfg.tokenizer:
        return cfg.tokenizer
    if cfg.engine != "sglang":
        return str(cfg.model_path)
    info = teacher.model_info or {}
    path = info.get("tokenizer_path") or info.get("model_path")
    if not path:
        raise TeacherError(
            f"teacher {cfg.name!r}: its server reports no tokenizer_path or model_path in /get_model_info, so "
            "its tokenizer cannot be checked against the student's",
            hint=f"set teachers[{cfg.name}].tokenizer to a local copy of the teacher's tokenizer",
        )
    return str(path)


def check_tokenizer(cfg: TeacherConfig, spec: str, student_tokenizer) -> None:
    """Refuse a teacher whose tokenizer maps text to other ids than the student's: its log-probs would score
    other tokens than the ones sampled."""
    try:
        teacher_tokenizer = load_tokenizer(spec)
    except UserError as exc:
        raise TeacherError(
            f"teacher {cfg.name!r}: cannot load its tokenizer from {spec!r} to compare it with the student's: "
            f"{exc}",
            hint=f"set teachers[{cfg.name}].tokenizer to a local copy of the teacher's tokenizer",
        ) from None
    if teacher_tokenizer.fingerprint() != student_tokenizer.fingerprint():
        raise TeacherError(
            f"teacher {cfg.name!r} has another tokenizer than the student (teacher: {spec}, vocabulary "
            f"{teacher_tokenizer.vocab_size}; student: vocabulary {student_tokenizer.vocab_size}); its log-probs "
            "would be of other tokens than the sampled ones",
            hint="distil from a teacher that shares the student's tokenizer (data.tokenizer)",
        )


# ------------------------------------------------------------------------------------------------ scoring


class TeacherScoring:
    """One RL step's teacher scoring on the main rank: :meth:`submit` (collect's ``on_generated``) starts scoring
    a generation round's samples in a background thread, so it overlaps with the reward computation;
    :meth:`attach` waits for it and puts the log-probs and domains into the training sequences. Without
    teachers both are no-ops."""

    def __init__(
        self, teachers: Teachers | None, domains: Sequence[str], *, image_pad_id: int | None = None
    ) -> None:
        self.teachers = teachers
        # the tokenizer's <|image_pad|>: prompts with images are scored with them
        self.image_pad_id = image_pad_id
        self._domain_ids: dict[str | None, int] = {domain: index for index, domain in enumerate(domains)}
        self._jobs: list[Future] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="teacher") if teachers is not None else None
        self._busy_s = 0.0
        self._unscored = 0
        self._errors: dict[str, float] = {}  # the client's error counters, grown by this step's scoring

    def submit(self, prompts: Sequence[PromptRow], groups: Sequence[Sequence[Sample]]) -> None:
        """Start scoring the samples of the groups that nothing aborted (aborted groups are never trained)."""
        teachers = self.teachers
        if self._pool is None or teachers is None:
            return
        by_teacher: dict[str, list[tuple[Sample, ImageInputs | None]]] = {}
        for row, group in zip(prompts, groups):
            if any(s.finish_reason == "abort" for s in group):
                continue
            images = prompt_images(row, self.image_pad_id)
            name = teachers.teacher_for(row.domain).name
            by_teacher.setdefault(name, []).extend((sample, images) for sample in group)
        self._jobs.append(self._pool.submit(self._score, teachers, by_teacher))

    def _score(
        self, teachers: Teachers, by_teacher: dict[str, list[tuple[Sample, ImageInputs | None]]]
    ) -> dict[int, tuple[Sample, str, list[float]]]:
        started = time.perf_counter()
        scored: dict[int, tuple[Sample, str, list[float]]] = {}
        with teachers.scoring:
            before = teachers.counters()
            try:
                for name, pairs in by_teacher.items():
                    samples, images = [s for s, _ in pairs], [i for _, i in pairs]
                    for sample, logp in zip(samples, teachers.teachers[name].score(samples, images)):
                        scored[id(sample)] = (sample, name, logp)  # holding the sample keeps its id unique
                    self._unscored += sum(len(s.response_ids) - scorable_tokens(s, i) for s, i in pairs)
            finally:
                for key, value in teachers.counters().items():
                    self._errors[key] = self._errors.get(key, 0.0) + value - before.get(key, 0.0)
        self._busy_s += time.perf_counter() - started
        return scored

    def attach(self, sequences: list[TrainSequence], batch: RolloutBatch) -> list[TrainSequence]:
        """``sequences`` (in ``batch``'s sample order) with ``teacher_logp`` and ``domain_id`` set; adds the
        teacher metrics to ``batch.metrics``. Raises :class:`TeacherError` when a teacher failed."""
        teachers = self.teachers
        if self._pool is None or teachers is None:
            return sequences
        started = time.perf_counter()
        try:
            scored: dict[int, tuple[Sample, str, list[float]]] = {}
            for job in self._jobs:
                scored.update(job.result())
        finally:
            self._pool.shutdown(wait=True)
        waited = time.perf_counter() - started
        samples = [(row, s) for row, group in zip(batch.prompts, batch.groups) for s in group]
        if len(samples) != len(sequences):
            raise RuntimeError(f"{len(sequences)} training sequences for {len(samples)} samples")
        out, per_teacher = [], dict.fromkeys(teachers.teachers, 0)
        for seq, (row, sample) in zip(sequences, samples):
            held, name, logp = scored.get(id(sample), (None, "", []))
            if held is not sample:
                raise RuntimeError(f"{seq.sample_id}: no teacher scored it (was it generated by collect?)")
            per_teacher[name] += 1
            out.append(replace(seq, teacher_logp=logp, domain_id=self._domain_ids.get(row.domain, -1)))
        batch.metrics.update(self._metrics(teachers, per_teacher, waited))
        return out

    def _metrics(self, teachers: Teachers, per_teacher: dict[str, int], waited: float) -> dict[str, float]:
        errors = {key: self._errors.get(key, 0.0) for key in teachers.counters()}
        metrics = {
            "time/teacher_s": self._busy_s,
            "time/teacher_wait_s": waited,
            "teacher/sequences": float(sum(per_teacher.values())),
            "teacher/errors": errors["rollout/transient_errors"],
            "teacher/retries": errors["rollout/retries"],
            "teacher/failovers": errors["rollout/failovers"],
            "teacher/unscored_tokens": float(self._unscored),
        }
        metrics.update({f"teacher/{name}/sequences": float(n) for name, n in per_teacher.items()})
        return metrics
