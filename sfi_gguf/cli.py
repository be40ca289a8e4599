"""The `sfi-gguf` command line."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import textwrap
import warnings
from pathlib import Path

# The benchmark and evaluation tooling (sfi_gguf.tools): each verb's module parses its own options
# (`main(argv)`) and is imported only when that verb runs.
TOOLS = {
    "eval": ("sfi_gguf.tools.evals.command",
             "quality evaluation: every policy against dense at equal budget (needle, variables, ...)"),
    "bench": ("sfi_gguf.tools.bench", "decode speed, dense vs SFI in one process, at several context depths"),
}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="GGUF file or known model name (default: qwen2.5-coder-0.5b-instruct, fetched on first use)")
    p.add_argument("-c", "--n-ctx", type=int, default=4096, help="context size in tokens (0 = model's maximum)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers to offload to the GPU (-1 = all)")
    p.add_argument("--kv-on-host", action="store_true",
                   help="keep the KV cache in host RAM and only SFI's compact view on the GPU: contexts larger "
                        "than the GPU's memory (needs -ngl)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--flash-attn", choices=["on", "off"], default="on",
                   help="flash attention (off: faster on CPUs at long context; SFI works either way)")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")


_SWITCH = {"auto": None, "on": True, "off": False}
_NOT_FLAGS = ("policy", "policy_params", "selector", "selector_params")  # --policy and --selector name them


def _sfi_flag_groups() -> list[tuple[str, type, list[str]]]:
    """(title, dataclass, field names) of each group of SFI flags: SFIConfig's budgets, then each
    policy's and each selector's parameters; a name shared by several has one flag, in its first group."""
    import dataclasses

    from .core.config import SFIConfig
    from .core.policy import POLICIES
    from .core.selector import SELECTORS

    groups = [("Slow-Fast Inference (on by default)", SFIConfig,
               [f.name for f in dataclasses.fields(SFIConfig) if f.name not in _NOT_FLAGS])]
    seen = set(groups[0][2])
    for kind, registry in (("policy", POLICIES), ("selector", SELECTORS)):
        for name, cls in registry.items():
            names = [n for n in cls.Params.names() if n not in seen]
            seen.update(names)
            if names:
                groups.append((f"parameters of {kind} {name!r} (--{kind} {name})", cls.Params, names))
    return groups


def _flag_type(cls: type, name: str):
    """argparse keywords for the field `name` of the dataclass `cls` (annotations are strings here)."""
    import dataclasses

    annotation = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    base = text.replace(" | None", "").strip()
    if base == "bool":
        return {"choices": list(_SWITCH) if "None" in text else ["on", "off"]}
    if base not in ("int", "float"):
        raise TypeError(f"{cls.__name__}.{name}: a command-line flag needs an int, float or bool field, not {text}")
    return {"type": {"int": int, "float": float}[base]}


def add_sfi_args(parser: argparse.ArgumentParser, *, dense: bool = True, policies=None):
    """The SFI flags, made from the fields of `SFIConfig` and of each registered policy's and selector's
    parameters (name, type, help from the docstring, default). A flag left out keeps the field's
    default (`sfi_config_from_args`). `dense`: also --dense; `policies`: the choices of --policy."""
    from .core.config import SFIConfig
    from .core.params import field_help
    from .core.policy import POLICIES
    from .core.selector import SELECTORS

    policies = list(POLICIES if policies is None else policies)
    (title, _, budget), *params = _sfi_flag_groups()
    g = parser.add_argument_group(title)
    if dense:
        g.add_argument("--dense", action="store_true", help="plain dense decoding (full KV cache every step)")
    g.add_argument("--policy", choices=policies, default=SFIConfig.policy,
                   help="when a step is slow: " + " | ".join(f"{n}: {POLICIES[n].summary().rstrip('.')}" for n in policies)
                   .replace("`", "").replace("%", "%%") + f" (default: {SFIConfig.policy})")
    g.add_argument("--selector", choices=list(SELECTORS), default=SFIConfig.selector,
                   help=f"how the sparse memory is chosen (default: {SFIConfig.selector})")
    for group, cls, names in [(g, SFIConfig, budget)] + [(parser.add_argument_group(t), c, n) for t, c, n in params]:
        for name in names:
            text = field_help(cls, name).replace("`", "")
            others = [c for c in _param_classes() if c is not cls and name in c.names()]
            if others:
                text += " [" + ", ".join(f"{_owner(c)}: {getattr(c, name)}" for c in others) + "]"
            group.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                               help=text.replace("%", "%%"), **_flag_type(cls, name))
    return g


def _param_classes() -> list[type]:
    from .core.policy import POLICIES
    from .core.selector import SELECTORS

    return list(dict.fromkeys(c.Params for c in [*POLICIES.values(), *SELECTORS.values()]))


def _owner(params: type) -> str:
    from .core.policy import POLICIES
    from .core.selector import SELECTORS

    return ", ".join([n for n, c in POLICIES.items() if c.Params is params] +
                     [n for n, c in SELECTORS.items() if c.Params is params])


def sfi_config_from_args(args: argparse.Namespace, warn=None):
    """The `SFIConfig` of the flags `add_sfi_args` made (False with --dense): the flags given, the
    defaults for the others. `warn(text)` is told about parameters the policy or selector named does not read."""
    from .core.config import SFIConfig

    if getattr(args, "dense", False):
        return False
    given = {name: getattr(args, name) for _, _, names in _sfi_flag_groups() for name in names
             if getattr(args, name, None) is not None}
    given = {name: _SWITCH[value] if isinstance(value, str) else value for name, value in given.items()}
    config = SFIConfig(policy=args.policy, selector=args.selector, **given)
    if warn is not None:
        read = set(config.policy_params.names()) | set(config.selector_params.names()) | set(_sfi_flag_groups()[0][2])
        for name in sorted(set(given) - read):
            warn(f"--{name.replace('_', '-')} has no effect with --policy {config.policy} --selector {config.selector}")
    return config


def _flash_attn(args: argparse.Namespace) -> bool | None:
    return args.flash_attn == "on"


def _sfi_from_args(args: argparse.Namespace):
    return sfi_config_from_args(args, warn=lambda text: print(f"sfi-gguf: warning: {text}", file=sys.stderr))


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    from .core.sampling import SamplingParams

    d = SamplingParams()
    g = p.add_argument_group("sampling", "the defaults are llama-cpp-python's and llama-server's")
    g.add_argument("--temperature", type=float, default=d.temperature,
                   help=f"0 = greedy, always the most likely token (default {d.temperature})")
    g.add_argument("--top-p", type=float, default=d.top_p, help=f"(default {d.top_p})")
    g.add_argument("--top-k", type=int, default=d.top_k, help=f"(default {d.top_k})")
    g.add_argument("--min-p", type=float, default=d.min_p, help=f"(default {d.min_p})")
    g.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible answers (default: random)")


def _sampling_from_args(args: argparse.Namespace):
    """The command's SamplingParams, checked before the model loads."""
    from .core.sampling import SamplingParams

    return SamplingParams.of(vars(args))


