"""Multi-turn episodes on the project's offline BPE with a Qwen3-style tool template: template deltas equal the
whole conversation, exact ids across turns (a drift on purpose is caught), masks / log-probs / routes per token,
tools (the sandboxed Python tool, user tools, errors and timeouts), limits, and concurrency."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from sapo_megatron.data.chat_tokenizer import QWEN_STYLE_TEMPLATE
from sapo_megatron.rewards.sandbox import SandboxLimits
from sapo_megatron.rollout.episodes import (
    EpisodeDriftError,
    ObservationDeltas,
    ToolSet,
    episode_metrics,
    tool_episode,
)
from sapo_megatron.rollout.episodes.tools import PYTHON_SCHEMA, Tool, python_tool
from sapo_megatron.rollout.types import EpisodeInfo, GenerationRequest, SamplingParams
from tests.rollout.episodes.helpers import ScriptedEngine, call, chat_tokenizer, episode_engine, prompt_ids


@pytest.fixture(scope="module")
def hf():
    return chat_tokenizer()  # the shipped one (data.tokenizer: chat), with Qwen3's tool rendering


@pytest.fixture(scope="module")
def fixture_bpe(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))


@pytest.fixture(scope="module")
def python_tools():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        limits = SandboxLimits(wall_s=2.0, cpu_s=2, memory_mb=256)
        yield ToolSet([python_tool(limits, pool)], timeout_s=10.0, max_concurrent=4, max_output_chars=200)


def ids(hf, text: str) -> list[int]:
    return list(hf(text, add_special_tokens=False)["input_ids"])


def render_ids(hf, messages, tools=None) -> list[int]:
    return ids(hf, hf.apply_chat_template(messages, tools=tools, tokenize=False))


def request(
    prompt: list[int], n: int = 1, routed: bool = False, max_new_tokens: int = 256, group_id: int = 0
) -> GenerationRequest:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, seed=5)
    return GenerationRequest(
        prompt_ids=prompt, n=n, sampling=sampling, return_routed_experts=routed, group_id=group_id
    )


@pytest.mark.parametrize("tokenizer", ["shipped", "tests' BPE"])
@pytest.mark.parametrize("template", ["qwen3-tools", "qwen-style"])
def test_template_deltas_equal_the_whole_conversation_tokenized_at_once(hf, fixture_bpe, tokenizer, template):
    hf = hf if tokenizer == "shipped" else fixture_bpe
    if template == "qwen-style":  # the shipped tokenizer's own template: tool messages as a "tool" turn
        hf = chat_tokenizer_copy(hf, QWEN_STYLE_TEMPLATE)
    end = hf.convert_tokens_to_ids("<|im_end|>")
    deltas = ObservationDeltas(hf, "<|im_end|>")
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "12+30?"},
    ]
    turns = [
        "Two checks.\n" + call("python", code="print(12 + 30)") + "\n" + call("python", code="print(42)"),
        call("python", code="print(2 * 21)"),
        "The answer is \\boxed{42}.",
    ]
    observations = [["42\n", "42\n"], ["42\n"]]
    episode = render_ids(hf, messages, tools=[PYTHON_SCHEMA]) + ids(hf, "<|im_start|>assistant\n")
    for k, text in enumerate(turns):
        episode += [*ids(hf, text), end]  # the engine stops at <|im_end|>, keeping it
        messages.append({"role": "assistant", "content": text})
        if k < len(observations):
            tool_messages = [{"role": "tool", "content": out} for out in observations[k]]
            episode += deltas.ids(tool_messages)
            messages += tool_messages
    whole = render_ids(hf, messages, tools=[PYTHON_SCHEMA])
    assert whole == episode + ids(
        hf, "\n"
    )  # the template's "\n" after the last <|im_end|> was never generated
    if template == "qwen3-tools":  # two results of one turn: one user turn, two <tool_response> blocks
        text = deltas.text([{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}])
        assert text == (
            "\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n"
        )


def chat_tokenizer_copy(hf, template: str):
    import copy

    other = copy.deepcopy(hf)
    other.chat_template = template
    return other


def test_an_episode_with_the_sandboxed_python_tool(hf, python_tools):
    """Two turns around a real sandbox run: ids, mask spans, log-probs and the whole-conversation equality."""
    first = "Let me compute.\n" + call("python", code="print(6 * 7)")
    last = "The answer is \\boxed{42}."
    engine = ScriptedEngine(hf, {"6 times 7": [first, last]})
    episodes = episode_engine(engine, hf, tools=python_tools)
    prompt = prompt_ids(hf, "What is 6 times 7?", tools=python_tools.schemas)
    [[sample]] = episodes.generate([request(prompt)])

    assert sample.episode == EpisodeInfo(status="completed", turns=2, tool_calls=1, tool_errors=0)
    assert sample.finish_reason == "stop"
    turn1, turn2 = [*engine.ids(first), engine.eos], [*engine.ids(last), engine.eos]
    observation = episodes.deltas.ids([{"role": "tool", "content": "42\n"}])
    assert sample.prompt_ids == prompt
    assert sample.response_ids == turn1 + observation + turn2
    assert sample.loss_mask == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    assert sample.rollout_logp == [-0.1] * len(turn1) + [0.0] * len(observation) + [-0.2] * len(turn2)
    assert sample.generated_tokens == len(turn1) + len(turn2)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 6 times 7?"},
        {"role": "assistant", "content": first},
        {"role": "tool", "content": "42\n"},
        {"role": "assistant", "content": last},
    ]
    assert render_ids(hf, messages, tools=python_tools.schemas) == sample.token_ids + ids(hf, "\n")


def test_the_python_tool_keeps_the_sandbox_limits(python_tools):
    from sapo_megatron.rollout.episodes import ToolCall

    async def run(code: str):
        return await python_tools.call(ToolCall("python", {"code": code}))

    started = time.perf_counter()
    looping = asyncio.run(run("while True:\n    pass"))
    assert looping.error and "timed out" in looping.text  # the sandbox's 2 s wall limit
    assert time.perf_counter() - started < 8
    hungry = asyncio.run(run("x = bytearray(1 << 30)\nprint('allocated')"))  # 1 GiB under a 256 MiB limit
    assert "MemoryError" in hungry.text and "allocated" not in hungry.text
    long = asyncio.run(run("print('x' * 1000)"))
    assert long.text.startswith("x" * 200) and long.text.endswith("(truncated to 200 characters)")
    assert asyncio.run(run("print(sum(range(10)))")).text == "45\n"


def test_tool_errors_and_timeouts_become_observations_and_are_counted(hf):
    async def lookup(city: str) -> str:
        raise ValueError(f"no weather for {city}")

    async def slow(**_: object) -> str:
        await asyncio.sleep(5)
        return "late"

    schema = lambda name: {"type": "function", "function": {"name": name, "parameters": {}}}  # noqa: E731
    tools = ToolSet(
        [Tool(schema("weather"), lookup), Tool(schema("slow"), slow)],
        timeout_s=0.2,
        max_concurrent=4,
        max_output_chars=500,
    )
    calls = "\n".join(
        [
            call("weather", city="Oslo"),
            call("slow"),
            call("search", q="x"),
            "<tool_call>\n{oops\n</tool_call>",
        ]
    )
    engine = ScriptedEngine(hf, {"Oslo": [calls, "I could not find out."]})
    episodes = episode_engine(engine, hf, tools=tools)
    started = time.perf_counter()
    [[sample]] = episodes.generate([request(prompt_ids(hf, "Weather in Oslo?"))])
    assert time.perf_counter() - started < 2.0  # the slow tool was cut at its timeout
    assert sample.episode == EpisodeInfo(status="completed", turns=2, tool_calls=4, tool_errors=4)
    text = hf.decode(sample.response_ids)
    assert "Error: ValueError: no weather for Oslo" in text
    assert "Error: the tool slow timed out after 0.2 s" in text
    assert "Error: there is no tool 'search'" in text
    assert "Error: the tool call is not valid JSON" in text
    assert episode_metrics([sample])["episode/tool_errors_mean"] == 4


@pytest.mark.parametrize(
    ("settings", "max_new_tokens", "truncated_by", "turns", "tool_calls"),
    [
        ({"max_turns": 3}, 256, "max_turns", 3, 3),  # 1 + 2 calls run, the third turn's are not
        ({"max_tool_calls": 2}, 256, "max_tool_calls", 2, 1),  # the second turn asks for 2 more: 3 > 2
        ({"max_context_tokens": 250}, 256, "max_context", None, None),
        ({}, 8, "length", 1, 0),
    ],
)
def test_limits_end_an_episode_as_truncated_and_are_counted(
    hf, settings, max_new_tokens, truncated_by, turns, tool_calls
):
    tools = echo_tools(max_concurrent=4, max_output_chars=100)
    script = [call("echo"), call("echo") + "\n" + call("echo")]  # the model never stops calling
    engine = ScriptedEngine(hf, {"loop": script})
    episodes = episode_engine(engine, hf, tools=tools, max_new_tokens=max_new_tokens, **settings)
    prompt = prompt_ids(hf, "loop forever")
    [[sample]] = episodes.generate([request(prompt, routed=True, max_new_tokens=max_new_tokens)])
    info = sample.episode
    assert (info.status, info.truncated_by, sample.finish_reason) == ("truncated", truncated_by, "length")
    if turns is not None:
        assert (info.turns, info.tool_calls) == (turns, tool_calls)
    if truncated_by == "max_context":
        assert len(sample.token_ids) <= 250
        assert sample.loss_mask[-1] == 1  # an episode always ends on a turn: routes cover every fed token
    assert sample.routed_experts.shape[0] == len(sample.token_ids) - 1
    metrics = episode_metrics([sample])
    assert (
        metrics["episode/truncated_frac"] == 1.0
        and metrics[f"episode/truncated_by_{truncated_by}_frac"] == 1.0
    )


def test_routes_are_spliced_across_turns(hf):
    """Rows of earlier tokens come from the turn that decoded them; a turn's last sampled token gets its row from
    the next turn's prefill, and so does the observation."""

    tools = echo_tools(max_concurrent=1, max_output_chars=100)
    engine = ScriptedEngine(hf, {"splice": [call("echo"), call("echo"), "done"]})
    prompt = prompt_ids(hf, "splice the routes")
    [[sample]] = episode_engine(engine, hf, tools=tools).generate([request(prompt, routed=True)])
    assert sample.episode.turns == 3
    mask = np.array([1] * len(prompt) + sample.loss_mask)  # 1 on prompt too: only the edges matter here
    ends = [
        i + 1
        for i in range(len(prompt), len(mask))
        if mask[i] == 1 and (i + 1 == len(mask) or mask[i + 1] == 0)
    ]
    rows = sample.routed_experts[:, 0, 0]
    assert len(rows) == len(sample.token_ids) - 1
    start = 0
    for turn, end in enumerate(ends, start=1):  # turn k fed the tokens [previous end - 1, its end - 1)
        assert (rows[start : end - 1] == turn).all(), turn
        start = end - 1
    assert start == len(rows)
    # each turn asked only for the rows it adds: from where the previous turn's rows stopped
    assert engine.route_starts == [0, ends[0] - 1, ends[1] - 1]


