"""The token-exact trajectory: engine ids kept, increments from the chat template, the prefix check."""

from __future__ import annotations

import pytest

from mcore_rl.agent.trajectory import ChatFormat, Trajectory
from mcore_rl.data.samples import Prompt
from mcore_rl.data.tokenizer import HFTokenizer, load_tokenizer
from mcore_rl.data.tool_calls import ToolSpec

# a Qwen2.5-style template: tools in the system turn, tool results as a user turn in <tool_response>
QWEN_STYLE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3's habit that breaks append-only rendering: an assistant turn before the last user message
# loses its <think> block
QWEN3_STYLE = (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and loop.index0 < ns.last and '</think>' in m.content %}"
    "<|im_start|>assistant\n{{ m.content.split('</think>')[-1].lstrip('\n') }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bpe_tokenizer(template: str) -> HFTokenizer:
    """A byte-level BPE tokenizer built offline with one merge ("ab"), so that the same text has a
    canonical and a non-canonical tokenization; `<|im_end|>` is its eos, as in Qwen's instruct models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["ab"] = len(vocab)
    raw = Tokenizer(models.BPE(vocab, [("a", "b")]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=False)
    hf.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    hf.chat_template = template
    return HFTokenizer(hf)


def prompt() -> Prompt:
    return Prompt(index=7, text="guess", ids=[1, 2, 3], label=42, domain="game")


OPENING = [{"role": "system", "content": "play"}, {"role": "user", "content": "guess a number"}]


def test_byte_tokenizer_chatml_keeps_engine_ids_and_masks_the_rest():
    tok = load_tokenizer(None)
    chat = ChatFormat(tok)
    im_end = tok.token_to_id("<|im_end|>")
    assert chat.closing == "<|im_end|>\n" and chat.stop_ids == [tok.eos_id, im_end]
    traj = Trajectory(chat, OPENING)
    opening = traj.context_ids
    assert (
        tok.decode(opening)
        == "<|im_start|>system\nplay<|im_end|>\n<|im_start|>user\nguess a number<|im_end|>\n<|im_start|>assistant\n"
    )
    turn1 = tok.encode("50") + [im_end]
    traj.add_model_turn(turn1, [-0.5] * 3, [4] * 3, "stop")
    traj.add_observation([{"role": "user", "content": "lower"}])
    turn2 = tok.encode("25")  # cut at the token cap: no stop token; the harness closes the turn
    traj.add_model_turn(turn2, [-0.25] * 2, [5, 5], "length")
    assert traj.drift == 0
    (s,) = traj.samples(prompt(), "length")
    assert s.prompt_ids == opening and s.prompt.index == 7 and s.group == 7
    closing_rest = tok.encode("\n")
    obs = tok.encode("<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n")
    assert s.response_ids == turn1 + closing_rest + obs + turn2  # the closing after the cut turn is trimmed
    assert s.trainable == [1] * 3 + [0] * (len(closing_rest) + len(obs)) + [1, 1]
    assert s.rollout_logp[:3] == [-0.5] * 3 and s.rollout_logp[-2:] == [-0.25] * 2
    assert all(lp == 0.0 for lp, t in zip(s.rollout_logp, s.trainable) if not t)
    # harness tokens carry the newest version so far: they never lower the staleness bound
    assert s.policy_version == 4 and s.token_versions is not None and s.token_versions[-1] == 5
    assert s.token_versions[3 : 3 + len(closing_rest) + len(obs)] == [4] * (len(closing_rest) + len(obs))
    assert s.finish_reason == "length" and s.episode is None


def test_a_turn_that_ends_on_eos_keeps_it_and_is_closed_by_the_harness():
    """The byte model may stop on its eos instead of `<|im_end|>`: the eos is the model's (trained),
    the whole closing is the harness's, and the prefix invariant still holds."""
    tok = load_tokenizer(None)
    traj = Trajectory(ChatFormat(tok), OPENING)
    traj.add_model_turn(tok.encode("7") + [tok.eos_id], [-0.1, -0.2], [0, 0], "stop")
    traj.add_observation([{"role": "user", "content": "higher"}])
    traj.add_model_turn(tok.encode("9"), [-0.3], [0], "length")
    assert traj.drift == 0
    (s,) = traj.samples(prompt(), "length")
    assert tok.decode(s.response_ids).startswith("7<eos><|im_end|>\n<|im_start|>user\nhigher")
    assert s.trainable[:3] == [1, 1, 0]


def test_engine_ids_are_never_re_encoded():
    """A non-canonical tokenization (a then b, where the tokenizer would merge "ab") stays as sampled."""
    tok = bpe_tokenizer(QWEN_STYLE)
    chat = ChatFormat(tok)
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    assert tok.encode("ab") != [a, b]  # the canonical form is the merge
    traj = Trajectory(chat, OPENING)
    out = [a, b, tok.eos_id]
    traj.add_model_turn(out, [-1.0] * 3, [0] * 3, "stop")
    traj.add_observation([{"role": "user", "content": "again"}])
    assert traj.drift == 0  # the text matches the template; the ids are the engine's
    (s,) = traj.samples(prompt(), "stop")
    assert s.response_ids[:3] == out and s.trainable[:3] == [1, 1, 1]


