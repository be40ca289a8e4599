"""The server under load: `sfi-gguf serve --parallel P` with SFI against the same server with `--dense`.

N conversations, each a long document (`--doc-tokens`, 32K by default: natural prose, its own text per conversation)
and a request to summarise it, arrive at random times (a Poisson process with a mean gap of `--mean-gap` seconds,
seeded) and stream their answers (at most `--max-tokens`, sampling on: temperature 0.8, top-p 0.95, top-k 40, min-p
0.05, seed `--seed` + i) through the real `openai` client. The same conversations, arrival times and seeds run
once per mode, each against its own server process started here (or against `--url`, one mode, named by `--mode`).

Reported per mode, and side by side with the SFI/dense ratio:
  aggregate tok/s      completion tokens of all conversations / wall time from the first request to the last answer
                       (prefills included: the server prefills a prompt alone, between decode steps)
  decode tok/s         mean over conversations of (completion tokens - 1) / (last chunk - first content chunk)
  time to first token  seconds from a request to its first content chunk (its wait, its prefill): mean, p50, p90
JSON goes to benchmarks/results/ (or --json). A short request warms each server up before the timed run.

  # on the CPU, small (the server's speed here says nothing about a GPU's):
  python3 benchmarks/serve_load.py -m qwen2.5-coder-0.5b-instruct --parallel 2 --conversations 2 --doc-tokens 2048 \\
      --max-tokens 32 -t 2
  # the H200 (scripts/gpu_run.sh serve-load): 8 conversations x 32K, Qwen3-4B shape F16
  python3 benchmarks/serve_load.py -m "$(python3 -m sfi_gguf.tools.random_model qwen3-4b | tail -1)" -ngl 99 \\
      --parallel 8 --conversations 8
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTION = "Summarize the document above in a few paragraphs."
SAMPLING = dict(temperature=0.8, top_p=0.95)
SAMPLING_EXTRA = dict(top_k=40, min_p=0.05)  # (fields of sfi-gguf's API beyond OpenAI's, sent as extra_body)


@dataclass
class Conversation:
    index: int
    arrival_s: float      # after the first one's
    seed: int
    document: str


@dataclass
class Answer:
    index: int
    arrival_s: float
    sent_s: float = 0.0         # since the run's start
    first_s: float | None = None  # first content chunk
    end_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    mode: str = ""              # the server's decoding mode for it ("sfi", "dense")
    n_slow: int = 0             # SFI slow steps (refreshes) of its decoding
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s

    @property
    def decode_tok_s(self) -> float | None:
        if self.first_s is None or self.completion_tokens < 2 or self.end_s <= self.first_s:
            return None
        return (self.completion_tokens - 1) / (self.end_s - self.first_s)


@dataclass
class ModeResult:
    mode: str
    server: list[str]
    aggregate_tok_s: float
    decode_tok_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    wall_s: float
    completion_tokens: int
    answers: list[dict] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between the sorted values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def documents(model_path: str, n: int, n_tokens: int, seed: int) -> list[str]:
    """n documents of exactly n_tokens tokens of the model's tokenizer (its vocabulary alone is loaded)."""
    from sfi_gguf.core.library import llama_cpp
    from sfi_gguf.tools.texts import natural_text

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), params)
    if not model:
        raise SystemExit(f"serve_load: llama.cpp could not read the tokenizer of {model_path}")
    vocab = llama_cpp.llama_model_get_vocab(model)
    try:
        out = []
        for i in range(n):
            n_chars = 5 * n_tokens + 4096
            while True:
                data = natural_text(n_chars, seed=seed * 1000 + i).encode()
                buf = (llama_cpp.llama_token * (len(data) + 16))()
                n_tok = llama_cpp.llama_tokenize(vocab, data, len(data), buf, len(buf), False, False)
                if n_tok >= n_tokens:
                    break
                n_chars *= 2
            text = ctypes.create_string_buffer(64 * n_tokens + 1024)
            n_bytes = llama_cpp.llama_detokenize(vocab, buf, n_tokens, text, len(text), False, False)
            out.append(text.raw[:n_bytes].decode("utf-8", errors="ignore"))
        return out
    finally:
        llama_cpp.llama_model_free(model)