def test_a_re_tokenized_turn_is_caught_naming_the_sample(hf):
    """A user episode function that decodes the episode and encodes the text again: the engine's output was not
    the tokenizer's canonical split, so the ids drift and the run stops there."""
    engine = ScriptedEngine(hf, {"drift": ["The answer", "is 5."], "fine": ["Solve for x", "x = 5."]})
    spelled = [t for ch in "The answer" for t in engine.ids(ch)]  # one token per character: not canonical
    assert spelled != engine.ids("The answer")
    original_turn = engine._turn

    def spelled_turn(req, index):
        sample = original_turn(req, index)
        if sample.response_ids[:-1] == engine.ids("The answer"):
            sample.response_ids = [*spelled, engine.eos]
            sample.rollout_logp = [-0.1] * len(sample.response_ids)
        return sample

    engine._turn = spelled_turn

    async def retokenizing(ctx, ledger):
        turn = await ctx.generate(list(ledger.tokens), 16)
        ledger.add_turn(turn)
        ledger.add_observation(ctx.deltas.ids([{"role": "user", "content": "Go on."}]))
        again = ids(hf, ctx.decode(ledger.tokens))  # the mistake
        ledger.add_turn(await ctx.generate(again, 16))
        return EpisodeInfo(status="completed", turns=ledger.turns)

    episodes = episode_engine(engine, hf)
    episodes.episode_fn, episodes.user_function = retokenizing, True
    fine = request(prompt_ids(hf, "fine"), n=2)
    drifting = request(prompt_ids(hf, "drift"), group_id=1)
    with pytest.raises(EpisodeDriftError, match=r"group 1 sample 0, turn 2: .*first difference at position"):
        episodes.generate([fine, drifting])
    assert len(episodes.generate([fine])[0]) == 2  # canonical ids survive the same round trip


