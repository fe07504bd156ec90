"""Tools on `mcore-rl serve`'s chat completions and unmodified agents through the episode proxy.

One real `mcore-rl serve` process on loopback serves a tiny model that has learned one tool-using
conversation (`tests/tool_agent.py`); a plain `openai` tool loop runs against it directly and through
`EpisodeProxy`, which records every token and joins the episode's turns into samples.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from mcore_rl.agent.proxy import Completion, EpisodeProxy, join_by_prefix, record_samples
from mcore_rl.data.samples import Prompt
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.parallel.lifetime import preexec_die_with_parent
from mcore_rl.rollout.openai_api import parse_chat
from mcore_rl.rollout.pool import HTTPEnginePool
from mcore_rl.rollout.protocol import RequestError
from tests.tool_agent import ADD_TOOL, ANSWER, CALL, QUESTION, agent, save_tool_model

openai = pytest.importorskip("openai")
CONTEXT = 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, model dir, process) of a `mcore-rl serve` process serving the trained tool model."""
    model_dir = save_tool_model(str(tmp_path_factory.mktemp("tool_model")))
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcore_rl.cli", "serve", "--model-path", model_dir, "--port", str(port)]
        + ["--context-length", str(CONTEXT), "--served-model-name", "tiny-tools"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=preexec_die_with_parent(),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"mcore-rl serve did not come up (exit code {proc.poll()})") from None
                time.sleep(0.2)
        yield url, model_dir, proc
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def proxy(served):
    url, model_dir, _ = served
    pool = HTTPEnginePool([url], timeout=120)
    tok = load_tokenizer(model_dir)
    px = EpisodeProxy(pool, tok, tool_format="hermes", context_length=CONTEXT, vocab_size=tok.vocab_size)
    px.start()
    yield px
    px.stop()
    pool.close()


def client(base_url: str):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def test_served_chat_completions_return_tool_calls_to_the_openai_client(served):
    url, _, _ = served
    c = client(url + "/v1")
    first = c.chat.completions.create(
        model="tiny-tools", messages=[{"role": "user", "content": QUESTION}], tools=[ADD_TOOL], temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "add" and call.function.arguments == '{"a": 2, "b": 3}'
    answer, messages = agent(c, "tiny-tools")
    assert answer == ANSWER and [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    # streamed: the reply with tools comes whole at the end, as one delta with the calls
    chunks = list(
        c.chat.completions.create(
            model="tiny-tools",
            messages=[{"role": "user", "content": QUESTION}],
            tools=[ADD_TOOL],
            temperature=0,
            stream=True,
        )
    )
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [(0, "add", '{"a": 2, "b": 3}')]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # tool_choice "none": no tools rendered, nothing parsed
    plain = c.chat.completions.create(
        model="tiny-tools",
        messages=[{"role": "user", "content": QUESTION}],
        tools=[ADD_TOOL],
        tool_choice="none",
        temperature=0,
        max_tokens=8,
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason != "tool_calls"
    with pytest.raises(openai.BadRequestError, match="tool_choice.function.name: 'mul' is not among the tools"):
        c.chat.completions.create(
            model="tiny-tools",
            messages=[{"role": "user", "content": QUESTION}],
            tools=[ADD_TOOL],
            tool_choice={"type": "function", "function": {"name": "mul"}},
        )


def test_tool_choice_required_and_named_open_the_call_in_the_prompt():
    tok = load_tokenizer(None)
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [ADD_TOOL]}

    def prompt_text(fmt: str | None, **extra) -> str:
        inp = parse_chat({**body, **extra}, tokenizer=tok, vocab_size=384, context_length=CONTEXT, tool_format=fmt)
        return tok.decode(inp.requests[0].input_ids)

    assert prompt_text("hermes").endswith("<|im_start|>assistant\n") and '"name": "add"' in prompt_text("hermes")
    assert prompt_text("hermes", tool_choice="required").endswith('assistant\n<tool_call>\n{"name": "')
    named = {"type": "function", "function": {"name": "add"}}
    assert prompt_text("hermes", tool_choice=named).endswith('<tool_call>\n{"name": "add", "arguments": ')
    assert prompt_text("llama3_json", tool_choice=named).endswith('assistant\n{"name": "add", "parameters": ')
    assert "<tools>" not in prompt_text("hermes", tool_choice="none")
    for extra, message in [
        ({"tool_choice": "sometimes"}, "tool_choice: expected"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice: 'required' needs tools"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "add", "arguments": "{x"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ]:
        with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
            prompt_text("hermes", **extra)
    with pytest.raises(RequestError, match="no tool-call parser"):
        prompt_text(None)


def test_an_unmodified_agent_through_the_proxy_is_recorded_token_by_token(served, proxy):
    url, model_dir, _ = served
    tok = load_tokenizer(model_dir)
    base = proxy.open("ep-1")
    answer, messages = agent(client(base), "whatever-the-agent-names")
    assert answer == ANSWER
    record = proxy.end("ep-1")
    first, second = record.completions
    assert tok.decode(first.output_ids).startswith(CALL) and tok.decode(second.output_ids).startswith(ANSWER)
    assert len(first.logps) == len(first.output_ids) and all(lp <= 0 for lp in first.logps + second.logps)
    assert first.versions == [0] * len(first.output_ids)
    # the second prompt extends the first exchange: one sample, no drift
    assert record.drift == 0 and len(record.segments) == 1
    (seg,) = record.segments
    assert seg.prompt_ids == first.prompt_ids and seg.all_ids == second.prompt_ids + second.output_ids
    n1 = len(first.output_ids)
    gap = len(second.prompt_ids) - len(first.prompt_ids) - n1
    assert seg.trainable == [1] * n1 + [0] * gap + [1] * len(second.output_ids)
    assert seg.logps == first.logps + [0.0] * gap + second.logps
    assert "<|im_start|>tool\n5<|im_end|>" in tok.decode(seg.ids[n1 : n1 + gap])  # the tool result: not trainable
    # the proxy's prompt is the one the server renders for the same conversation
    direct = client(url + "/v1").chat.completions.create(
        model="m", messages=messages[:3], tools=[ADD_TOOL], temperature=0, logprobs=True
    )
    assert direct.choices[0].message.content == ANSWER
    assert [t.logprob for t in direct.choices[0].logprobs.content] == pytest.approx(second.logps, abs=1e-5)
    (sample,) = record_samples(record, Prompt(ids=[], text=QUESTION, index=7), "stop", tok)
    assert (
        sample.prompt.ids == first.prompt_ids and sample.response_ids == seg.ids and sample.trainable == seg.trainable
    )
    assert sample.group == 7 and sample.policy_version == 0 and sample.finish_reason == "stop"


def test_calls_after_the_end_are_refused_and_drift_starts_a_new_sample(proxy):
    c = client(proxy.open("ep-2"))
    agent(c, "m")
    record = proxy.end("ep-2")
    with pytest.raises(openai.ConflictError, match="episode 'ep-2' has ended"):
        agent(c, "m")
    with pytest.raises(openai.NotFoundError, match="episode 'nope' was never opened"):
        client(proxy.url + "/episodes/nope/v1").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
    assert proxy.refused_after_end == 1 and record.refused == 1 and proxy.unknown_episode == 1
    # an agent that rewrites its history: the second call does not extend the first -> a new sample
    c = client(proxy.open("ep-3"))
    c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUESTION}], tools=[ADD_TOOL], temperature=0
    )
    c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Again: " + QUESTION}], tools=[ADD_TOOL], temperature=0
    )
    record = proxy.end("ep-3")
    assert record.drift == 1 and len(record.segments) == 2
    assert [s.prompt_ids for s in record.segments] == [c.prompt_ids for c in record.completions]
    with pytest.raises(openai.BadRequestError, match="stream: the episode proxy serves whole completions only"):
        client(proxy.open("ep-4")).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        )


