"""`sfi-gguf serve --parallel N`: concurrent requests decode together in the model's slots.

A random-weight model (no chat template: /v1/completions), greedy: every concurrent request must get
what the same request gets alone, streamed or not, with SFI on; a bad request fails alone.
"""
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from sfi_gguf import SFILlama
from sfi_gguf.tools.random_model import random_model
from serving import running_server

SFI = {"k_head": 32, "n_recent": 32, "n_sink": 4, "min_context": 0, "policy": "fixed", "fixed_period": 8}


@pytest.fixture(scope="module")
def server():
    with running_server(SFILlama(str(random_model("tiny-llama")), n_ctx=1024, n_parallel=3, n_threads=1), "tiny") as srv:
        yield srv


def _post(server, body: dict, stream: bool = False):
    req = urllib.request.Request(server.url + "/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read().decode()
    if not stream:
        return json.loads(raw)
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def _prompts(n):
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(3, 200, length)] for length in rng.integers(150, 400, n)]


def test_concurrent_requests_match_the_same_requests_alone(server):
    prompts = _prompts(5)  # more than the 3 slots: two wait for a free one
    bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "sfi": SFI} for p in prompts]
    results = [None] * len(bodies)

    def run(i):
        results[i] = _post(server, bodies[i], stream=i == 1) if i != 1 else _post(server, {**bodies[i], "stream": True},
                                                                                   stream=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    llm = server.llm
    for i, prompt in enumerate(prompts):
        alone = llm.generate(prompt, max_tokens=24, temperature=0, sfi=SFI)
        text = results[i] if i == 1 else results[i]["choices"][0]["text"]
        assert text == alone.text, i
        if i != 1:
            stats = results[i]["sfi_stats"]
            assert stats["n_generated"] == 24 and stats["sfi"]["n_slow"] == alone.stats.sfi.n_slow >= 2


def test_a_bad_request_fails_alone(server):
    too_long = {"prompt": [5] * 2000, "max_tokens": 4}
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(server, too_long)
    assert e.value.code == 400 and b"n_ctx" in e.value.read()
    ok = _post(server, {"prompt": _prompts(1)[0], "max_tokens": 4, "temperature": 0})
    assert ok["usage"]["completion_tokens"] == 4


def test_n_choices_on_the_slots_match_seeded_requests_alone(server):
    """n=3 on parallel slots, streamed and not: choice j is what a lone request with seed + j gets."""
    prompt = _prompts(1)[0]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 3, "sfi": SFI}
    whole = _post(server, body)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and len(whole["sfi_stats"]) == 3
    req = urllib.request.Request(server.url + "/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        events = [json.loads(line[6:]) for line in resp.read().decode().splitlines() if line.startswith("data: {")]
    streamed = {}
    for e in events:
        (c,) = e["choices"]
        streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert sorted(streamed) == [0, 1, 2]
    for j in range(3):
        alone = server.llm.generate(prompt, max_tokens=8, temperature=1.0, seed=11 + j, sfi=SFI)
        assert whole["choices"][j]["text"] == streamed[j] == alone.text, j
    assert len({c["text"] for c in whole["choices"]}) > 1


def test_a_conversation_continues_in_the_slot_that_holds_it(server):
    """Requests one after the other: a new prompt takes the slot used least recently, and a continuation the slot that
    holds its beginning, whose cache it reuses, though another conversation came in between."""
    rng = np.random.default_rng(7)
    first, second = ([int(t) for t in rng.integers(3, 200, 300)] for _ in range(2))
    more = [int(t) for t in rng.integers(3, 200, 40)]
    for prompt in (first, second):
        assert _post(server, {"prompt": prompt, "max_tokens": 4, "temperature": 0})["sfi_stats"]["n_prompt"] == 300
    for prompt in (first, second):
        stats = _post(server, {"prompt": prompt + more, "max_tokens": 4, "temperature": 0})["sfi_stats"]
        assert stats["n_prompt"] == 340 and stats["n_prompt_decoded"] < 100  # the first 300 came from the cache
