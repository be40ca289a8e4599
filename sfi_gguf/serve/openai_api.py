"""llama-cpp-python's `create_completion` / `create_chat_completion` for `SFILlama`.

Same arguments, defaults and return dicts as `llama_cpp.Llama` 0.3.36 (see its `llama_types.py`), so
code written for llama-cpp-python (or the OpenAI API) runs unchanged. SFI statistics ride along in an
extra "sfi_stats" key (the last chunk when streaming), which clients that do not know it ignore.
`suffix` fills in the middle between the prompt and the suffix with the vocabulary's FIM tokens; `echo` puts the
prompt before the generated text; `logits_processor` and `stopping_criteria` are llama-cpp-python's callables.
Arguments we do not implement raise `NotImplementedError` instead of being silently ignored.

`n` (keyword-only, as `sfi`) asks for n choices of each prompt, indexed 0..n-1 (prompt i's at i*n ..); they decode
one after the other (see `_choice_runs`), each with its own sampler: with a `seed`, choice j samples with seed + j.

Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, the legacy `functions` / `function_call`) is in
`tool_calls`; `grammar`, `response_format` json_object / json_schema and a forced tool choice run
llama.cpp's grammar sampler in the sampler chain (JSON schemas converted by llama-cpp-python's converter).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
import uuid
from typing import Any, Iterator

from . import tool_calls
from ..core.sampling import SamplingParams, is_int

# llama-cpp-python arguments we do not implement, with the value that means "not used"
_NOT_USED = {"tfs_z": 1.0}


def _check_supported(args: dict[str, Any]) -> None:
    used = [k for k, neutral in _NOT_USED.items() if k in args and args[k] not in (None, neutral)]
    if used:
        raise NotImplementedError(f"SFILlama does not support {', '.join(used)}; tfs_z is no longer one of "
                                  "llama.cpp's samplers")


def required_string(obj: dict, key: str, where: str) -> str:
    """obj[key], which a request must give as a string (the Responses and Messages APIs' items and blocks)."""
    value = obj.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string, got {value!r}")
    return value


def grammar_text(grammar) -> str | None:
    """A `grammar` argument (None, a llama_cpp.LlamaGrammar, GBNF text) as GBNF text."""
    if grammar is None or isinstance(grammar, str):
        return grammar or None
    text = getattr(grammar, "_grammar", None)
    if not isinstance(text, str):
        raise ValueError(f"grammar must be a llama_cpp.LlamaGrammar or GBNF text, got {grammar!r}")
    return text


def response_format_grammar(response_format) -> str | None:
    """GBNF for a response_format: None for text; JSON for json_object (its "schema" if given); the schema of
    json_schema ({"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}})."""
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    if response_format is None:
        return None
    if not isinstance(response_format, dict) or response_format.get("type") not in ("text", "json_object",
                                                                                  "json_schema"):
        raise ValueError("response_format must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
                         f"'json_schema', 'json_schema': {{'schema': ...}}}}, got {response_format!r}")
    kind = response_format["type"]
    if kind == "text":
        return None
    schema = response_format.get("schema")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError(f"response_format json_schema needs json_schema.schema (an object), got {spec!r}")
    if schema is None:
        return JSON_GBNF
    if not isinstance(schema, dict):
        raise ValueError(f"response_format schema must be a JSON schema object, got {schema!r}")
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # the converter raises plain Exceptions and others for what it cannot convert
        raise ValueError(f"response_format: the JSON schema cannot be turned into a grammar: {exc}") from None


def stats_dict(stats) -> dict[str, Any]:
    """`GenerationStats` (with its `SFIStats`) as JSON-safe data: the "sfi_stats" of a response."""
    out = dataclasses.asdict(stats)
    out["decode_tok_s"] = stats.decode_tok_s
    if stats.sfi is not None:
        out["sfi"]["mean_overlap"] = stats.sfi.mean_overlap
    return _json_safe(out)


def usage(sfi_stats: dict[str, Any]) -> dict[str, int]:
    """OpenAI "usage" from "sfi_stats" (a final end-of-generation token is not a completion token)."""
    n_prompt = sfi_stats["n_prompt"]
    n_completion = sfi_stats["n_generated"] - int(sfi_stats["ended_on_eog"])
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def choice_usage(sfi_stats: dict[str, Any], index: int, n: int) -> dict[str, int]:
    """The usage of choice `index` of a request with `n` choices per prompt: a prompt counts with its first choice."""
    out = usage(sfi_stats)
    if index % n:
        out.update(prompt_tokens=0, total_tokens=out["completion_tokens"])
    return out


def add_usage(total: dict[str, int] | None, more: dict[str, int]) -> dict[str, int]:
    return dict(more) if total is None else {k: total[k] + more[k] for k in more}


def check_n(n) -> None:
    if not is_int(n) or n < 1:
        raise ValueError(f"n (the number of choices) must be an integer >= 1, got {n!r}")


def _choice_sampling(sampling: SamplingParams, j: int) -> SamplingParams:
    """Choice j's sampling: seed + j with a seed (choices differ; the same request repeats them), else its own random
    seed (each choice's sampler draws one)."""
    if j == 0 or sampling.seed is None:
        return sampling
    # (0xFFFFFFFF is llama.cpp's "draw a random seed")
    return dataclasses.replace(sampling, seed=(sampling.seed + j) % 0xFFFFFFFF)


def _choice_runs(make, n_prompts: int, n: int) -> Iterator:
    """make(prompt_index, j) for every choice, in index order: the first now (its errors raise at the call), each
    other when the one before is done.

    The choices run one after the other, not as n sequences of a batch: a one-sequence model (the default server)
    has no second sequence, and each choice after the first reuses the prompt's KV cache (the prefix shared with the
    call before; on parallel slots, unless another request took the slot), so the prompt is prefilled once. Sharing
    the prompt across batch sequences would need each sequence's SFI state (compact view, selection) copied with
    its KV cells.
    """
    order = [(i, j) for i in range(n_prompts) for j in range(n)]
    first = make(*order[0])
    return itertools.chain([first], (make(i, j) for i, j in order[1:]))


def _merged(head: dict, results: list[dict], n: int) -> dict:
    """One text_completion of several runs (one choice each): usage counts each prompt once."""
    total = None
    for r in results:
        total = add_usage(total, choice_usage(r["sfi_stats"], r["choices"][0]["index"], n))
    return {**head, "choices": [r["choices"][0] for r in results], "usage": total,
            "sfi_stats": [r["sfi_stats"] for r in results]}


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


# -- completions ----------------------------------------------------------------------------------
def create_completion(llm, prompt, suffix=None, max_tokens=16, temperature=0.8, top_p=0.95, min_p=0.05,
                      typical_p=1.0, logprobs=None, echo=False, stop=None, frequency_penalty=0.0,
                      presence_penalty=0.0, repeat_penalty=1.0, top_k=40, stream=False, seed=None, tfs_z=1.0,
                      mirostat_mode=0, mirostat_tau=5.0, mirostat_eta=0.1, model=None, stopping_criteria=None,
                      logits_processor=None, grammar=None, logit_bias=None, *, sfi=None, n=1):
    """`llama_cpp.Llama.create_completion`: a text_completion dict, or an iterator of chunks if stream.

    `sfi` (an SFIConfig, policy name, bool or dict of SFIConfig keywords) overrides the model's SFI
    settings for this call. `n`: choices per prompt (then "sfi_stats" is a list, one per choice).
    """
    _check_supported(locals())
    check_n(n)
    prompts = _prompt_list(prompt)
    if echo not in (True, False):
        raise ValueError(f"echo must be true or false, got {echo!r}")
    if echo and logprobs is not None:
        raise NotImplementedError("echo with logprobs (the log-probabilities of the prompt's tokens) is not supported")
    sampling = SamplingParams.of(locals())
    options = dict(stop=stop, sfi=sfi, grammar=grammar_text(grammar), logits_processor=logits_processor,
                   stopping_criteria=stopping_criteria)
    head = _head("cmpl", model, llm)
    if suffix is not None:
        if len(prompts) != 1 or not isinstance(prompts[0], str) or not isinstance(suffix, str):
            raise ValueError("suffix (fill in the middle) takes one text prompt, the text before the gap, and the "
                             f"text after it as a string; got prompt {prompt!r}, suffix {suffix!r}")
        all_tokens = [_infill_tokens(llm, prompts[0], suffix)]
    elif len(prompts) == 1:
        all_tokens = [llm.prompt_tokens(prompts[0])]
    else:  # the OpenAI API's list of prompts: every prompt is checked before the first is decoded
        all_tokens = [llm.prompt_tokens(p) for p in prompts]
        for i, tokens in enumerate(all_tokens):
            if len(tokens) >= llm.n_ctx:
                raise ValueError(f"prompt {i} has {len(tokens)} tokens, the context holds {llm.n_ctx} (n_ctx)")
    run = lambda i, j: _completion(llm, prompts[i], all_tokens[i], max_tokens, stream, logprobs,  # noqa: E731
                                   _choice_sampling(sampling, j), options, head, index=i * n + j, echo=echo)
    if len(prompts) == 1 and n == 1:
        return run(0, 0)
    runs = _choice_runs(run, len(prompts), n)
    return _chained(runs) if stream else _merged(head, list(runs), n)


def _prompt_list(prompt) -> list:
    """A completion's prompts: a string or token ids, or (as the OpenAI API allows) a list of those."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, (list, tuple)) and all(isinstance(p, str) or (_is_ids(p) and p) for p in prompt):
        return list(prompt)
    raise ValueError("prompt must be a string, a list of token ids, or a list of strings or of token-id lists "
                     "(chat messages go to create_chat_completion)")


def _is_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _head(kind: str, model, llm) -> dict:
    return {"id": f"{kind}-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
            "model": model if model is not None else str(llm.model_path)}


def _infill_tokens(llm, prefix: str, suffix: str) -> list[int]:
    """Fill in the middle: BOS (if the vocabulary adds one), FIM-prefix, the prefix, FIM-suffix, the suffix, FIM-middle;
    the order of llama.cpp's infill for models trained prefix-suffix-middle (Qwen2.5-Coder, CodeLlama, StarCoder)."""
    from ..core.library import llama_cpp

    vocab = llm.context.vocab
    pre, suf, mid = (llama_cpp.llama_vocab_fim_pre(vocab), llama_cpp.llama_vocab_fim_suf(vocab),
                     llama_cpp.llama_vocab_fim_mid(vocab))
    if min(pre, suf, mid) < 0:
        raise ValueError(f"suffix (fill in the middle) needs a vocabulary with fill-in-the-middle tokens; "
                         f"{llm.model_path.name} has none")
    bos = llama_cpp.llama_vocab_bos(vocab)
    head = [bos] if bos >= 0 and llama_cpp.llama_vocab_get_add_bos(vocab) else []
    text = lambda s: llm.context.tokenize(s, add_special=False, parse_special=False) if s else []  # noqa: E731
    tokens = head + [pre] + text(prefix) + [suf] + text(suffix) + [mid]
    if len(tokens) >= llm.n_ctx:
        raise ValueError(f"prompt and suffix have {len(tokens)} tokens, the context holds {llm.n_ctx} (n_ctx)")
    return tokens


def _completion(llm, prompt, tokens, max_tokens, stream, logprobs, sampling, options, head, index=0, echo=False):
    prompt_text = prompt if isinstance(prompt, str) else llm.detokenize(tokens)
    return _complete(llm, tokens, max_tokens, stream, logprobs, sampling, options,
                     lambda records: _completion_logprobs(llm, records, len(prompt_text)), head, index,
                     echo_text=prompt_text if echo else "")


def _chained(streams) -> Iterator[dict]:
    """The chunks of several streams, one after the other (each created when the one before is done)."""
    for chunks in streams:
        try:
            yield from chunks
        finally:
            chunks.close()


def _complete(llm, tokens, max_tokens, stream, logprobs, sampling, options, shape_logprobs, head, index=0,
              echo_text=""):
    """Generate and shape a text_completion (or its chunks); the chat API converts the result. `sampling`: the
    SamplingParams, `options`: generate's other keywords (stop, sfi, grammar ...). `echo_text` goes before the
    generated text (the first chunk when streaming)."""
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
        raise ValueError(f"max_tokens must be None or an integer, got {max_tokens!r}")
    if max_tokens is None or max_tokens <= 0:  # llama-cpp-python: as many as the context holds
        max_tokens = max(llm.n_ctx - len(tokens), 1)
    out = llm.generate(tokens, max_tokens=max_tokens, stream=stream, logprobs=logprobs, sampling=sampling, **options)
    if stream:
        return _completion_chunks(head, out, llm.last_stats, index, echo_text)
    choice = {"text": echo_text + out.text, "index": index,
              "logprobs": shape_logprobs(out.logprobs) if logprobs is not None else None,
              "finish_reason": out.finish_reason}
    stats = stats_dict(out.stats)
    return {**head, "choices": [choice], "usage": usage(stats), "sfi_stats": stats}


def _completion_chunks(head, pieces: Iterator[str], stats, index: int = 0, echo_text: str = "") -> Iterator[dict]:
    try:
        if echo_text:
            yield {**head, "choices": [{"text": echo_text, "index": index, "logprobs": None, "finish_reason": None}]}
        for piece in pieces:
            yield {**head, "choices": [{"text": piece, "index": index, "logprobs": None, "finish_reason": None}]}
    finally:
        pieces.close()  # a stream closed early ends its generation now, not when it is garbage-collected
    yield {**head, "choices": [{"text": "", "index": index, "logprobs": None, "finish_reason": stats.finish_reason}],
           "sfi_stats": stats_dict(stats)}


def _records(llm, records):
    """Sampler records without a final end-of-generation token, with each token's text."""
    records = list(records or [])
    if records and llm.context.is_eog(records[-1][0]):
        records.pop()
    piece = lambda t: llm.context.token_bytes(t).decode("utf-8", errors="ignore")  # noqa: E731
    return records, piece


def _completion_logprobs(llm, records, text_offset: int) -> dict:
    records, piece = _records(llm, records)
    out = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
    pos = text_offset
    for token, logprob, top in records:
        text = piece(token)
        out["tokens"].append(text)
        out["text_offset"].append(pos)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({**{piece(t): lp for t, lp in top}, text: logprob})
        pos += len(text)
    return out


# -- chat completions -----------------------------------------------------------------------------
def create_chat_completion(llm, messages, functions=None, function_call=None, tools=None, tool_choice=None,
                           temperature=0.2, top_p=0.95, top_k=40, min_p=0.05, typical_p=1.0, stream=False,
                           stop=None, seed=None, response_format=None, max_tokens=None, presence_penalty=0.0,
                           frequency_penalty=0.0, repeat_penalty=1.0, tfs_z=1.0, mirostat_mode=0,
                           mirostat_tau=5.0, mirostat_eta=0.1, model=None, logits_processor=None, grammar=None,
                           logit_bias=None, logprobs=None, top_logprobs=None, *, sfi=None, parallel_tool_calls=None,
                           n=1):
    """`llama_cpp.Llama.create_chat_completion`: a chat.completion dict, or chat.completion.chunk dicts.

    The prompt is the GGUF's chat template applied to `messages` (and `tools`). A conversation that grows
    turn by turn reuses the KV cache of everything before the new messages. With tools, the model's calls
    come back as the message's `tool_calls` (streamed as `delta.tool_calls`), finish_reason "tool_calls".
    `n` choices each read their own calls and follow the grammar of `response_format` on their own.
    """
    _check_supported(locals())
    check_n(n)
    if not isinstance(messages, (list, tuple)) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    if logprobs not in (None, True, False):
        raise ValueError(f"logprobs must be true or false, got {logprobs!r}")
    if top_logprobs is not None and (not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool)
                                     or not 0 <= top_logprobs <= 20):
        raise ValueError(f"top_logprobs must be an integer in [0, 20], got {top_logprobs!r}")
    request = tool_calls.tool_request(tools, tool_choice, functions, function_call, parallel_tool_calls,
                                      template=llm.context.chat_template())
    constraint = [(name, g) for name, g in (("grammar", grammar_text(grammar)),
                                            ("response_format", response_format_grammar(response_format)),
                                            (f"tool_choice {request.choice!r}",
                                             tool_calls.grammar(request) if request.forced else None)) if g]
    if len(constraint) > 1:
        raise ValueError(f"{' and '.join(n for n, _ in constraint)} both constrain the answer; give one")
    tokens = llm.prompt_tokens(tool_calls.template_messages(list(messages)),
                               tools=request.tools)  # tool_choice "none": shown, not called (the prefix stays)
    n_top = (top_logprobs or 0) if logprobs else None
    sampling = SamplingParams.of(locals())
    options = dict(stop=stop, sfi=sfi, grammar=constraint[0][1] if constraint else None,
                   logits_processor=logits_processor)
    if request.active:  # the format's markers stay in the text the calls are read from
        options["keep_special"] = _marker_tokens(llm, request.format.markers)
    head = _head("cmpl", model, llm)
    shape_logprobs = lambda records: _chat_logprobs(llm, records)  # noqa: E731
    run = lambda _, j: _complete(llm, tokens, max_tokens, stream, n_top, _choice_sampling(sampling, j),  # noqa: E731
                                 options, shape_logprobs, head, index=j)
    runs = _choice_runs(run, 1, n)
    if stream:
        return _chained(_chat_chunks(chunks, request) for chunks in runs)
    result = _merged(head, list(runs), n)
    return {"id": "chat" + result["id"], "object": "chat.completion", "created": result["created"],
            "model": result["model"], "choices": [_chat_choice(c, request) for c in result["choices"]],
            "usage": result["usage"], "sfi_stats": result["sfi_stats"] if n > 1 else result["sfi_stats"][0]}