def test_a_failing_user_episode_function_fails_its_sample_only(hf):
    engine = ScriptedEngine(hf, {"x": ["fine"]})

    async def flaky(ctx, ledger):
        ledger.add_turn(await ctx.generate(list(ledger.tokens), 8))
        if ledger.name.endswith("sample 1"):
            raise ConnectionError("simulator went away")
        return EpisodeInfo(status="completed", turns=1)

    episodes = episode_engine(engine, hf)
    episodes.episode_fn, episodes.user_function = flaky, True
    [[ok, failed]] = episodes.generate([request(prompt_ids(hf, "x"), n=2)])
    assert (ok.episode.status, ok.finish_reason) == ("completed", "stop")
    assert (failed.episode.status, failed.finish_reason) == ("failed", "abort")  # its group is replaced
    assert episodes.metrics()["episode/failed"] == 1


def test_concurrent_episodes_share_engine_calls_and_tools_overlap(hf):
    """16 episodes of 3 turns with a 0.3 s tool each: turns that are ready together go in one engine call, and
    the tools of all episodes wait at once (sequentially they would take 16 × 2 × 0.3 s)."""

    waiting, most = 0, 0

    async def slow_echo(**_: object) -> str:
        nonlocal waiting, most
        waiting += 1
        most = max(most, waiting)
        await asyncio.sleep(0.3)
        waiting -= 1
        return "ok"

    tools = ToolSet(
        [Tool({"type": "function", "function": {"name": "echo"}}, slow_echo)],
        timeout_s=5,
        max_concurrent=64,
        max_output_chars=100,
    )
    engine = ScriptedEngine(hf, {"go": [call("echo"), call("echo"), "done"]}, delay_s=0.02)
    episodes = episode_engine(engine, hf, tools=tools)
    groups = episodes.generate([request(prompt_ids(hf, f"go {i}"), n=4) for i in range(4)])
    assert all(s.episode.turns == 3 for g in groups for s in g)
    assert len(engine.calls) <= 6 and sum(engine.calls) == 48  # 48 turns in a few calls
    # counted, not timed (a wall-clock bound failed once on a loaded machine): tools of many episodes wait at once
    assert most >= 8, most  # six calls at most for 48 turns: one of them readies 8 tools or more


