"""`sfi-gguf chat` with piped input (history kept, /reset, /quit, --stats) and the --help texts."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _cli(*args, stdin=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "sfi_gguf.cli", *args], input=stdin, capture_output=True,
                          text=True, cwd=REPO, timeout=timeout)


@pytest.mark.real_model
def test_chat_keeps_history_resets_and_quits():
    lines = "What is 2 + 2?\nAnd times 3?\n/reset\nSay hello.\n/quit\nThis line is never read.\n"
    result = _cli("chat", "-n", "6", "--temperature", "0", "--stats", "-c", "1024", "-t", "1", stdin=lines)
    assert result.returncode == 0, result.stderr
    answers = result.stdout.strip("\n").split("\n")
    assert len(answers) == 3 and all(a.strip() for a in answers), result.stdout
    assert "[conversation reset]" in result.stderr
    turns = [(int(a), int(b)) for a, b in re.findall(r"prompt (\d+) tokens, (\d+) new", result.stderr)]
    assert len(turns) == 3, result.stderr
    (p1, _), (p2, new2), (p3, _) = turns
    assert p2 > p1 and new2 < p2 - p1   # the second turn carries the first one, reused from the cache
    assert p3 < p2                       # after /reset the history is gone
    assert result.stderr.count("SFI: policy") == 3


@pytest.mark.parametrize("command, words", [("run", ["--max-tokens", "greedy", "--file"]),
                                            ("chat", ["/reset", "/quit", "--stats", "--system"]),
                                            ("serve", ["--port", "/v1/chat/completions", "openai", "sfi_stats"])])
def test_help_texts(command, words):
    result = _cli(command, "--help", timeout=120)
    assert result.returncode == 0
    for word in words:
        assert word in result.stdout, (command, word)


@pytest.mark.parametrize("args, message", [
    (["serve", "--port", "99999"], "argument --port: a TCP port is 0..65535 (0 picks a free one), got 99999"),
    (["serve", "--port", "-1"], "a TCP port is 0..65535"),
    (["run", "hi", "--bogus", "-n", "2"], "unrecognized arguments: --bogus"),
    (["chat", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_show_the_commands_usage(args, message):
    """Refused as argparse refuses (exit 2) by the command's own parser, before any model is loaded."""
    result = _cli(*args, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert result.stderr.startswith(f"usage: sfi-gguf {args[0]} ") and "Traceback" not in result.stderr


def test_run_and_chat_share_one_set_of_sampling_flags():
    """One set of sampling flags, llama-cpp-python's defaults for both commands (said in --help); a bad value is
    refused before any model is loaded."""
    from sfi_gguf.cli import _sampling_from_args, build_parser
    from sfi_gguf.core.sampling import SamplingParams

    parser = build_parser()
    for argv in (["run", "hi"], ["chat"]):
        assert _sampling_from_args(parser.parse_args(argv)) == SamplingParams()
    args = parser.parse_args(["chat", "--temperature", "0", "--top-p", "0.5", "--top-k", "3", "--min-p", "0.1",
                              "--seed", "4"])
    assert _sampling_from_args(args) == SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.1, seed=4)
    result = _cli("chat", "--help", timeout=120)
    assert "llama-cpp-python's and llama-server's" in result.stdout and "(default 0.8)" in result.stdout
    result = _cli("run", "hi", "--top-p", "2", "-m", "/nonexistent.gguf", timeout=120)
    assert result.returncode == 2 and "top_p must be a number in (0, 1]" in result.stderr, result.stderr


def test_an_example_parses_its_arguments_before_importing_matplotlib():
    """`--help` of the plotting example works without matplotlib (it is imported only to plot)."""
    code = ("import runpy, sys\n"
            "sys.modules['matplotlib'] = None  # an import of it raises ImportError\n"
            "sys.argv = ['plot_slow_steps.py', '--help']\n"
            "runpy.run_path('examples/plot_slow_steps.py', run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0 and "--max-tokens" in result.stdout, result.stderr
