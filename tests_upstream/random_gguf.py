"""Random-weight GGUF models that stand in for hub models in llama-cpp-python's own tests.

llama-cpp-python 0.3.36's tests download small models from a hub, which this machine cannot reach.
Where a test only needs *some* model of an architecture (a recurrent one, a hybrid one, an embedding
one) and checks behaviour rather than the model's outputs, a model of the same architecture with
random weights exercises the same llama.cpp code: the same graph, memory type (KV cache, recurrent
state, or both) and state save/restore. The tokenizers are real ones: llama.cpp ships vocab-only
GGUFs in `vendor/llama.cpp/models/` of the sdist, and their `tokenizer.*` keys are copied over.

Tensor names and shapes follow `vendor/llama.cpp/src/models/<arch>.cpp` (load_arch_tensors) of the
vendored tree; numpy shapes are ggml's `ne` reversed. Weights are normal(0, 0.1), norms are ones,
SSM `A` is negative (a decaying state), as in llama.cpp's own tests/test-llama-archs.cpp.

Usage: python random_gguf.py SDIST_ROOT KIND OUT.gguf   (KIND: mamba, falcon-h1, bert)
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

SEED = 1234
STD = 0.1


def _gguf(sdist_root: Path):
    """The gguf-py of the vendored llama.cpp (its key names match that tree)."""
    sys.path.insert(0, str(sdist_root / "vendor" / "llama.cpp" / "gguf-py"))
    import gguf

    return gguf


class _Builder:
    def __init__(self, gguf, out: Path, arch: str, vocab_file: Path, name: str):
        self.gguf = gguf
        self.rng = np.random.default_rng(SEED)
        self.w = gguf.GGUFWriter(str(out), arch)
        self.w.add_name(name)
        self.w.add_file_type(gguf.LlamaFileType.ALL_F32)
        self.n_vocab = self._copy_tokenizer(vocab_file)

    def _copy_tokenizer(self, vocab_file: Path) -> int:
        reader = self.gguf.GGUFReader(str(vocab_file))
        vt = self.gguf.GGUFValueType
        n_vocab = 0
        for key, field in reader.fields.items():
            if not key.startswith("tokenizer."):
                continue
            value = field.contents()
            if field.types[0] == vt.ARRAY:
                self.w.add_key_value(key, value, vt.ARRAY, sub_type=field.types[-1])
            else:
                self.w.add_key_value(key, value, field.types[0])
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        assert n_vocab > 0, f"{vocab_file} has no tokenizer.ggml.tokens"
        return n_vocab

    def rand(self, name: str, *ne: int) -> None:
        """A random F32 tensor with ggml dims `ne` (innermost first)."""
        self.w.add_tensor(name, (self.rng.standard_normal(tuple(reversed(ne))) * STD).astype(np.float32))

    def const(self, name: str, value: float, *ne: int) -> None:
        self.w.add_tensor(name, np.full(tuple(reversed(ne)), value, dtype=np.float32))

    def neg(self, name: str, *ne: int) -> None:
        """SSM A: negative, so that the recurrent state decays."""
        a = -np.exp(self.rng.uniform(0.0, 2.0, tuple(reversed(ne))))
        self.w.add_tensor(name, a.astype(np.float32))

    def write(self) -> None:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


def make_mamba(gguf, vocab: Path, out: Path) -> None:
    """Mamba (v1), as QuantFactory/mamba-130m-hf-GGUF: a purely recurrent model (GPT-NeoX tokenizer)."""
    n_embd, n_layer, d_conv, d_state, dt_rank = 64, 2, 4, 16, 4
    d_inner = 2 * n_embd  # llama.cpp supports expansion factor 2 only
    b = _Builder(gguf, out, "mamba", vocab, "sfi-random-mamba")
    w = b.w
    w.add_context_length(1024)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(n_layer)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    b.rand("token_embd.weight", n_embd, b.n_vocab)
    b.const("output_norm.weight", 1.0, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.const(p + "attn_norm.weight", 1.0, n_embd)
        b.rand(p + "ssm_in.weight", n_embd, 2 * d_inner)
        b.rand(p + "ssm_conv1d.weight", d_conv, d_inner)
        b.rand(p + "ssm_conv1d.bias", d_inner)
        b.rand(p + "ssm_x.weight", d_inner, dt_rank + 2 * d_state)
        b.rand(p + "ssm_dt.weight", dt_rank, d_inner)
        b.rand(p + "ssm_dt.bias", d_inner)
        b.neg(p + "ssm_a", d_state, d_inner)
        b.const(p + "ssm_d", 1.0, d_inner)
        b.rand(p + "ssm_out.weight", d_inner, n_embd)
    b.write()


def make_falcon_h1(gguf, vocab: Path, out: Path) -> None:
    """Falcon-H1, as tiiuae/Falcon-H1-Tiny-90M-Instruct-GGUF: hybrid (attention + Mamba-2 in each layer)."""
    n_embd, n_layer, n_head, n_head_kv, n_ff = 64, 2, 4, 2, 128
    head_dim = n_embd // n_head
    d_conv, d_inner, d_state, n_group, ssm_heads = 4, 128, 16, 1, 4
    conv_dim = d_inner + 2 * n_group * d_state
    b = _Builder(gguf, out, "falcon-h1", vocab, "sfi-random-falcon-h1")
    w = b.w
    w.add_context_length(1024)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_block_count(n_layer)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(ssm_heads)
    w.add_ssm_group_count(n_group)
    b.rand("token_embd.weight", n_embd, b.n_vocab)
    b.const("output_norm.weight", 1.0, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.rand(p + "ssm_in.weight", n_embd, d_inner + conv_dim + ssm_heads)
        b.rand(p + "ssm_conv1d.weight", d_conv, conv_dim)
        b.rand(p + "ssm_conv1d.bias", conv_dim)
        b.rand(p + "ssm_dt.bias", ssm_heads)
        b.neg(p + "ssm_a", 1, ssm_heads)
        b.const(p + "ssm_d", 1.0, 1, ssm_heads)
        b.const(p + "ssm_norm.weight", 1.0, d_inner // n_group, n_group)
        b.rand(p + "ssm_out.weight", d_inner, n_embd)
        b.rand(p + "attn_q.weight", n_embd, head_dim * n_head)
        b.rand(p + "attn_k.weight", n_embd, head_dim * n_head_kv)
        b.rand(p + "attn_v.weight", n_embd, head_dim * n_head_kv)
        b.rand(p + "attn_output.weight", head_dim * n_head, n_embd)
        b.const(p + "attn_norm.weight", 1.0, n_embd)
        b.const(p + "ffn_norm", 1.0, n_embd)  # loaded as tn(LLM_TENSOR_FFN_NORM, i): no ".weight"
        b.rand(p + "ffn_gate.weight", n_embd, n_ff)
        b.rand(p + "ffn_down.weight", n_ff, n_embd)
        b.rand(p + "ffn_up.weight", n_embd, n_ff)
    b.write()


def make_bert(gguf, vocab: Path, out: Path) -> None:
    """BERT, as CompendiumLabs/bge-small-en-v1.5-gguf: an embedding model (the real BGE tokenizer)."""
    n_embd, n_layer, n_head, n_ff, n_ctx = 64, 2, 4, 128, 512
    b = _Builder(gguf, out, "bert", vocab, "sfi-random-bert")
    w = b.w
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_block_count(n_layer)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.CLS)  # bge-small-en-v1.5 pools the [CLS] token
    n_types = 2
    b.rand("token_embd.weight", n_embd, b.n_vocab)
    b.rand("token_types.weight", n_embd, n_types)
    b.rand("position_embd.weight", n_embd, n_ctx)
    b.const("token_embd_norm.weight", 1.0, n_embd)
    b.const("token_embd_norm.bias", 0.0, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        for t in ("attn_q", "attn_k", "attn_v"):
            b.rand(p + t + ".weight", n_embd, n_embd)
            b.rand(p + t + ".bias", n_embd)
        b.rand(p + "attn_output.weight", n_embd, n_embd)
        b.rand(p + "attn_output.bias", n_embd)
        b.const(p + "attn_output_norm.weight", 1.0, n_embd)
        b.const(p + "attn_output_norm.bias", 0.0, n_embd)
        b.rand(p + "ffn_up.weight", n_embd, n_ff)
        b.rand(p + "ffn_up.bias", n_ff)
        b.rand(p + "ffn_down.weight", n_ff, n_embd)
        b.rand(p + "ffn_down.bias", n_embd)
        b.const(p + "layer_output_norm.weight", 1.0, n_embd)
        b.const(p + "layer_output_norm.bias", 0.0, n_embd)
    b.write()


# kind -> (builder, vocab-only GGUF shipped in the sdist whose tokenizer is used)
KINDS = {
    "mamba": (make_mamba, "ggml-vocab-gpt-neox.gguf"),  # mamba-130m-hf uses the GPT-NeoX-20B tokenizer
    "falcon-h1": (make_falcon_h1, "ggml-vocab-falcon.gguf"),  # Falcon-H1's own tokenizer is not shipped
    "bert": (make_bert, "ggml-vocab-bert-bge.gguf"),  # the BGE tokenizer itself
}


def make(kind: str, sdist_root: Path, out: Path) -> Path:
    builder, vocab_name = KINDS[kind]
    gguf = _gguf(sdist_root)
    vocab = sdist_root / "vendor" / "llama.cpp" / "models" / vocab_name
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    builder(gguf, vocab, tmp)
    tmp.replace(out)
    return out


if __name__ == "__main__":
    make(sys.argv[2], Path(sys.argv[1]), Path(sys.argv[3]))
