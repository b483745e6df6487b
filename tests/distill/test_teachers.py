"""Teachers on the main rank: HTTP scoring equals the in-process teacher, MOPD routing by domain, the tokenizer
check, and a dead teacher server (failover, or a clear error)."""

from __future__ import annotations

import threading

import pytest

from sapo_megatron.data.prompts import PromptRow
from sapo_megatron.data.tokenizer import CharTokenizer
from sapo_megatron.distill.config import TeacherConfig
from sapo_megatron.distill.teachers import (
    Teacher,
    TeacherError,
    Teachers,
    TeacherScoring,
    build_teachers,
)
from sapo_megatron.model.batching import TrainSequence
from sapo_megatron.rollout.base import RolloutEngine, RolloutError
from sapo_megatron.rollout.collect import RolloutBatch
from sapo_megatron.rollout.cpu.engine import CPUEngine
from sapo_megatron.rollout.cpu.server import CPUServer
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.types import GenerationRequest, Sample, SamplingParams
from tests.distill.models import make_teacher

HTTP_TOLERANCE = 1e-6
"""HTTP vs in-process scoring of one engine: JSON carries the floats exactly; the only difference is that the
server scores one sequence per request while the in-process call pads a batch (fp32 rounding of the padded
attention), measured at 0 to 5e-7 here."""


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return make_teacher(tmp_path_factory.mktemp("teacher") / "hf", sharpen=4.0)


def _samples(engine: CPUEngine) -> list[Sample]:
    tok = CharTokenizer()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    prompts = ["12+34=", "7*8=", "99+1=", "5+5="]
    requests = [
        GenerationRequest(prompt_ids=tok.encode(p, add_bos=True), n=3, sampling=sampling, group_id=i)
        for i, p in enumerate(prompts)
    ]
    return [s for group in engine.generate(requests) for s in group]


def test_http_scoring_equals_the_in_process_teacher(teacher_dir):
    local = CPUEngine.from_pretrained(teacher_dir, seed=0, num_threads=1)
    samples = _samples(local)
    cfg = TeacherConfig(name="t", model_path=str(teacher_dir))
    in_process = Teacher(cfg, local).score(samples)
    with CPUServer(CPUEngine.from_pretrained(teacher_dir, seed=0, num_threads=1)) as server:
        over_http = Teacher(cfg, SGLangClient([server.url])).score(samples)
    assert [len(v) for v in over_http] == [len(s.response_ids) for s in samples]
    worst = max(abs(a - b) for x, y in zip(in_process, over_http) for a, b in zip(x, y))
    assert worst <= HTTP_TOLERANCE
    # A teacher identical to the rollout engine scores each sampled token at the engine's own log-prob
    # (temperature 1 sampling): the response span lines up token for token.
    gap = max(abs(a - b) for s, v in zip(samples, in_process) for a, b in zip(s.rollout_logp, v))
    assert gap < 1e-5


def test_build_teachers_over_http_and_the_tokenizer_check(teacher_dir, tmp_path):
    cfg = TeacherConfig(name="t", model_path=str(teacher_dir), engine="cpu_http")
    teachers = build_teachers([cfg], CharTokenizer(), seed=0)
    try:
        teacher = teachers.teacher_for("anything")
        assert teacher.server is not None and isinstance(teacher.engine, SGLangClient)
    finally:
        teachers.close()
    other = make_teacher(tmp_path / "other", seed=1)
    CharTokenizer("0123456789+-*=").save(other)  # same model shape, another vocabulary
    with pytest.raises(TeacherError, match=r"teacher 'x' has another tokenizer than the student"):
        build_teachers([TeacherConfig(name="x", model_path=str(other))], CharTokenizer(), seed=0)
    with pytest.raises(TeacherError, match=r"holds no HF checkpoint"):
        build_teachers([TeacherConfig(name="x", model_path=str(tmp_path))], CharTokenizer(), seed=0)


