"""Random-weight GGUF files for tests and benchmarks, written with the `gguf` package.

Tiny models (a few layers, n_embd 64-128, GQA) make the native exactness tests fast and independent
of downloads; large ones with the shape of a real model (e.g. Qwen3-4B) are for step-time benchmarks,
where only shapes matter. Files are cached under ~/.cache/sfi-gguf/random-models, keyed by every
parameter, so a second call returns at once.

Vocabularies:
  * "bytes": a small SentencePiece-style vocabulary (<unk>, <s>, </s>, the 256 byte tokens and a few
    letters/words), so any text tokenizes (through byte fallback);
  * "copy": the tokenizer.* metadata of another GGUF (by default the package's default model), so
    the random model tokenizes exactly like it (the embedding then has that vocabulary's size).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np

SHAPES = {
    # tiny models for exactness tests
    "tiny-llama": dict(arch="llama", n_layer=2, n_embd=128, n_head=8, n_head_kv=4, head_dim=32, n_ff=256),
    "tiny-qwen2": dict(arch="qwen2", n_layer=3, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=192),
    "tiny-qwen3": dict(arch="qwen3", n_layer=2, n_embd=128, n_head=8, n_head_kv=2, head_dim=64, n_ff=256),
    # gemma3: layers 0-4 sliding window, layer 5 global (pattern 6), and again for 6-11
    "tiny-gemma3": dict(arch="gemma3", n_layer=6, n_embd=128, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                        n_swa=64),
    # benchmark shapes
    "qwen3-0.6b": dict(arch="qwen3", n_layer=28, n_embd=1024, n_head=16, n_head_kv=8, head_dim=128, n_ff=3072,
                       vocab="copy", n_ctx_train=40960, rope_theta=1000000.0, weight_type="q8_0",
                       share_layer_weights=True),
    "qwen3-4b": dict(arch="qwen3", n_layer=36, n_embd=2560, n_head=32, n_head_kv=8, head_dim=128, n_ff=9728,
                     vocab="copy", n_ctx_train=262144, rope_theta=1000000.0, weight_type="q8_0",
                     share_layer_weights=True),
    "qwen3-8b": dict(arch="qwen3", n_layer=36, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=12288,
                     vocab="copy", n_ctx_train=262144, rope_theta=1000000.0, weight_type="q4_k_m",
                     share_layer_weights=True),
}

WEIGHT_TYPES = ("f32", "f16", "q8_0", "q4_k_m")

# q4_k_m as llama-quantize lays it out, simplified: Q6_K for the output projection, attn_v and
# ffn_down (llama.cpp gives those extra bits), Q4_K for every other matrix
_Q6_K_TAGS = ("out", "v", "down")


@dataclasses.dataclass(frozen=True)
class RandomModelSpec:
    arch: str = "llama"            # llama, qwen2, qwen3, gemma3
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 8
    n_head_kv: int = 4
    head_dim: int = 32
    n_ff: int = 256
    vocab: str = "bytes"           # "bytes" or "copy"
    vocab_source: str = ""         # GGUF whose tokenizer is copied ("" = the default model)
    n_ctx_train: int = 32768
    rope_theta: float = 10000.0
    n_swa: int = 0                 # gemma3: sliding window of the SWA layers
    weight_type: str = "f32"       # one of WEIGHT_TYPES (2-D weights; norms stay f32)
    scale: float = 1.0             # multiplies the std of q/k weights (peakier attention when > 1)
    seed: int = 0
    share_layer_weights: bool = False  # every layer gets the same weights (fast to write; fine for timing)

    def key(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def cache_dir() -> Path:
    base = Path(os.environ.get("SFI_GGUF_CACHE", Path.home() / ".cache" / "sfi-gguf"))
    return base / "random-models"


def _byte_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # unknown, control, control, byte
    extra = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u2581" + w for w in
             ("the", "a", "of", "and", "to", "in", "is", "it", "that", "cat", "dog", "sat", "on", "mat")]
    extra += ["\u2581", ".", ",", "!", "?"]
    tokens += extra
    types += [1] * len(extra)
    scores = [0.0] * 259 + [-float(i) for i in range(len(extra))]
    return tokens, scores, types


def _copy_tokenizer(writer, source: Path) -> int:
    """Copy every tokenizer.* key of `source` into `writer`; returns the vocabulary size."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(source))
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[-1]
            writer.add_key_value(name, value, vtype, sub_type=sub)
            if name == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        else:
            writer.add_key_value(name, value, vtype)
    if not n_vocab:
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return n_vocab


