"""`sfi-gguf serve` against the official openai client: a server on a free loopback port, chat and
completions, streamed and not, errors as HTTP 400, and the CLI command itself."""
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.real_model

CHAT = [{"role": "user", "content": "Name three primary colors."}]
PROMPT = "The three most important ideas in computer architecture are"


def test_models(client):
    assert [m.id for m in client.models.list()] == ["test-model"]


def test_chat_round_trip_streamed_and_not(client):
    reply = client.chat.completions.create(model="test-model", messages=CHAT, max_tokens=8, temperature=0)
    text = reply.choices[0].message.content
    assert reply.object == "chat.completion" and reply.model == "test-model" and len(text) > 5
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    assert reply.model_extra["sfi_stats"]["n_generated"] == 8

    stream = client.chat.completions.create(model="test-model", messages=CHAT, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    assert any((c.model_extra or {}).get("sfi_stats") for c in chunks)


def test_completion_round_trip_with_stop_and_sfi_options(client):
    full = client.completions.create(model="x", prompt=PROMPT, max_tokens=10, temperature=0)
    text = full.choices[0].text
    assert full.object == "text_completion" and full.usage.prompt_tokens > 5
    assert full.model_extra["sfi_stats"]["mode"] == "sfi"
    cut = text.strip().split()[1]
    stopped = client.completions.create(model="x", prompt=PROMPT, max_tokens=10, temperature=0, stop=[cut],
                                        extra_body={"sfi": False})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[: text.index(cut)]
    assert stopped.model_extra["sfi_stats"]["mode"] == "dense"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert streamed == text


def test_bad_requests_are_400(client, server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="x", messages=CHAT, tools=[tool],
                                       tool_choice={"type": "function", "function": {"name": "g"}})
    with pytest.raises(openai.BadRequestError, match="bogus"):
        client.completions.create(model="x", prompt="Hi", max_tokens=1, extra_body={"bogus": 1})
    with pytest.raises(openai.BadRequestError, match="n .the number of choices. must be"):
        client.completions.create(model="x", prompt="Hi", max_tokens=1, n=0)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="x", prompt="Hi", max_tokens=1, top_p=0)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.url.replace("/v1", "/v2/nothing"))
    assert err.value.code == 404


def test_serve_command(tmp_path):
    """`sfi-gguf serve --port 0` prints its address and answers."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "sfi_gguf.cli", "serve", "--port", "0", "-c", "512", "-t", "1",
                             "--alias", "cli-model"], cwd=repo, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:
            if line.startswith("sfi-gguf serve: http://"):
                url = line.split()[2]
                break
        assert url, "the server did not start"
        with urllib.request.urlopen(url + "/models", timeout=30) as r:
            assert json.load(r)["data"][0]["id"] == "cli-model"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