def conversations(model_path: str, n: int, doc_tokens: int, mean_gap: float, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    arrivals = [0.0]
    for _ in range(n - 1):
        arrivals.append(arrivals[-1] + rng.expovariate(1.0 / mean_gap) if mean_gap > 0 else 0.0)
    docs = documents(model_path, n, doc_tokens, seed)
    return [Conversation(i, arrivals[i], seed + i, docs[i]) for i in range(n)]


# -- the server ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"serve_load: the server exited with code {proc.returncode} before it answered")
        try:
            with urllib.request.urlopen(url + "/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"serve_load: no answer from {url} after {timeout_s:.0f} s")


def start_server(args, dense: bool, n_ctx: int, log_path: Path) -> tuple[subprocess.Popen, str, list[str]]:
    port = free_port()
    cmd = [sys.executable, "-m", "sfi_gguf.cli", "serve", "-m", args.model, "--parallel", str(args.parallel),
           "-c", str(n_ctx), "-ngl", str(args.n_gpu_layers), "--port", str(port)]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    if dense:
        cmd.append("--dense")
    cmd += args.server_args
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_ready(url, proc, args.ready_timeout)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url, cmd


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the load ------------------------------------------------------------------------------------

async def converse(client, model: str, conv: Conversation, max_tokens: int, t0: float) -> Answer:
    answer = Answer(conv.index, conv.arrival_s)
    await asyncio.sleep(max(0.0, t0 + conv.arrival_s - time.perf_counter()))
    answer.sent_s = time.perf_counter() - t0
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"{conv.document}\n\n{QUESTION}"}],
            max_tokens=max_tokens, seed=conv.seed, stream=True, stream_options={"include_usage": True},
            extra_body=SAMPLING_EXTRA, **SAMPLING)
        async for chunk in stream:
            now = time.perf_counter() - t0
            if chunk.choices and chunk.choices[0].delta.content and answer.first_s is None:
                answer.first_s = now
            stats = (chunk.model_extra or {}).get("sfi_stats")
            if stats:
                answer.mode = stats.get("mode", "")
                answer.n_slow = ((stats.get("sfi") or {}).get("n_slow")) or 0
            if chunk.usage is not None:
                answer.prompt_tokens = chunk.usage.prompt_tokens
                answer.completion_tokens = chunk.usage.completion_tokens
        answer.end_s = time.perf_counter() - t0
    except Exception as exc:  # recorded, and the run reports it: one failed request does not hide the others
        answer.error = f"{type(exc).__name__}: {exc}"
        answer.end_s = time.perf_counter() - t0
    return answer


async def run_load(url: str, convs: list[Conversation], max_tokens: int, warmup: bool) -> list[Answer]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url, api_key="none", timeout=3600, max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        if warmup:  # the first request of a server reserves its graphs: not part of the timed run
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=4, seed=0, **SAMPLING)
        t0 = time.perf_counter()
        return await asyncio.gather(*(converse(client, model, c, max_tokens, t0) for c in convs))


def summarise(mode: str, server: list[str], answers: list[Answer]) -> ModeResult:
    ok = [a for a in answers if not a.error]
    ttft = [a.ttft_s for a in ok if a.ttft_s is not None]
    decode = [a.decode_tok_s for a in ok if a.decode_tok_s is not None]
    tokens = sum(a.completion_tokens for a in ok)
    wall = max((a.end_s for a in answers), default=0.0) - min((a.sent_s for a in answers), default=0.0)
    nan = float("nan")
    return ModeResult(mode=mode, server=server, aggregate_tok_s=tokens / wall if wall > 0 else nan,
                      decode_tok_s=statistics.fmean(decode) if decode else nan,
                      ttft_mean_s=statistics.fmean(ttft) if ttft else nan, ttft_p50_s=percentile(ttft, 0.5),
                      ttft_p90_s=percentile(ttft, 0.9), wall_s=wall, completion_tokens=tokens,
                      answers=[{**asdict(a), "ttft_s": a.ttft_s, "decode_tok_s": a.decode_tok_s} for a in answers])


