"""Deterministic tiny llama-architecture GGUF models with random weights, made on the spot.

No model is ever downloaded: tests and the demo write one with `gguf` + `numpy` in well under a second.
The file is byte-identical on every run for the same arguments (seeded weights, fixed metadata).

* SentencePiece-style vocabulary with byte fallback and a ChatML chat template in the metadata.
* The output rows of control and byte tokens are zero, so greedy decoding always emits readable words and
  runs to `max_tokens` (it never emits `<|im_end|>`), which makes token counts predictable.
* `f16=True` stores the 2-D weights as F16 (norms stay F32): ftllm needs this, it dies with SIGFPE on F32.

Sizes:
  tiny  embd 64, 2 layers, ff 128          ~0.3 MB F16; loads in milliseconds.
  24m   embd 512, 6 layers, ff 2048        ~24M parameters, ~48 MB F16; a few hundred tokens/s on CPU.

Script use (also by the demo): python -m tests.support.tiny_model OUT.gguf [--size tiny|24m] [--f16]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS_TEXT = (
    "the of and to in is it you that he was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most people "
    "my over know water than call first who may down side been now find hello world llama server "
    "token health model ready ok test bench fast speed draft flash"
)
WORDS = tuple(_WORDS_TEXT.split())

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;\n"


@dataclass(frozen=True)
class Shape:
    embd: int
    layers: int
    heads: int
    kv_heads: int
    ff: int
    ctx: int = 2048


SIZES: dict[str, Shape] = {
    "tiny": Shape(embd=64, layers=2, heads=4, kv_heads=2, ff=128),
    "24m": Shape(embd=512, layers=6, heads=8, kv_heads=4, ff=2048),
}


def build_vocab() -> tuple[list[str], list[float], list[int]]:
    """The token list, scores and types: control tokens, 256 byte tokens, characters, then whole words."""
    import gguf

    tt = gguf.TokenType
    toks: list[str] = []
    scores: list[float] = []
    types: list[int] = []

    def add(tok: str, score: float, kind: int) -> None:
        toks.append(tok)
        scores.append(float(score))
        types.append(int(kind))

    add("<unk>", 0, tt.UNKNOWN)
    add("<s>", 0, tt.CONTROL)
    add("</s>", 0, tt.CONTROL)
    add("<|im_start|>", 0, tt.CONTROL)
    add("<|im_end|>", 0, tt.CONTROL)
    for b in range(256):
        add(f"<0x{b:02X}>", 0, tt.BYTE)
    add("\u2581", -1, tt.NORMAL)  # SentencePiece word boundary
    for c in CHARS:
        add(c, -2, tt.NORMAL)
    seen = set(toks)
    for word in WORDS:
        for tok in ("\u2581" + word, word):
            if tok not in seen:
                seen.add(tok)
                add(tok, len(tok), tt.NORMAL)  # longer pieces win the SentencePiece merge
    return toks, scores, types


def param_count(size: str = "tiny") -> int:
    """Number of parameters of the model `write_model(size=size)` writes."""
    s = SIZES[size]
    n_vocab = len(build_vocab()[0])
    hd = s.embd // s.heads
    per_layer = (2 * s.embd  # two norms
                 + s.heads * hd * s.embd * 2  # q and output
                 + s.kv_heads * hd * s.embd * 2  # k and v
                 + 3 * s.ff * s.embd)
    return 2 * n_vocab * s.embd + s.embd + s.layers * per_layer


def write_model(out: str | os.PathLike[str], *, size: str = "tiny", f16: bool = True, seed: int = 0,
                name: str = "tiny-random-llama") -> Path:
    """Write the model to `out` (via a temp file renamed into place) and return its path."""
    import gguf
    import numpy as np

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    s = SIZES[size]
    toks, scores, types = build_vocab()
    n_vocab, hd = len(toks), s.embd // s.heads
    rng = np.random.default_rng(seed)
    wdt = np.float16 if f16 else np.float32

    def rand(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(wdt)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        w = gguf.GGUFWriter(str(tmp), "llama")
        w.add_name(name)
        w.add_context_length(s.ctx)
        w.add_embedding_length(s.embd)
        w.add_block_count(s.layers)
        w.add_feed_forward_length(s.ff)
        w.add_head_count(s.heads)
        w.add_head_count_kv(s.kv_heads)
        w.add_rope_dimension_count(hd)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(n_vocab)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)

        w.add_tokenizer_model("llama")
        w.add_token_list(toks)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(4)  # <|im_end|>
        w.add_add_bos_token(False)
        w.add_add_eos_token(False)
        w.add_chat_template(CHATML)

        w.add_tensor("token_embd.weight", rand(n_vocab, s.embd, scale=1.0))
        w.add_tensor("output_norm.weight", np.ones(s.embd, dtype=np.float32))
        output = rand(n_vocab, s.embd, scale=1.0)
        normal = np.array([t == gguf.TokenType.NORMAL for t in types])
        output[~normal] = 0.0  # control/byte tokens never win the argmax
        w.add_tensor("output.weight", output)
        attn_scale = 1.6 / s.embd**0.5  # 0.2 for the tiny shape; keeps activations in F16 range
        for i in range(s.layers):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", np.ones(s.embd, dtype=np.float32))
            w.add_tensor(p + "attn_q.weight", rand(s.heads * hd, s.embd, scale=attn_scale))
            w.add_tensor(p + "attn_k.weight", rand(s.kv_heads * hd, s.embd, scale=attn_scale))
            w.add_tensor(p + "attn_v.weight", rand(s.kv_heads * hd, s.embd, scale=attn_scale))
            w.add_tensor(p + "attn_output.weight", rand(s.embd, s.heads * hd, scale=attn_scale))
            w.add_tensor(p + "ffn_norm.weight", np.ones(s.embd, dtype=np.float32))
            w.add_tensor(p + "ffn_gate.weight", rand(s.ff, s.embd, scale=attn_scale))
            w.add_tensor(p + "ffn_up.weight", rand(s.ff, s.embd, scale=attn_scale))
            w.add_tensor(p + "ffn_down.weight", rand(s.embd, s.ff, scale=attn_scale))

        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def write_unsupported_model(out: str | os.PathLike[str], *, arch: str = "bogusarch") -> Path:
    """Write a valid GGUF of an architecture no server knows (ftllm then exits with status 0)."""
    import gguf
    import numpy as np

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        w = gguf.GGUFWriter(str(tmp), arch)
        w.add_name(f"unsupported-{arch}")
        w.add_tensor("a.weight", np.ones((4, 4), dtype=np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.tiny_model",
                                 description="Write a deterministic tiny random-weight llama GGUF.")
    ap.add_argument("out", help="where to write the .gguf file")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--f16", action="store_true", help="F16 weights (needed by ftllm)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="tiny-random-llama")
    a = ap.parse_args(argv)
    path = write_model(a.out, size=a.size, f16=a.f16, seed=a.seed, name=a.name)
    print(f"wrote {path}: size={a.size} {'F16' if a.f16 else 'F32'} "
          f"params={param_count(a.size)} bytes={path.stat().st_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