def test_qwen_style_template_with_tools_renders_tool_results_as_an_increment():
    tok = bpe_tokenizer(QWEN_STYLE)
    calc = ToolSpec(
        "calculator", "evaluates arithmetic", {"type": "object", "properties": {"expr": {"type": "string"}}}
    )
    chat = ChatFormat(tok, tools=[calc])
    assert chat.closing == "<|im_end|>\n" and chat.stop_ids == [tok.eos_id]
    traj = Trajectory(chat, [{"role": "user", "content": "what is 6*7"}])
    assert tok.decode(traj.context_ids).startswith('<|im_start|>system\n# Tools\n{"type": "function"')
    call = tok.encode('<tool_call>\n{"name": "calculator", "arguments": {"expr": "6*7"}}\n</tool_call>') + [tok.eos_id]
    traj.add_model_turn(call, [-0.1] * len(call), [3] * len(call), "stop")
    traj.add_observation([{"role": "tool", "content": "42", "tool_call_id": "call_0"}])
    answer = tok.encode("42") + [tok.eos_id]
    traj.add_model_turn(answer, [-0.2] * len(answer), [3] * len(answer), "stop")
    assert traj.drift == 0
    (s,) = traj.samples(prompt(), "stop")
    text = tok.decode(s.response_ids)
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    model = [i for i, t in zip(s.response_ids, s.trainable) if t]
    assert model == call + answer
    # the full re-render of the conversation is exactly prompt + response (+ the trimmed closing newline)
    assert tok.decode(s.prompt_ids + s.response_ids) + "\n" == chat.render(traj.messages, add_generation_prompt=False)


def think_turns(policy: str) -> tuple[Trajectory, HFTokenizer]:
    tok = bpe_tokenizer(QWEN3_STYLE)
    traj = Trajectory(ChatFormat(tok), OPENING, policy=policy)  # type: ignore[arg-type]  # the test's literal
    first = tok.encode("<think>\nmaybe 50\n</think>\n\n50") + [tok.eos_id]
    traj.add_model_turn(first, [-0.3] * len(first), [1] * len(first), "stop")
    traj.add_observation([{"role": "user", "content": "lower"}])  # strips the first turn's <think>
    second = tok.encode("<think>\nhalf\n</think>\n\n25") + [tok.eos_id]
    traj.add_model_turn(second, [-0.4] * len(second), [2] * len(second), "stop")
    return traj, tok


def test_non_append_only_template_keep_counts_the_drift_and_keeps_the_exact_tokens():
    traj, tok = think_turns("keep")
    assert traj.drift == 1 and traj.splits == 0
    (s,) = traj.samples(prompt(), "stop")
    assert "maybe 50" in tok.decode(s.response_ids)  # the model's own first-turn tokens, as it saw them
    assert (
        sum(s.trainable)
        == len(tok.encode("<think>\nmaybe 50\n</think>\n\n50")) + len(tok.encode("<think>\nhalf\n</think>\n\n25")) + 2
    )
    assert s.policy_version == 1 and s.token_versions is not None


def test_non_append_only_template_split_starts_a_sample_from_the_template_and_trains_each_turn_once():
    traj, tok = think_turns("split")
    assert traj.drift == 1 and traj.splits == 1
    first, second = traj.samples(prompt(), "stop")
    assert first.finish_reason == "split" and second.finish_reason == "stop"
    # the second sample's prompt is the template's rendering: the first turn without its <think>
    ptext = tok.decode(second.prompt_ids)
    assert "maybe 50" not in ptext and "<|im_start|>assistant\n50<|im_end|>\n<|im_start|>user\nlower" in ptext
    assert tok.decode([i for i, t in zip(first.response_ids, first.trainable) if t]).startswith("<think>\nmaybe 50")
    assert tok.decode([i for i, t in zip(second.response_ids, second.trainable) if t]).startswith("<think>\nhalf")
    assert second.response_ids == [i for i, t in zip(second.response_ids, second.trainable) if t]
    assert (first.policy_version, second.policy_version) == (1, 2)


def test_model_turn_with_mismatched_logprobs_is_refused():
    traj = Trajectory(ChatFormat(load_tokenizer(None)), OPENING)
    with pytest.raises(ValueError, match="a model turn of 2 ids came with 1 μ and 2 versions"):
        traj.add_model_turn([65, 66], [-1.0], [0, 0], "stop")


def test_the_real_qwen2_5_template_with_tools_keeps_the_prefix_invariant():
    """Qwen2.5-Instruct's own template (its default system prompt, tools in the system turn, tool
    results grouped into a user turn): every increment extends the conversation exactly."""
    import os

    path = os.path.join(os.path.dirname(__file__), "chat_templates", "qwen2_5_instruct.jinja")
    with open(path, encoding="utf-8") as f:
        tok = bpe_tokenizer(f.read())
    calc = ToolSpec(
        "calculator", "evaluates arithmetic", {"type": "object", "properties": {"expr": {"type": "string"}}}
    )
    traj = Trajectory(ChatFormat(tok, tools=[calc]), [{"role": "user", "content": "what is 6*7"}])
    opening = tok.decode(traj.context_ids)
    assert opening.startswith("<|im_start|>system\nYou are Qwen") and "<tools>" in opening
    call = tok.encode('<tool_call>\n{"name": "calculator", "arguments": {"expr": "6*7"}}\n</tool_call>')
    traj.add_model_turn(call + [tok.eos_id], [-0.1] * (len(call) + 1), [0] * (len(call) + 1), "stop")
    traj.add_observation([{"role": "tool", "content": "42"}])
    assert tok.decode(traj.context_ids).endswith(
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    traj.add_model_turn(tok.encode("42") + [tok.eos_id], [-0.2] * 3, [0] * 3, "stop")
    traj.add_observation([{"role": "user", "content": "and 6*8?"}])
    assert traj.drift == 0