class _ConstantTeacher(RolloutEngine):
    """Scores every response token with one value (which teacher scored a token is then visible)."""

    def __init__(self, value: float) -> None:
        self.value, self.calls = value, 0

    def score(self, token_ids_list, response_start):
        self.calls += 1
        return [[self.value] * (len(ids) - start) for ids, start in zip(token_ids_list, response_start)]

    def generate(self, requests):
        raise NotImplementedError

    def update_weights_from_disk(self, path):
        raise NotImplementedError

    def update_weights_from_tensors(self, named_tensors):
        raise NotImplementedError

    def flush_cache(self):
        pass

    def health(self):
        return True


def _group(group_id: int, n: int = 2) -> list[Sample]:
    return [
        Sample(
            group_id=group_id,
            sample_index=i,
            prompt_ids=[1, 5],
            response_ids=[7] * (i + 2),
            rollout_logp=[-1.0] * (i + 2),
            finish_reason="stop",
        )
        for i in range(n)
    ]


def test_mopd_sends_each_prompt_to_its_domains_teacher():
    teachers = Teachers(
        [
            Teacher(TeacherConfig(name="add", model_path="-", domains=["addition"]), _ConstantTeacher(-1.0)),
            Teacher(
                TeacherConfig(name="mul", model_path="-", domains=["multiplication"]), _ConstantTeacher(-2.0)
            ),
            Teacher(TeacherConfig(name="rest", model_path="-", default=True), _ConstantTeacher(-3.0)),
        ]
    )
    rows = [
        PromptRow("1+1=", "2", "addition"),
        PromptRow("2*3=", "6", "multiplication"),
        PromptRow("x", "y", None),
        PromptRow("4+4=", "8", "addition"),
    ]
    groups = [_group(g) for g in range(4)]
    scoring = TeacherScoring(teachers, ["addition", "multiplication"])
    scoring.submit(rows[:2], groups[:2])  # two generation rounds, as collect makes with refills
    scoring.submit(rows[2:], groups[2:])
    batch = RolloutBatch(rows, groups, rewards=None, advantages=None)
    sequences = [TrainSequence(s.prompt_ids, s.response_ids) for g in groups for s in g]
    scored = scoring.attach(sequences, batch)
    expected = {"addition": (-1.0, 0), "multiplication": (-2.0, 1), None: (-3.0, -1)}
    for seq, row in zip(scored, [row for row in rows for _ in range(2)]):
        value, domain_id = expected[row.domain]
        assert seq.teacher_logp == [value] * len(seq.response_ids) and seq.domain_id == domain_id
    assert batch.metrics["teacher/add/sequences"] == 4 and batch.metrics["teacher/mul/sequences"] == 2
    assert batch.metrics["teacher/rest/sequences"] == 2 and batch.metrics["teacher/sequences"] == 8
    assert {t.name: t.engine.calls for t in teachers.teachers.values()} == {"add": 2, "mul": 1, "rest": 1}


def test_a_prompt_no_teacher_serves_is_an_error():
    teachers = Teachers(
        [Teacher(TeacherConfig(name="add", model_path="-", domains=["addition"]), _ConstantTeacher(-1.0))]
    )
    with pytest.raises(TeacherError, match=r"no teacher serves prompts of domain 'multiplication'"):
        teachers.teacher_for("multiplication")


def test_aborted_groups_are_not_scored_and_only_scored_samples_are_attached():
    engine = _ConstantTeacher(-1.0)
    teachers = Teachers([Teacher(TeacherConfig(name="t", model_path="-"), engine)])
    aborted = _group(1)
    aborted[0].finish_reason = "abort"
    scoring = TeacherScoring(teachers, [])
    scoring.submit([PromptRow("a", "b"), PromptRow("c", "d")], [_group(0), aborted])
    other = RolloutBatch([PromptRow("c", "d")], [aborted], rewards=None, advantages=None)
    with pytest.raises(RuntimeError, match=r"no teacher scored it"):
        scoring.attach([TrainSequence([1], [7, 7]), TrainSequence([1], [7, 7, 7])], other)
    assert engine.calls == 1  # one round, the aborted group left out