def _chat_choice(choice: dict, request) -> dict:
    message = {"role": "assistant", "content": choice["text"]}
    finish = choice["finish_reason"]
    if request.active:
        message, finish = tool_calls.message(choice["text"], finish, request)
    return {"index": choice["index"], "message": message, "logprobs": choice["logprobs"], "finish_reason": finish}


def _marker_tokens(llm, markers) -> list[int]:
    """The tokens that are one of `markers` each (as control tokens, llama.cpp would leave their text out)."""
    ids = [llm.context.tokenize(m, add_special=False, parse_special=True) for m in markers]
    return [t[0] for t in ids if len(t) == 1]


def _chat_logprobs(llm, records) -> dict:
    records, piece = _records(llm, records)

    def entry(token, logprob):
        return {"token": piece(token), "logprob": logprob, "bytes": list(llm.context.token_bytes(token))}

    return {"content": [{**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
                        for token, logprob, top in records],
            "refusal": None}


def _chat_chunks(chunks: Iterator[dict], request=None) -> Iterator[dict]:
    calls = tool_calls.CallStream(request) if request is not None and request.active else None
    try:
        for i, chunk in enumerate(chunks):
            head = {"id": "chat" + chunk["id"], "model": chunk["model"], "created": chunk["created"],
                    "object": "chat.completion.chunk"}
            c = chunk["choices"][0]
            delta = lambda d, finish=None: {**head, "choices": [  # noqa: E731
                {"index": c["index"], "delta": d, "logprobs": None, "finish_reason": finish}]}
            if i == 0:
                yield delta({"role": "assistant"})
            if c["finish_reason"] is None:
                if calls is None:
                    yield delta({"content": c["text"]})
                else:
                    yield from map(delta, calls.deltas(c["text"]))
                continue
            finish = c["finish_reason"]
            if calls is not None:
                yield from map(delta, calls.deltas(None))
                finish = calls.finish_reason(finish)
            out = delta({}, finish)
            if "sfi_stats" in chunk:
                out["sfi_stats"] = chunk["sfi_stats"]
            yield out
    finally:
        chunks.close()
