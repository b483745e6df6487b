"""Generation and scoring over SGLang's ``/generate``: one HTTP request per sample (or scored sequence), each
retried on the next server by :meth:`Fleet.with_failover <sapo_megatron.rollout.sglang.fleet.Fleet.with_failover>`,
so a failure costs one sample, not a group. Every (group, index) slot is filled exactly once.

Replies are checked field by field (:mod:`sapo_megatron.rollout.protocol`); a malformed one raises
:class:`~sapo_megatron.rollout.base.RolloutError` naming the server, the request id and the field.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence

from sapo_megatron.data.vision import collapse_image_pads
from sapo_megatron.rollout.base import RolloutError, normalize_response_starts
from sapo_megatron.rollout.partial import already_ended, continuation_request, splice
from sapo_megatron.rollout.protocol import (
    ParsedGeneration,
    generate_payload,
    parse_generate_reply,
    parse_score_reply,
    png_data_uri,
    score_payload,
)
from sapo_megatron.rollout.sglang.fleet import Fleet, Server
from sapo_megatron.rollout.sglang.memory import MEMORY_TAGS
from sapo_megatron.rollout.types import GenerationRequest, ImageInputs, Sample, mask_image_targets


class GenerationClient:
    """``generate`` and ``score`` of :class:`~sapo_megatron.rollout.sglang.client.SGLangClient` over a fleet.

    ``num_layers`` / ``top_k``: shape of ``routed_experts``; ``vocab_size``: the trainer's vocabulary, an output id
    outside it is refused (None: not checked)."""

    def __init__(
        self, fleet: Fleet, *, num_layers: int | None, top_k: int | None, vocab_size: int | None
    ) -> None:
        self.fleet = fleet
        self.num_layers = num_layers
        self.top_k = top_k
        self.vocab_size = vocab_size

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        for req in requests:
            if req.return_routed_experts and self.num_layers is None:
                raise ValueError(
                    "return_routed_experts needs SGLangClient(num_layers=...) to shape the payload"
                )
        self.fleet.require_memory(MEMORY_TAGS, "generate")
        call_id = uuid.uuid4().hex[:12]
        slots: list[list[Sample | None]] = [[None] * req.n for req in requests]

        def run(req_index: int, sample_index: int, cancel: threading.Event) -> None:
            req = requests[req_index]
            sample = self._generate_one(
                req, sample_index, f"{call_id}-g{req.group_id}-s{sample_index}", cancel
            )
            if slots[req_index][sample_index] is not None:
                raise AssertionError(f"sample {sample_index} of group {req.group_id} produced twice")
            slots[req_index][sample_index] = sample

        self.fleet.run_all([(run, (r, i)) for r, req in enumerate(requests) for i in range(req.n)])
        missing = [
            (requests[r].group_id, i)
            for r, group in enumerate(slots)
            for i, s in enumerate(group)
            if s is None
        ]
        if missing:
            raise AssertionError(f"samples never produced: {missing[:5]}")
        return [[s for s in group if s is not None] for group in slots]

    def _generate_one(
        self, req: GenerationRequest, index: int, rid_base: str, cancel: threading.Event
    ) -> Sample:
        """One sample; when a pause in ``abort`` mode cuts it short, it is continued after
        ``continue_generation`` with the new weights (:mod:`sapo_megatron.rollout.partial`), never restarted."""
        sample, epoch, version = self._attempts(req, index, rid_base, cancel)
        part = 0
        while sample.finish_reason == "abort" and (
            self.fleet.pause.paused or self.fleet.pause.epoch != epoch
        ):
            ended = already_ended(req, sample)
            if ended is not None:  # the abort came after its last token: nothing to continue
                sample = ended
                break
            self.fleet.pause.wait_continued(cancel, self.fleet.timeout_s)
            part += 1
            self.fleet.count("rollout/partial_samples", 1)
            continuation, epoch, next_version = self._attempts(
                continuation_request(req, sample), 0, f"{rid_base}-p{part}", cancel, index=index
            )
            sample = splice(sample, continuation, partial_version=version, continuation_version=next_version)
            version = next_version
        self.fleet.count("rollout/samples", 1)
        self.fleet.count("rollout/generated_tokens", len(sample.response_ids))
        if sample.finish_reason == "abort":
            self.fleet.count("rollout/aborted_samples", 1)
        return sample

    def _attempts(
        self,
        req: GenerationRequest,
        seed_index: int,
        rid_base: str,
        cancel: threading.Event,
        *,
        index: int | None = None,
    ) -> tuple[Sample, int, int]:
        """The sample of ``req``, the client's pause epoch and weight version when it was sent."""
        prompt_ids, image_data = wire_prompt(req)
        epoch, version = self.fleet.pause.epoch, self.fleet.weight_version
        versions: list[list[int] | None] = [None]
        spans = [0]

        def attempt(server: Server, rid: str) -> ParsedGeneration:
            payload = generate_payload(
                prompt_ids,
                req.sampling,
                rid=rid,
                sample_index=seed_index,
                return_routed_experts=req.return_routed_experts,
                routed_experts_start=req.routed_experts_start,
                image_data=image_data,
            )
            reply = self.fleet.request("POST", server, "/generate", payload, request=rid)
            parsed = parse_generate_reply(
                reply,
                prompt_ids=req.prompt_ids,
                max_new_tokens=req.sampling.max_new_tokens,
                rid=rid,
                server=server.url,
                want_routed_experts=req.return_routed_experts,
                num_layers=self.num_layers,
                top_k=self.top_k,
                vocab_size=self.vocab_size,
                routed_experts_start=req.routed_experts_start,
                images=len(image_data or ()),
            )
            versions[0] = token_versions(
                reply, len(parsed.response_ids), low=version, high=self.fleet.weight_version
            )
            spans[0] = len(reply.get("meta_info", {}).get("weight_versions") or ())
            return parsed

        def retry(parsed: ParsedGeneration) -> bool:  # an abort not of this client's pause: try again
            # a pause begun since the request was sent cut it: it is continued (never restarted), also when its
            # reply comes back after continue_generation
            pause = self.fleet.pause
            return parsed.finish_reason == "abort" and not pause.paused and pause.epoch == epoch

        parsed = self.fleet.with_failover(rid_base, attempt, cancel, retry_if=retry)
        if spans[0] and versions[0] is None:
            self.fleet.count("rollout/partial_unsplit", 1)  # spans of labels that are not this client's
        sample = Sample(
            group_id=req.group_id,
            sample_index=seed_index if index is None else index,
            prompt_ids=list(req.prompt_ids),
            response_ids=parsed.response_ids,
            rollout_logp=parsed.logprobs,
            finish_reason=parsed.finish_reason,
            routed_experts=parsed.routed_experts,
            routed_experts_start=req.routed_experts_start,
            token_versions=versions[0],
        )
        return sample, epoch, version

    def score(
        self,
        token_ids_list: Sequence[Sequence[int]],
        response_start: int | Sequence[int],
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[list[float]]:
        starts = normalize_response_starts(token_ids_list, response_start)
        self.fleet.require_memory(MEMORY_TAGS, "score")
        per_sequence = list(images) if images is not None else [None] * len(token_ids_list)
        check_image_pads(token_ids_list, per_sequence)
        call_id = uuid.uuid4().hex[:12]
        results: list[list[float] | None] = [None] * len(token_ids_list)

        def run(i: int, cancel: threading.Event) -> None:
            ids = list(token_ids_list[i])
            wire_ids, image_data = wire_ids_of(ids, per_sequence[i])

            def attempt(server: Server, rid: str) -> list[float]:
                payload = score_payload(wire_ids, rid=rid, image_data=image_data)
                reply = self.fleet.request("POST", server, "/generate", payload, request=rid)
                return parse_score_reply(reply, token_ids=ids, rid=rid, server=server.url)

            values = self.fleet.with_failover(f"{call_id}-score{i}", attempt, cancel)
            # values[t - 1] is log p(ids[t] | ids[:t])
            results[i] = mask_image_targets(values[starts[i] - 1 :], ids[starts[i] :], per_sequence[i])

        self.fleet.run_all([(run, (i,)) for i in range(len(token_ids_list))])
        return [r for r in results if r is not None]


def token_versions(reply: dict, n_tokens: int, *, low: int, high: int) -> list[int] | None:
    """Per-token versions of a reply, from SGLang 0.5.23's ``meta_info.weight_versions`` (spans ``{"version",
    "start", "end"}`` of the label each update set, one span when one version made every token; SGLang sends them
    with every finished request: ``compute_weight_version_spans`` in ``srt/utils/weight_versions.py``). This client
    labels its updates with the fleet's version number; SGLang's initial label is "default", i.e. version 0. None
    when the reply has no spans, or when a label is not one of this client's numbers between ``low`` (the fleet's
    version when the request was sent) and ``high`` (its version at the reply): a label another client or the
    server's start set, or a token made during an update that generation was not paused for."""
    spans = reply.get("meta_info", {}).get("weight_versions")
    if not isinstance(spans, list) or not spans:
        return None
    versions: list[int] = []
    for span in spans:
        label = str(span.get("version"))
        if not (label == "default" or label.isdigit()):
            return None
        version = 0 if label == "default" else int(label)
        if not low <= version <= high:
            return None
        versions += [version] * (int(span["end"]) - int(span["start"]))
    return versions if len(versions) == n_tokens else None


def wire_prompt(req: GenerationRequest) -> tuple[list[int], list[str] | None]:
    """The ids and images a request is sent with: with images, one pad per image and PNG data URIs (SGLang expands
    the pads with its own processor; its ``prompt_tokens`` must then equal the trainer's expanded prompt)."""
    return wire_ids_of(req.prompt_ids, req.images)


def check_image_pads(token_ids_list: Sequence[Sequence[int]], images: Sequence[ImageInputs | None]) -> None:
    """One run of image pads per image, before anything is sent: SGLang takes every pad id of ``input_ids`` for an
    image placeholder (more pads than images: HTTP 500 from ``base_processor.build_input_ids``)."""
    for i, (ids, image) in enumerate(zip(token_ids_list, images, strict=True)):
        if image is None:
            continue
        runs = collapse_image_pads(ids, image.pad_id).count(image.pad_id)
        if runs != len(image.png):
            raise RolloutError(
                f"score: sequence {i} holds {runs} runs of the image-pad token {image.pad_id} for "
                f"{len(image.png)} images; SGLang would take each for an image (a sampled <|image_pad|> cannot be "
                "scored: score up to it)",
                field="input_ids",
            )


def wire_ids_of(ids: Sequence[int], images: ImageInputs | None) -> tuple[list[int], list[str] | None]:
    """``ids`` with each run of image pads collapsed to one, and the images as data URIs (None without)."""
    if images is None:
        return list(ids), None
    return collapse_image_pads(ids, images.pad_id), [png_data_uri(png) for png in images.png]
