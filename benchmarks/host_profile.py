"""Where the host's time goes in a decode loop: a summary of a py-spy `--native` raw profile.

    py-spy record --native -r 250 -f raw -o prof.txt -- python -m sfi_gguf.cli bench ...
    python benchmarks/host_profile.py prof.txt --rate 250 --root "SFIStepper.step" --root "DenseStepper.step"

For each root (a frame pattern, e.g. the stepper's `step`), the time the host spent under it: in all, in each
named phase (graph build, scheduler allocation, CUDA graph capture, the SFI extraction, waits on the GPU, ...)
and in the frames that took most of it, inclusive and self. A GPU's kernels run asynchronously, so the time under
a root is host work plus waits; waits show as synchronisation frames. py-spy stops the process for each native
sample, so read the shares, not the seconds, and keep the rate low (~100/s).
"""
from __future__ import annotations

import argparse
import json
import re
from collections import Counter

# phase -> frame pattern (a sample counts for a phase when any of its frames matches)
PHASES = {
    "llama_decode": r"llama_decode\b|llama_context::decode\b",
    "graph build": r"llama_model::build_graph|llm_build_",
    "sched alloc": r"ggml_backend_sched_alloc_graph",
    "sched reset": r"ggml_backend_sched_reset",
    "set inputs": r"llm_graph_result::set_inputs|llm_graph_input_.*::set_input",
    "graph compute": r"llama_context::graph_compute",
    "cuda graph check": r"ggml_cuda_graph_update_required",
    "cuda graph capture/update": r"cudaStreamBeginCapture|cudaStreamEndCapture|cudaGraphInstantiate|cudaGraphExecUpdate"
                                 r"|ggml_cuda_graph_update_executable",
    "cuda graph launch": r"cudaGraphLaunch",
    "kernel launches (eager)": r"cudaLaunchKernel|cuLaunchKernel",
    "gpu wait": r"cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|ggml_backend_sched_synchronize",
    "sfi decode_begin/plan": r"llama_sfi_context::decode_begin|llama_sfi_plan",
    "sfi extract": r"llama_sfi_context::extract",
    "sfi resolve": r"llama_sfi_context::resolve",
    "sfi export own": r"llama_sfi_export::own",
    "graph results made": r"llm_graph_result::llm_graph_result",
    "sfi load selection": r"llama_sfi_seq_load_selection|llama_sfi_set_selection",
    "sfi graph inputs": r"llama_sfi_.*set_input|llama_sfi_build_inputs",
    "logits to host": r"llama_get_logits|llama_context::get_logits",
    "python: plan": r"SFIStepper\.plan",
    "python: finish": r"SFIStepper\.finish",
    "python: refresh": r"SFIStepper\._refresh_from_export",
    "python: top-1 prob": r"top1_probability",
    "sampling": r"sample|Sampler",
}


def parse(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            stacks.append((stack.split(";"), int(count)))
    return stacks


def frame_name(frame: str) -> str:
    # "name (file:line)" -> "name (file)"; native frames keep their library
    return re.sub(r":\d+\)$", ")", frame)


def summarize(stacks, root: str, rate: float, top: int, within: str | None = None) -> dict:
    root_re = re.compile(root)
    within_re = re.compile(within) if within else None
    phase_res = {k: re.compile(v) for k, v in PHASES.items()}
    total = 0
    phases: Counter = Counter()
    inclusive: Counter = Counter()
    own: Counter = Counter()
    for frames, n in stacks:
        at = next((i for i, f in enumerate(frames) if root_re.search(f)), None)
        if at is None or (within_re and not any(within_re.search(f) for f in frames[:at])):
            continue
        below = frames[at:]
        total += n
        for name, rx in phase_res.items():
            if any(rx.search(f) for f in below):
                phases[name] += n
        for name in {frame_name(f) for f in below[1:]}:
            inclusive[name] += n
        own[frame_name(below[-1])] += n
    seconds = lambda n: round(n / rate, 4)  # noqa: E731
    return {
        "root": root, "within": within, "samples": total, "seconds": seconds(total),
        "phases": {k: seconds(v) for k, v in phases.most_common() if v},
        "inclusive": [(k, seconds(v)) for k, v in inclusive.most_common(top)],
        "self": [(k, seconds(v)) for k, v in own.most_common(top)],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="py-spy raw output (-f raw)")
    ap.add_argument("--rate", type=float, required=True, help="py-spy's sampling rate (-r)")
    ap.add_argument("--root", action="append", required=True, help="frame pattern (regex) to summarize under")
    ap.add_argument("--within", help="frame pattern (regex) a stack must hold above its root, e.g. one run's call site")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", help="write the summaries here")
    args = ap.parse_args(argv)
    stacks = parse(args.profile)
    out = [summarize(stacks, r, args.rate, args.top, args.within) for r in args.root]
    for s in out:
        print(f"\n## under {s['root']}: {s['seconds']:.2f} s ({s['samples']} samples)")
        share = lambda v: 100 * v / max(s["seconds"], 1e-9)  # noqa: E731
        for title, rows in (("phases", s["phases"].items()), ("frames, inclusive", s["inclusive"]),
                            ("frames, self", s["self"])):
            print(f"{title} (s, % of the root):")
            for k, v in rows:
                print(f"  {v:8.3f} {share(v):5.1f}%  {k[:160]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