class _Weights:
    """Random tensors of the requested type (one generator; optionally one draw per shape)."""

    def __init__(self, spec: RandomModelSpec):
        import gguf

        self.gguf = gguf
        self.rng = np.random.default_rng(spec.seed)
        self.spec = spec
        self.cache: dict = {}

    def matrix(self, rows: int, cols: int, std: float, tag: str):
        """A [rows, cols] weight (numpy order; ggml ne = [cols, rows]) and its gguf raw type."""
        key = (rows, cols, round(std, 9), tag)
        if self.spec.share_layer_weights and key in self.cache:
            return self.cache[key]
        a = (self.rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std))
        wt = self.spec.weight_type
        if wt == "f32":
            out = (a, None)
        elif wt == "f16":
            out = (a.astype(np.float16), None)
        elif wt == "q8_0":
            q = self.gguf.quants.quantize(a, self.gguf.GGMLQuantizationType.Q8_0)
            out = (q, self.gguf.GGMLQuantizationType.Q8_0)
        elif wt == "q4_k_m":
            out = self.k_quant_blocks(rows, cols, std, "q6_k" if tag in _Q6_K_TAGS else "q4_k")
        else:
            raise ValueError(f"weight_type {wt!r}")
        if self.spec.share_layer_weights:
            self.cache[key] = out
        return out

    def k_quant_blocks(self, rows: int, cols: int, std: float, kind: str):
        """Random Q4_K / Q6_K blocks (gguf-py cannot quantize to K-quants): random quants and sub-block
        scales under a fixed super-block scale, so values are finite with roughly the wanted std."""
        T = self.gguf.GGMLQuantizationType
        qtype, size, scale_at, spread = ((T.Q4_K, 144, (0, 2), 200.0) if kind == "q4_k" else
                                         (T.Q6_K, 210, (208,), 1300.0))
        if cols % 256:
            raise ValueError(f"{kind} needs rows of a multiple of 256 values, got {cols}")
        blocks = self.rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
        d = np.frombuffer(np.float16(std / spread).tobytes(), np.uint8)
        for at in scale_at:  # Q4_K: d and dmin; Q6_K: d
            blocks[..., at:at + 2] = d
        return blocks.reshape(rows, -1), qtype

    def norm(self, n: int, value: float = 1.0, jitter: float = 0.1) -> np.ndarray:
        return (value + jitter * self.rng.standard_normal(n)).astype(np.float32)

    def vector(self, n: int, std: float) -> np.ndarray:
        return (std * self.rng.standard_normal(n)).astype(np.float32)


