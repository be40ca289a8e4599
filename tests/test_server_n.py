"""`n` choices per request through `sfi-gguf serve`, with the official openai client (real default model): n=3
completions with their indexes and usage, reproducible with a seed (choice j samples as a lone request with seed + j),
a list of prompts times n, n=2 chat streamed (each index its own role, text and finish_reason, usage counting the
prompt once), n with a forced tool call, and the limits of n as HTTP 400."""
import json

import pytest

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.real_model

PROMPT = "The three most important ideas in computer architecture are"
CHAT = [{"role": "user", "content": "Name a colour."}]
SAMPLED = dict(temperature=1.5, top_p=1.0, seed=7, extra_body={"min_p": 0.0})  # wide sampling: seeded choices differ


def test_n_completions_are_indexed_seeded_and_counted(client):
    reply = client.completions.create(model="x", prompt=PROMPT, max_tokens=6, n=3, **SAMPLED)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.text for c in reply.choices]
    assert len(set(texts)) > 1  # independent samplers, not one answer three times
    stats = reply.model_extra["sfi_stats"]
    assert len(stats) == 3 and [s["seed"] for s in stats] == [7, 8, 9]
    # later choices reuse the prompt's cache but its last n_prefill_queries tokens, decoded again as a fresh
    # prefill decodes them (all of this short prompt)
    assert all(s["n_prompt_decoded"] == min(16, s["n_prompt"]) for s in stats[1:])

    alone = [client.completions.create(model="x", prompt=PROMPT, max_tokens=6, **{**SAMPLED, "seed": 7 + j})
             for j in range(3)]
    assert texts == [a.choices[0].text for a in alone]
    assert [c.finish_reason for c in reply.choices] == [a.choices[0].finish_reason for a in alone]
    prompt_tokens = alone[0].usage.prompt_tokens
    completion_tokens = sum(a.usage.completion_tokens for a in alone)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == \
        (prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)

    again = client.completions.create(model="x", prompt=PROMPT, max_tokens=6, n=3, **SAMPLED)
    assert [c.text for c in again.choices] == texts


def test_n_times_a_list_of_prompts(client):
    prompts = [PROMPT, "def fibonacci(n):"]
    reply = client.completions.create(model="x", prompt=prompts, max_tokens=3, n=2, **SAMPLED)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]  # prompt i's choices at i*n ..
    firsts = [client.completions.create(model="x", prompt=p, max_tokens=3, **SAMPLED) for p in prompts]
    assert [reply.choices[0].text, reply.choices[2].text] == [f.choices[0].text for f in firsts]
    assert reply.usage.prompt_tokens == sum(f.usage.prompt_tokens for f in firsts)
    assert reply.usage.completion_tokens == sum(s["n_generated"] - s["ended_on_eog"]
                                                for s in reply.model_extra["sfi_stats"])


def test_n_chat_streamed(client):
    whole = client.chat.completions.create(model="x", messages=CHAT, max_tokens=5, n=2, **SAMPLED)
    assert [c.index for c in whole.choices] == [0, 1]
    chunks = list(client.chat.completions.create(model="x", messages=CHAT, max_tokens=5, n=2, stream=True,
                                                 stream_options={"include_usage": True}, **SAMPLED))
    by_index = {}
    for chunk in chunks:
        for c in chunk.choices:
            by_index.setdefault(c.index, []).append(c)
    assert sorted(by_index) == [0, 1]
    for i, deltas in by_index.items():
        assert deltas[0].delta.role == "assistant"
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
        assert deltas[-1].finish_reason == whole.choices[i].finish_reason
        assert "".join(d.delta.content or "" for d in deltas) == whole.choices[i].message.content
    usage = chunks[-1].usage
    assert not chunks[-1].choices and (usage.prompt_tokens, usage.completion_tokens) == \
        (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_n_with_a_forced_tool_call(client):
    add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
    reply = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=[add], max_tokens=40, n=2,
        tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False, **SAMPLED)
    calls = [c.message.tool_calls for c in reply.choices]
    assert [c.finish_reason for c in reply.choices] == ["tool_calls", "tool_calls"]
    assert all(len(c) == 1 and c[0].function.name == "add" for c in calls)
    assert all(set(json.loads(c[0].function.arguments)) == {"a", "b"} for c in calls)
    assert calls[0][0].id != calls[1][0].id


@pytest.mark.parametrize("extra,match", [
    (dict(n=0), "n (the number of choices) must be an integer from 1 to 16, got 0"),
    (dict(n=17), "from 1 to 16, got 17"),
    (dict(n=2, stream=True, extra_body={"n": -1}), "got -1"),
    (dict(n=3, best_of=2), "best_of equal to n"),
])
def test_n_out_of_range_is_400(client, extra, match):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="x", prompt=PROMPT, max_tokens=2, **extra)
    assert match in str(err.value)
    ok = client.completions.create(model="x", prompt=PROMPT, max_tokens=2, n=3, best_of=3, temperature=0)
    assert [c.index for c in ok.choices] == [0, 1, 2]
    assert len({c.text for c in ok.choices}) == 1  # greedy: the same choice n times