def _cmd_run(args: argparse.Namespace) -> int:
    from .sfi_llama import SFILlama
    from .core.stepper import format_sfi_stats

    prompt = args.prompt
    if args.file:
        prompt = Path(args.file).read_text() + (("\n\n" + prompt) if prompt else "")
    if not prompt:
        print("sfi-gguf run: give a prompt or --file", file=sys.stderr)
        return 2
    sampling = _sampling_from_args(args)
    llm = SFILlama(args.model, n_ctx=args.n_ctx, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads,
                   flash_attn=_flash_attn(args), verbose=args.verbose, progress=True, sfi=_sfi_from_args(args),
                   kv_on_host=args.kv_on_host)
    chat = not args.raw and llm.context.chat_template() is not None
    request = [{"role": "user", "content": prompt}] if chat else prompt
    for piece in llm.generate(request, max_tokens=args.max_tokens, sampling=sampling, stop=args.stop or None,
                              stream=True):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = llm.last_stats
    print(f"[{s.mode}] {s.n_generated} tokens, {s.decode_tok_s:.1f} tok/s decode, prompt {s.n_prompt} tokens "
          f"in {s.prefill_s:.2f} s, context {s.n_ctx_end}/{llm.n_ctx}, finish: {s.finish_reason}",
          file=sys.stderr)
    if s.sfi is not None:
        print(format_sfi_stats(s.sfi), file=sys.stderr)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    """A TCP port, checked before the model loads (a bad one would fail only once the server binds)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535 (0 picks a free one), got {value}")
    return value


def _llm_from_args(args: argparse.Namespace, progress: bool = False):
    from .sfi_llama import SFILlama

    return SFILlama(args.model, n_ctx=args.n_ctx, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads,
                    flash_attn=_flash_attn(args), verbose=args.verbose, progress=progress,
                    sfi=_sfi_from_args(args), n_parallel=getattr(args, "parallel", 1), kv_on_host=args.kv_on_host)


def _cmd_chat(args: argparse.Namespace) -> int:
    from .cli_chat import chat_loop

    sampling = _sampling_from_args(args)
    return chat_loop(_llm_from_args(args), system=args.system, max_tokens=args.max_tokens, stats=args.stats,
                     sampling=sampling)


def _cmd_serve(args: argparse.Namespace) -> int:
    from .serve.server import serve

    serve(_llm_from_args(args), host=args.host, port=args.port, model_name=args.alias, verbose=args.verbose)
    return 0


def _cmd_model(args: argparse.Namespace) -> int:
    from .models import KNOWN_MODELS, ensure_model

    names = list(KNOWN_MODELS) if args.name == "all" else [args.name]
    for name in names:
        print(ensure_model(name))
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from . import native_info
    from .core.devices import summary

    print(json.dumps({**native_info(), **summary()}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sfi-gguf", description="Slow-Fast Inference for GGUF models on llama.cpp")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate a continuation of a prompt, streamed to stdout (SFI on)",
                         epilog="examples: sfi-gguf run \"Write a haiku about caches\" | "
                                "sfi-gguf run -f report.txt \"Summarize the text above.\" -c 16384",
                         description="Generate with Slow-Fast Inference (SFI): most steps attend to a small "
                                     "selected memory, a few (at sentence starts) to the whole context. "
                                     "Contexts shorter than sink + k_head + recent decode densely.")
    run.add_argument("prompt", nargs="?", default="", help="the prompt (chat-formatted if the model has a template)")
    run.add_argument("-f", "--file", help="read (the start of) the prompt from a file, e.g. a long document")
    run.add_argument("-n", "--max-tokens", type=int, default=256, help="how many tokens to generate at most")
    _add_sampling_args(run)
    run.add_argument("--stop", action="append", help="stop string (repeatable)")
    run.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_model_args(run)
    add_sfi_args(run)
    run.set_defaults(func=_cmd_run)

    chat = sub.add_parser(
        "chat", help="talk with the model in the terminal; the conversation is kept (SFI on)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "An interactive chat with the model's chat template. Type a message and press Enter; the answer "
            "streams back. The history is kept, and each turn only processes the new message (the KV cache of "
            "the conversation so far is reused). Reads standard input, so piped input works too.", 79),
        epilog="commands:\n  /reset   forget the conversation (keeps --system)\n"
               "  /quit    leave (so does end of input, Ctrl-D)\n\n"
               "examples:\n  sfi-gguf chat --stats\n"
               "  printf 'Name a prime number.\\n/quit\\n' | sfi-gguf chat -n 32 --temperature 0")
    chat.add_argument("--system", default=None, help="a system message that starts the conversation")
    chat.add_argument("-n", "--max-tokens", type=int, default=512, help="longest answer, in tokens (default 512)")
    _add_sampling_args(chat)
    chat.add_argument("--stats", action="store_true",
                      help="after each answer, print speed, prompt tokens reused and the SFI statistics on stderr")
    _add_model_args(chat)
    add_sfi_args(chat)
    chat.set_defaults(func=_cmd_chat)

    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Serve the model over HTTP with the OpenAI API, so any OpenAI client (the openai Python package, "
            "curl, editors) can use it. Streaming uses server-sent events. Requests take turns (one model, one "
            "KV cache; a conversation that grows turn by turn reuses its cache), or with --parallel N up to N "
            "requests decode together, each in its own slot. Every response has an extra "
            "\"sfi_stats\" field with the request's statistics; a request may set SFI options in an \"sfi\" "
            "field (SFIConfig keywords, or false for dense).", 79),
        epilog="example:\n  sfi-gguf serve --port 8000 &\n"
               "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
               "       -d '{\"model\": \"any\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'\n"
               "  # Python: openai.OpenAI(base_url=\"http://127.0.0.1:8000/v1\", api_key=\"none\")")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to "
                            "the network)")
    serve.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    serve.add_argument("--parallel", type=_positive_int, default=1, metavar="N",
                       help="slots: up to N requests decode together in one batch, each with its own SFI state "
                            "and n_ctx cells (default 1: requests take turns)")
    serve.add_argument("--alias", default=None,
                       help="model name shown in /v1/models and responses (default: the GGUF file name)")
    _add_model_args(serve)
    add_sfi_args(serve)
    serve.set_defaults(func=_cmd_serve)

    model = sub.add_parser("model", help="fetch, assemble and verify a known model; print its path")
    model.add_argument("name", nargs="?", default="qwen2.5-coder-0.5b-instruct",
                       help="qwen2.5-coder-0.5b-instruct, gemma3-270m, qwen2.5-coder-1.5b-instruct or all")
    model.set_defaults(func=_cmd_model)

    info = sub.add_parser("info", help="show the loaded llama.cpp library and its build")
    info.set_defaults(func=_cmd_info)

    for name, (_, help_text) in TOOLS.items():  # listed here, parsed by their module (see `main`)
        sub.add_parser(name, help=help_text, add_help=False)
    for command_parser in sub.choices.values():  # (see `main`)
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the package's warnings as this command's own (not a source file's line)
    warnings.formatwarning = lambda message, *_, **__: f"sfi-gguf: warning: {message}\n"
    try:
        if argv and argv[0] in TOOLS:
            return importlib.import_module(TOOLS[argv[0]][0]).main(argv[1:])
        args, unknown = build_parser().parse_known_args(argv)
        if unknown:  # refused by the command's parser, with its usage (parse_args would show the top level's)
            args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        return args.func(args)
    except (ValueError, OSError, MemoryError) as exc:  # OSError: a missing file, a port in use
        print(f"sfi-gguf: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nsfi-gguf: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