def _dead_url() -> str:
    from tests.ports import free_port

    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def test_a_dead_teacher_server_fails_over_to_the_live_one(teacher_dir):
    local = CPUEngine.from_pretrained(teacher_dir, seed=0, num_threads=1)
    samples = _samples(local)[:4]
    expected = Teacher(TeacherConfig(name="t", model_path="-"), local).score(samples)
    with CPUServer(CPUEngine.from_pretrained(teacher_dir, seed=0, num_threads=1)) as server:
        client = SGLangClient([_dead_url(), server.url], backoff_s=0.01, max_concurrency=1)
        teachers = Teachers([Teacher(TeacherConfig(name="t", model_path="-"), client)])
        scoring = TeacherScoring(teachers, [])
        rows = [PromptRow("p", "g")] * len(samples)
        scoring.submit(rows, [[s] for s in samples])
        batch = RolloutBatch(rows, [[s] for s in samples], rewards=None, advantages=None)
        scored = scoring.attach([TrainSequence(s.prompt_ids, s.response_ids) for s in samples], batch)
    got = [v for s in scored for v in s.teacher_logp]
    assert got == pytest.approx([v for row in expected for v in row], abs=HTTP_TOLERANCE)
    assert batch.metrics["teacher/errors"] >= 1 and batch.metrics["teacher/failovers"] >= 1


def test_a_teacher_whose_servers_are_all_dead_stops_with_a_clear_error(teacher_dir):
    local = CPUEngine.from_pretrained(teacher_dir, seed=0, num_threads=1)
    samples = _samples(local)[:2]
    client = SGLangClient([_dead_url()], backoff_s=0.01, max_retries=1, timeout_s=5.0)
    teacher = Teacher(TeacherConfig(name="big", model_path="-"), client)
    with pytest.raises(
        TeacherError, match=r"teacher 'big' failed to score 2 samples: request failed on 2 attempts"
    ) as err:
        teacher.score(samples)
    assert "no sample is trained without its teacher log-probs" in err.value.hint


def vl_teacher_logp(engine: RolloutEngine, directory, renderer, rows, spec) -> tuple[list, dict, list]:
    """OPD's teacher scoring of samples of prompts with images (``TeacherScoring`` with the image-pad id, as the
    RL step makes it): the scored sequences, the step's teacher metrics, and per sequence the transformers
    reference log-probs of the response tokens a teacher can score. The samples are the CPU engine's, plus one
    whose response holds a sampled ``<|image_pad|>``, scored up to it."""
    from sapo_megatron.algo import AdvantageConfig
    from sapo_megatron.rollout.collect import CollectSettings, generate_groups
    from tests.rollout.test_cpu_engine_images import reference

    local = CPUEngine.from_pretrained(directory, seed=0)
    settings = CollectSettings(
        n_samples=2,
        sampling=SamplingParams(max_new_tokens=6, temperature=1.0),
        advantage=AdvantageConfig(),
        image_pad_id=spec.pad_id,
    )
    groups = generate_groups(local, rows, renderer.encode, settings, seed=1)
    first = groups[1][0]  # two images
    groups[1].append(
        Sample(
            group_id=1,
            sample_index=2,
            prompt_ids=list(first.prompt_ids),
            response_ids=[*first.response_ids[:2], spec.pad_id, first.response_ids[0]],
            rollout_logp=[*first.rollout_logp[:2], -0.5, -0.25],
            finish_reason="stop",
        )
    )
    teachers = Teachers([Teacher(TeacherConfig(name="vl", model_path=str(directory)), engine)])
    scoring = TeacherScoring(teachers, [], image_pad_id=spec.pad_id)
    scoring.submit(rows, groups)
    batch = RolloutBatch(rows, groups, rewards=None, advantages=None)
    sequences = [TrainSequence(s.prompt_ids, s.response_ids) for g in groups for s in g]
    scored = scoring.attach(sequences, batch)
    references = []
    for row, group in zip(rows, groups):
        for sample in group:
            response = sample.response_ids
            cut = response.index(spec.pad_id) if spec.pad_id in response else len(response)
            logp, _ = reference(local, row, sample.prompt_ids + response[:cut], spec)
            references.append(logp[len(sample.prompt_ids) - 1 :].tolist())
    local.close()
    return scored, batch.metrics, references