def table(results: list[ModeResult]) -> str:
    rows = [("aggregate tok/s", "aggregate_tok_s", "{:.1f}"), ("decode tok/s per conversation", "decode_tok_s", "{:.1f}"),
            ("TTFT mean (s)", "ttft_mean_s", "{:.2f}"), ("TTFT p50 (s)", "ttft_p50_s", "{:.2f}"),
            ("TTFT p90 (s)", "ttft_p90_s", "{:.2f}"), ("completion tokens", "completion_tokens", "{}"),
            ("wall (s)", "wall_s", "{:.1f}")]
    by = {r.mode: r for r in results}
    modes = [m for m in ("sfi", "dense") if m in by] + [m for m in by if m not in ("sfi", "dense")]
    ratio = "sfi" in by and "dense" in by
    head = "| | " + " | ".join(modes) + (" | SFI/dense |" if ratio else " |")
    lines = [head, "|---" * (len(modes) + 1 + ratio) + "|"]
    for name, key, fmt in rows:
        cells = [fmt.format(getattr(by[m], key)) for m in modes]
        if ratio:
            a, b = getattr(by["sfi"], key), getattr(by["dense"], key)
            cells.append(f"{a / b:.2f}x" if b else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("-m", "--model", required=True,
                   help="GGUF path or known model name: served (without --url) and the documents' tokenizer")
    p.add_argument("--url", default=None, help="a running server's base URL (http://host:port/v1): one run, --mode")
    p.add_argument("--mode", default=None, help="with --url: the name of its run (e.g. sfi or dense)")
    p.add_argument("--modes", nargs="+", choices=["sfi", "dense"], default=["sfi", "dense"],
                   help="servers started here, one after the other (default: sfi dense)")
    p.add_argument("--parallel", type=int, default=8, help="the server's slots (default 8)")
    p.add_argument("--conversations", type=int, default=8, help="conversations (default 8)")
    p.add_argument("--doc-tokens", type=int, default=32768, help="tokens of each document (default 32768)")
    p.add_argument("--max-tokens", type=int, default=256, help="longest answer (default 256)")
    p.add_argument("--mean-gap", type=float, default=1.0,
                   help="mean seconds between arrivals (exponential gaps, seeded; 0: all at once; default 1)")
    p.add_argument("--seed", type=int, default=0, help="arrival times, documents and sampling seeds (default 0)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="the rest goes to sfi-gguf serve (e.g. --flash-attn off)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--ready-timeout", type=float, default=1800, help="seconds to wait for a server to load")
    p.add_argument("--json", default=None, help="default: benchmarks/results/serve_load-<kind>-<...>.json")
    args = p.parse_args(argv)
    if args.url and not args.mode:
        p.error("--url needs --mode (the name of its run)")
    if args.conversations < 1 or args.parallel < 1 or args.doc_tokens < 16 or args.max_tokens < 1:
        p.error("--conversations, --parallel, --max-tokens must be >= 1 and --doc-tokens >= 16")

    from sfi_gguf.models import KNOWN_MODELS, ensure_model
    from sfi_gguf.tools.provenance import git_commit

    if args.model in KNOWN_MODELS:
        args.model = str(ensure_model(args.model))
    convs = conversations(args.model, args.conversations, args.doc_tokens, args.mean_gap, args.seed)
    n_ctx = args.doc_tokens + args.max_tokens + 256  # (the chat template and the question)
    out_dir = ROOT / "benchmarks" / "results"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results = []
    for mode in ([args.mode] if args.url else args.modes):
        proc = None
        if args.url:
            url, server = args.url.rstrip("/"), [args.url]
        else:
            print(f"serve_load: starting the {mode} server", flush=True)
            proc, url, server = start_server(args, mode == "dense", n_ctx, Path(os.environ.get("TMPDIR", "/tmp"))
                                             / f"serve_load-{mode}-{stamp}.log")
        try:
            answers = asyncio.run(run_load(url, convs, args.max_tokens, args.warmup))
        finally:
            if proc is not None:
                stop_server(proc)
        result = summarise(mode, server, answers)
        failed = [a for a in answers if a.error]
        for a in failed:
            print(f"serve_load: {mode}: conversation {a.index} failed: {a.error}", file=sys.stderr)
        print(f"serve_load: {mode}: {result.completion_tokens} tokens in {result.wall_s:.1f} s, "
              f"modes {sorted({a.mode for a in answers if a.mode})}", flush=True)
        results.append(result)
    print()
    print(table(results))
    kind = "gpu" if args.n_gpu_layers else "cpu"
    path = Path(args.json) if args.json else out_dir / (
        f"serve_load-{kind}-{Path(args.model).stem}-p{args.parallel}-c{args.conversations}-{args.doc_tokens}"
        f"-{stamp}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(
        git_commit=git_commit(12), model=Path(args.model).name, n_gpu_layers=args.n_gpu_layers, threads=args.threads,
        parallel=args.parallel, conversations=args.conversations, doc_tokens=args.doc_tokens,
        max_tokens=args.max_tokens, mean_gap_s=args.mean_gap, seed=args.seed, n_ctx=n_ctx,
        sampling={**SAMPLING, **SAMPLING_EXTRA}, arrivals_s=[c.arrival_s for c in convs],
        ratio={k: getattr(results[0], k) / getattr(results[1], k)
               for k in ("aggregate_tok_s", "decode_tok_s", "ttft_mean_s")}
        if [r.mode for r in results] == ["sfi", "dense"] else None,
        results=[asdict(r) for r in results]), indent=1) + "\n")
    print(f"wrote {path}")
    return 1 if any(a["error"] for r in results for a in r.answers) else 0


if __name__ == "__main__":
    sys.exit(main())