def write_random_gguf(path: Path, spec: RandomModelSpec) -> Path:
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), spec.arch)
    arch = spec.arch

    writer.add_name(f"random-{arch}-{spec.key()}")
    writer.add_block_count(spec.n_layer)
    writer.add_context_length(spec.n_ctx_train)
    writer.add_embedding_length(spec.n_embd)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M}[spec.weight_type])
    if arch == "llama":
        writer.add_rope_dimension_count(spec.head_dim)
    if arch == "gemma3":
        if spec.n_swa > 0:
            writer.add_sliding_window(spec.n_swa)
        writer.add_rope_freq_base_swa(10000.0)

    if spec.vocab == "copy":
        source = Path(spec.vocab_source) if spec.vocab_source else None
        if source is None:
            from ..models import ensure_model
            source = Path(ensure_model())
        n_vocab = _copy_tokenizer(writer, source)
    else:
        tokens, scores, types = _byte_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        n_vocab = len(tokens)
    writer.add_vocab_size(n_vocab)

    w = _Weights(spec)
    E, H, HKV, D, F = spec.n_embd, spec.n_head, spec.n_head_kv, spec.head_dim, spec.n_ff

    def add(name: str, value):
        if isinstance(value, tuple):
            data, raw = value
            if raw is None:
                writer.add_tensor(name, data)
            else:
                writer.add_tensor(name, data, raw_dtype=raw)
        else:
            writer.add_tensor(name, value)

    add("token_embd.weight", w.matrix(n_vocab, E, 1.0, "embd"))
    add("output_norm.weight", w.norm(E))
    if arch != "gemma3":
        add("output.weight", w.matrix(n_vocab, E, 1.0 / np.sqrt(E), "out"))

    qk_std = spec.scale / np.sqrt(E)
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", w.norm(E))
        add(p + "attn_q.weight", w.matrix(H * D, E, qk_std, "q"))
        add(p + "attn_k.weight", w.matrix(HKV * D, E, qk_std, "k"))
        add(p + "attn_v.weight", w.matrix(HKV * D, E, 1.0 / np.sqrt(E), "v"))
        add(p + "attn_output.weight", w.matrix(E, H * D, 1.0 / np.sqrt(H * D), "o"))
        if arch == "qwen2":
            add(p + "attn_q.bias", w.vector(H * D, 0.1))
            add(p + "attn_k.bias", w.vector(HKV * D, 0.1))
            add(p + "attn_v.bias", w.vector(HKV * D, 0.1))
        if arch in ("qwen3", "gemma3"):
            add(p + "attn_q_norm.weight", w.norm(D))
            add(p + "attn_k_norm.weight", w.norm(D))
        if arch == "gemma3":
            # gemma norms are stored as w - 1 ... llama.cpp's converter adds 1 back; keep them small
            add(p + "post_attention_norm.weight", w.norm(E, 0.5))
            add(p + "post_ffw_norm.weight", w.norm(E, 0.5))
        add(p + "ffn_norm.weight", w.norm(E))
        add(p + "ffn_gate.weight", w.matrix(F, E, 1.0 / np.sqrt(E), "gate"))
        add(p + "ffn_up.weight", w.matrix(F, E, 1.0 / np.sqrt(E), "up"))
        add(p + "ffn_down.weight", w.matrix(E, F, 1.0 / np.sqrt(F), "down"))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    return path


def random_model(name_or_spec: str | RandomModelSpec = "tiny-llama", **overrides) -> Path:
    """Path of a cached random GGUF, written on first use.

    `name_or_spec` is a key of SHAPES or a RandomModelSpec; keyword arguments override fields.
    """
    if isinstance(name_or_spec, RandomModelSpec):
        spec = dataclasses.replace(name_or_spec, **overrides)
        name = spec.arch
    else:
        if name_or_spec not in SHAPES:
            raise KeyError(f"unknown random model {name_or_spec!r}; known: {', '.join(SHAPES)}")
        spec = RandomModelSpec(**{**SHAPES[name_or_spec], **overrides})
        name = name_or_spec
    path = cache_dir() / f"{name}-{spec.key()}.gguf"
    if not path.exists():
        write_random_gguf(path, spec)
    return path


def write_vocab_only(path: Path, source: Path | None = None) -> Path:
    """A GGUF holding only another GGUF's tokenizer (a few MB): lets a machine without the default
    model write random models that tokenize like it (`vocab_source`)."""
    import gguf

    if source is None:
        from ..models import ensure_model
        source = Path(ensure_model())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    _copy_tokenizer(writer, Path(source))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="write a random-weight GGUF (cached) and print its path")
    ap.add_argument("name", nargs="?", default="tiny-llama", choices=sorted(SHAPES))
    ap.add_argument("--weight-type", default=None, choices=WEIGHT_TYPES)
    ap.add_argument("--vocab", default=None, choices=["bytes", "copy"])
    ap.add_argument("--vocab-source", default=None, help="GGUF whose tokenizer is copied (default: default model)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--write-vocab-only", metavar="OUT", default=None,
                    help="instead: write a tokenizer-only GGUF of --vocab-source (or the default model) to OUT")
    args = ap.parse_args(argv)
    if args.write_vocab_only:
        print(write_vocab_only(Path(args.write_vocab_only), args.vocab_source and Path(args.vocab_source)))
        return
    overrides = {k: v for k, v in (("weight_type", args.weight_type), ("vocab", args.vocab),
                                   ("vocab_source", args.vocab_source), ("seed", args.seed)) if v is not None}
    print(random_model(args.name, **overrides))


if __name__ == "__main__":
    _main()