@pytest.mark.slow
def test_a_vl_teacher_scores_with_the_prompts_images(tmp_path):
    """A VL teacher served over HTTP (the CPU server: SGLang's wire format, one pad per image + data URIs)
    scores the response tokens of image prompts as transformers does with the images."""
    from tests.vl_fixtures import build_tiny_vl_checkpoint, vl_prompts

    directory = build_tiny_vl_checkpoint(tmp_path / "vl")
    renderer, rows, spec = vl_prompts(directory)
    with CPUServer(CPUEngine.from_pretrained(directory, seed=0)) as server:
        scored, metrics, references = vl_teacher_logp(
            SGLangClient([server.url]), directory, renderer, rows, spec
        )
    worst = max(abs(a - b) for seq, ref in zip(scored, references) for a, b in zip(seq.teacher_logp, ref))
    print(f"VL teacher (CPU server) vs transformers with the images: max |dlogp| {worst:.2e}")
    assert worst < 1e-5
    assert all(len(seq.teacher_logp) == len(seq.response_ids) for seq in scored)
    padded = next(seq for seq in scored if spec.pad_id in seq.response_ids)
    assert padded.teacher_logp[2:] == [-0.5, -0.25]  # from the sampled pad on: the rollout's own log-probs
    assert metrics["teacher/unscored_tokens"] >= 2 and metrics["teacher/sequences"] == 7


def test_scoring_a_sampled_image_pad_over_http_is_refused_before_sending():
    """SGLang takes every image-pad id for an image placeholder: the client refuses such a sequence, naming it,
    without a request (the dead URL is never contacted). Teachers score up to the pad instead."""
    from sapo_megatron.rollout.types import ImageInputs

    images = ImageInputs(png=(b"png",), pad_id=9)
    client = SGLangClient([_dead_url()], max_retries=0)
    with pytest.raises(RolloutError, match=r"sequence 0 holds 2 runs of the image-pad token 9 for 1 images"):
        client.score([[1, 9, 9, 2, 5, 9, 3]], 4, images=[images])
    client.close()


class _CountingTeacher(_ConstantTeacher):
    """Counts one retry per sequence it scores, and how many score calls ran at once."""

    def __init__(self) -> None:
        super().__init__(-1.0)
        self.retries, self.active, self.most = 0, 0, 0
        self.second = threading.Event()

    def score(self, token_ids_list, response_start):
        self.active += 1
        self.most = max(self.most, self.active)
        if self.active > 1:
            self.second.set()
        else:  # give a second chunk's scoring the chance to come in (it would count its retries into this one's)
            self.second.wait(0.2)
        self.retries += len(token_ids_list)
        self.active -= 1
        return super().score(token_ids_list, response_start)

    def metrics(self):
        return {"rollout/retries": float(self.retries)}


def test_concurrent_chunks_score_one_at_a_time_and_count_their_own_teacher_errors():
    """The fully-async producer's chunks in flight each build a TeacherScoring: their scoring takes turns on the
    teachers, and each chunk's ``teacher/retries`` counts its own calls only."""
    engine = _CountingTeacher()
    teachers = Teachers([Teacher(TeacherConfig(name="t", model_path="-"), engine)])
    metrics: dict[int, dict[str, float]] = {}

    def chunk(index: int, groups: int) -> None:
        rows = [PromptRow("p", "g")] * groups
        batch_groups = [_group(g) for g in range(groups)]
        scoring = TeacherScoring(teachers, [])
        scoring.submit(rows, batch_groups)
        batch = RolloutBatch(rows, batch_groups, rewards=None, advantages=None)
        sequences = [TrainSequence(s.prompt_ids, s.response_ids) for group in batch_groups for s in group]
        scoring.attach(sequences, batch)
        metrics[index] = batch.metrics

    threads = [threading.Thread(target=chunk, args=(i, groups)) for i, groups in enumerate((1, 3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert engine.most == 1
    assert (
        metrics[0]["teacher/retries"] == 2.0 and metrics[1]["teacher/retries"] == 6.0
    )  # 2 samples per group
