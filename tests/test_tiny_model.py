"""The tiny GGUF writer: deterministic, F16/F32, the 24M variant, and metadata the servers rely on."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import gguf

from tests.support.tiny_model import CHATML, param_count, write_model, write_unsupported_model


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_is_byte_identical_across_runs(tmp_path: Path) -> None:
    """Two writes with the same arguments give the same bytes; another seed gives other bytes."""
    a = write_model(tmp_path / "a.gguf", f16=True)
    b = write_model(tmp_path / "b.gguf", f16=True)
    c = write_model(tmp_path / "c.gguf", f16=True, seed=1)
    assert sha(a) == sha(b) != sha(c)
    assert not list(tmp_path.glob("*.tmp*"))  # written via a temp file renamed into place


def test_f16_and_metadata(tmp_path: Path) -> None:
    """The F16 file is about half the F32 one and carries llama arch, ChatML template and EOS <|im_end|>."""
    f16 = write_model(tmp_path / "f16.gguf", f16=True)
    f32 = write_model(tmp_path / "f32.gguf", f16=False)
    assert f16.stat().st_size < 0.6 * f32.stat().st_size
    r = gguf.GGUFReader(str(f16))
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "llama"
    assert bytes(r.fields["tokenizer.chat_template"].parts[-1]).decode() == CHATML
    tokens = r.fields["tokenizer.ggml.tokens"]
    eos = int(r.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    assert bytes(tokens.parts[tokens.data[eos]]).decode() == "<|im_end|>"
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["token_embd.weight"] == "F16" and types["output_norm.weight"] == "F32"


def test_24m_variant_parameter_count(tmp_path: Path) -> None:
    """The 24m size has about 24 million parameters (~48 MB in F16), matching the tensors written."""
    n = param_count("24m")
    assert 23_000_000 < n < 25_000_000
    path = write_model(tmp_path / "m.gguf", size="24m", f16=True)
    r = gguf.GGUFReader(str(path))
    assert sum(int(t.n_elements) for t in r.tensors) == n
    assert 45e6 < path.stat().st_size < 52e6


def test_unsupported_model_has_foreign_arch(tmp_path: Path) -> None:
    """The unsupported-architecture file is valid GGUF whose architecture no server knows."""
    r = gguf.GGUFReader(str(write_unsupported_model(tmp_path / "u.gguf")))
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "bogusarch"


def test_script_entry_point(tmp_path: Path) -> None:
    """`python -m tests.support.tiny_model OUT --f16` writes the same file as the function."""
    out = tmp_path / "cli.gguf"
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "tests.support.tiny_model", str(out), "--f16"], cwd=root,
                         capture_output=True, text=True, check=True)
    assert "wrote" in res.stdout
    assert sha(out) == sha(write_model(tmp_path / "fn.gguf", f16=True))