def test_join_by_prefix_appends_what_the_agent_added_untrainable():
    a = Completion([1, 2], [3, 4], [-0.1, -0.2], [5, 5], "stop", "")
    b = Completion([1, 2, 3, 4, 9, 9], [7], [-0.3], [6], "stop", "")
    c = Completion([1, 2, 8], [3], [-0.4], [6], "length", "")
    segments, drift = join_by_prefix([a, b, c])
    assert drift == 1 and len(segments) == 2
    first, second = segments
    assert first.prompt_ids == [1, 2] and first.ids == [3, 4, 9, 9, 7]
    assert first.trainable == [1, 1, 0, 0, 1] and first.logps == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert first.versions == [5, 5, 5, 5, 6]
    assert second.prompt_ids == [1, 2, 8] and second.ids == [3] and second.trainable == [1]


def test_tool_call_parser_flag_takes_sglang_and_our_names():
    from mcore_rl.rollout.launch_flags import LaunchFlagError, parse_server_args

    assert parse_server_args(["--tool-call-parser", "qwen25"]).tool_call_parser == "qwen25"
    assert parse_server_args(["--tool-call-parser", "llama3_json"]).tool_call_parser == "llama3_json"
    assert parse_server_args([]).tool_call_parser is None  # the model family's format
    with pytest.raises(LaunchFlagError, match="--tool-call-parser pythonic: unknown tool-call format 'pythonic'"):
        parse_server_args(["--tool-call-parser", "pythonic"])


def test_an_engine_that_stops_answering_costs_the_call_not_the_proxy(served):
    import signal

    url, model_dir, proc = served
    tok = load_tokenizer(model_dir)
    pool = HTTPEnginePool([url], timeout=3)
    with EpisodeProxy(pool, tok, tool_format="hermes", context_length=CONTEXT, vocab_size=tok.vocab_size) as px:
        c = client(px.open("ep-stall"))
        os.kill(proc.pid, signal.SIGSTOP)  # a real stall: the engine process stops answering
        try:
            with pytest.raises(openai.InternalServerError, match="engine: "):
                c.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert px.engine_errors == 1 and px.end("ep-stall").completions == []
    pool.close()
