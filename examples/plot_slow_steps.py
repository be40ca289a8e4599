"""Plot where the slow steps fired during one generation, with the refresh overlap of each.

A long prompt (natural prose) makes SFI select a sparse memory; the answer is generated with the
punctuation policy (a slow step on the first token of each new sentence, at least every T_max steps).
The figure shows every generated token as fast or slow, the refresh overlap (how much of the selected
memory a refresh kept: support stability) at each slow step, and the sentence ends of the text.

    python examples/plot_slow_steps.py [-o slow_steps.png] [--max-tokens 160] [--chars 9000]
"""
import argparse

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("-m", "--model", default=None)
parser.add_argument("-o", "--output", default="slow_steps.png")
parser.add_argument("-n", "--max-tokens", type=int, default=160)
parser.add_argument("--chars", type=int, default=9000, help="prompt length in characters (~4.5 per token)")
parser.add_argument("--k-head", type=int, default=512)
parser.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
args = parser.parse_args()  # first: --help needs neither matplotlib nor the model

try:
    import matplotlib
except ImportError:
    raise SystemExit("plot_slow_steps.py needs matplotlib: pip install matplotlib") from None
matplotlib.use("Agg")  # write a file, no display needed
import matplotlib.pyplot as plt  # noqa: E402

from sfi_gguf import SFIConfig, SFILlama  # noqa: E402
from sfi_gguf.tools.texts import natural_text  # noqa: E402

llm = SFILlama(args.model, n_ctx=4096, n_threads=args.threads, progress=True, sfi=SFIConfig(k_head=args.k_head))
prompt = [{"role": "user", "content": natural_text(args.chars, seed=5)
           + "\n\nExplain the main ideas of the text above in a few sentences."}]
out = llm.generate(prompt, max_tokens=args.max_tokens, temperature=0)
s = out.stats.sfi
if not s.k_head:
    raise SystemExit("the context stayed below sink + k_head + recent: every step was dense; use a longer "
                     "--chars or a smaller --k-head")
print(out.text)

# step k (1-based) decodes generated token k-1; s.slow_steps holds the k of each slow step
n_steps = len(out.tokens) - 1
slow = set(s.slow_steps)
pieces = [llm.detokenize([t]) for t in out.tokens]
sentence_ends = [i + 1 for i, p in enumerate(pieces) if p.rstrip().endswith((".", "?", "!"))]

fig, (ax_steps, ax_overlap) = plt.subplots(2, 1, figsize=(11, 5), sharex=True,
                                           gridspec_kw={"height_ratios": [1, 2]})
ax_steps.vlines([k for k in range(1, n_steps + 1) if k not in slow], 0, 1, color="tab:blue", lw=0.6,
                label=f"fast ({s.n_fast})")
ax_steps.vlines(sorted(slow), 0, 1, color="tab:red", lw=2.0, label=f"slow ({s.n_slow})")
ax_steps.set_yticks([])
ax_steps.legend(loc="upper right", ncol=2, fontsize=8)
ax_steps.set_title(f"SFI steps over {n_steps} generated tokens (policy {s.policy}, k_head {s.k_head}, "
                   f"budget {s.budget} cells/head); slow-step reasons {s.reasons}", fontsize=9)

ax_overlap.plot(s.slow_steps[:len(s.refresh_overlap)], s.refresh_overlap, "o-", color="tab:red",
                label="refresh overlap")
for i, k in enumerate(sentence_ends):
    ax_overlap.axvline(k, color="gray", lw=0.5, ls=":", label="sentence end" if i == 0 else None)
ax_overlap.set_ylim(0, 1.05)
ax_overlap.set_ylabel("overlap with the previous selection")
ax_overlap.set_xlabel("generated token index (decode step)")
ax_overlap.legend(loc="lower right", fontsize=8)
fig.tight_layout()
fig.savefig(args.output, dpi=120)
print(f"\n{s.n_slow} slow steps at {s.slow_steps}; mean overlap {s.mean_overlap:.2f}; wrote {args.output}")
llm.close()