def test_turn_seeds_differ_per_turn_and_sample(hf):
    engine = ScriptedEngine(hf, {"seed": [call("echo"), "done"]})
    seen = []
    original = engine.generate

    def record(requests):
        seen.extend(r.sampling.seed for r in requests)
        return original(requests)

    engine.generate = record

    tools = echo_tools(max_concurrent=1, max_output_chars=10)
    episode_engine(engine, hf, tools=tools).generate([request(prompt_ids(hf, "seed"), n=2)])
    assert sorted(seen) == [5, 6, 5 + 7919, 6 + 7919]


def test_the_built_in_loop_is_the_default(hf):
    assert episode_engine(ScriptedEngine(hf, {}), hf).episode_fn is tool_episode


def test_tools_run_while_other_episodes_generate(hf):
    """One episode's slow tool (0.6 s) does not hold the others: their next turns are generated while it runs."""
    spans: dict[str, tuple[float, float]] = {}

    async def timed(name: str, seconds: float) -> str:
        start = time.perf_counter()
        await asyncio.sleep(seconds)
        spans[name] = (start, time.perf_counter())
        return "ok"

    async def slow(**_: object) -> str:
        return await timed("slow", 0.6)

    async def fast(**_: object) -> str:
        return await timed("fast", 0.01)

    schema = lambda name: {"type": "function", "function": {"name": name}}  # noqa: E731
    tools = ToolSet(
        [Tool(schema("slow"), slow), Tool(schema("fast"), fast)],
        timeout_s=5,
        max_concurrent=8,
        max_output_chars=10,
    )
    engine = ScriptedEngine(
        hf, {"tortoise": [call("slow"), "done"], "hare": [call("fast"), call("fast"), "done"]}
    )
    calls: list[tuple[float, int]] = []
    original = engine.generate

    def record(requests):
        calls.append((time.perf_counter(), len(requests)))
        return original(requests)

    engine.generate = record
    episodes = episode_engine(engine, hf, tools=tools)
    groups = episodes.generate(
        [request(prompt_ids(hf, "tortoise")), request(prompt_ids(hf, "hare"), group_id=1)]
    )
    assert [g[0].episode.turns for g in groups] == [2, 3]
    start, end = spans["slow"]
    during = [n for t, n in calls if start < t < end]
    assert sum(during) >= 2  # the hare's second and third turns, generated while the tortoise's tool ran


def test_with_parallel_engine_calls_an_episode_does_not_wait_for_others_turns(hf):
    """A server engine (several calls in flight): the hare's first turn is ready at the same moment as the
    tortoise's slow one (0.8 s), yet the hare runs all three of its turns and both tools before that turn is
    back – it never waits for a turn of another episode (batched together, it would wait 0.8 s per turn)."""
    done: dict[str, float] = {}

    class Timed(ScriptedEngine):
        def generate(self, requests):
            text = self.hf.decode(list(requests[0].prompt_ids))
            time.sleep(0.8 if "tortoise" in text else 0.02)
            groups = super().generate(requests)
            for req in requests:
                done["tortoise" if "tortoise" in self.hf.decode(list(req.prompt_ids)) else "hare"] = (
                    time.perf_counter()
                )
            return groups

    async def fast(**_: object) -> str:
        return "ok"

    tools = ToolSet(
        [Tool({"type": "function", "function": {"name": "fast"}}, fast)],
        timeout_s=5,
        max_concurrent=8,
        max_output_chars=10,
    )
    engine = Timed(hf, {"tortoise": ["done"], "hare": [call("fast"), call("fast"), "done"]})
    episodes = episode_engine(engine, hf, tools=tools, parallel_engine_calls=4)
    groups = episodes.generate(
        [request(prompt_ids(hf, "tortoise")), request(prompt_ids(hf, "hare"), group_id=1)]
    )
    assert [g[0].episode.turns for g in groups] == [1, 3]
    assert engine.calls == [1, 1, 1, 1]  # one turn per call
    assert done["hare"] < done["tortoise"] - 0.5, done


def echo_tools(*, max_concurrent: int, max_output_chars: int) -> ToolSet:
    """One tool, ``echo``, that answers "ok" within a 1 s timeout (three tests above)."""

    async def echo(**_: object) -> str:
        return "ok"

    tools = [Tool({"type": "function", "function": {"name": "echo"}}, echo)]
    return ToolSet(tools, timeout_s=1, max_concurrent=max_concurrent, max_output_chars=max_output_chars)


def test_an_episode_carries_each_turns_versions_across_a_weight_update():
    """Under fully_async an episode goes on across weight updates: each turn's tokens keep the engine versions
    that made them (a turn paused mid-response has two), an observation takes the version of the turn before it;
    a turn without versions leaves the episode without them (the pipeline then tags it whole)."""
    from sapo_megatron.rollout.episodes.episode import EpisodeLedger
    from sapo_megatron.rollout.types import Sample

    def turn(prompt: list[int], response: list[int], versions: list[int] | None) -> Sample:
        return Sample(
            group_id=0,
            sample_index=0,
            prompt_ids=prompt,
            response_ids=response,
            rollout_logp=[-1.0] * len(response),
            finish_reason="stop",
            token_versions=versions,
        )

    info = EpisodeInfo(status="completed", turns=3, tool_calls=2)
    ledger = EpisodeLedger([1, 2], "episode")
    ledger.add_turn(turn([1, 2], [5, 6, 7], [3, 3, 3]))
    ledger.add_observation([40, 41])
    ledger.add_turn(turn(ledger.tokens, [8, 9], [3, 4]))  # paused mid-turn, continued on the new weights
    ledger.add_observation([42])
    ledger.add_turn(turn(ledger.tokens, [10], [4]))
    sample = ledger.sample(0, 0, info)
    assert sample.token_versions == [3, 3, 3, 3, 3, 3, 4, 4, 4]
    assert sample.loss_mask == [1, 1, 1, 0, 0, 1, 1, 0, 1]

    ledger = EpisodeLedger([1, 2], "episode")
    ledger.add_turn(turn([1, 2], [5], [0]))
    ledger.add_observation([40])
    ledger.add_turn(turn(ledger.tokens, [8], None))
    assert ledger.sample(0, 0, info).token_versions is None
