#!/usr/bin/env python3
"""A Hugging Face checkpoint to GGUF with llama.cpp's own ``convert_hf_to_gguf.py``, for the
``llamacpp`` peer of ``tools/bench_peers.py``; runs under the llama.cpp venv's python::

    llamacpp_convert.py LLAMA_CPP_DIR MODEL_DIR OUTFILE {f32,q8_0,q4_0}

q4_0 is not an outtype of the converter: the checkpoint is converted at f32 into a temporary
file and quantized with the library's own ``llama_model_quantize`` (what ``llama-quantize``
runs), so every width comes from the same llama.cpp.

``LLAMA_CPP_DIR`` is the llama.cpp source tree (``vendor/llama.cpp`` of the llama-cpp-python
sdist, the version the binding was built from). The converter is run unchanged, with one
fallback: it names a BPE tokenizer's pre-tokenizer by hashing how it splits a fixed text, and
refuses a tokenizer trained here (the demo pair's) whose hash it has never seen. Such a
tokenizer whose ``tokenizer.json`` pre-tokenizer is plain byte-level BPE with the GPT-2 split
regex is what llama.cpp calls ``"gpt-2"``, so that name is written; any other unknown
tokenizer is still refused. The benchmark feeds token ids, so the GGUF tokenizer only has to
load (and to detokenize).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def is_gpt2_byte_level(model_dir: Path) -> bool:
    """``tokenizer.json`` is a BPE model whose only pre-tokenizer is ByteLevel with the regex split."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    tok = json.loads(path.read_text(encoding="utf-8"))
    pre = tok.get("pre_tokenizer") or {}
    norm = tok.get("normalizer") or {}
    no_normalizer = not norm or (norm.get("type") == "Sequence" and not norm.get("normalizers"))  # an empty Sequence does nothing
    return (tok.get("model", {}).get("type") == "BPE" and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True) and no_normalizer)


def with_gpt2_fallback(original, model_dir: Path):
    """``TextModel.get_vocab_base_pre`` that answers "gpt-2" where the original gives up and the
    tokenizer is plain byte-level BPE (see the module docstring)."""

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not is_gpt2_byte_level(model_dir):
                raise
            print(f"[llamacpp_convert] {model_dir}: unknown BPE pre-tokenizer hash; tokenizer.json is byte-level "
                  "BPE with the GPT-2 regex, so tokenizer.ggml.pre = 'gpt-2'", file=sys.stderr)
            return "gpt-2"

    return get_vocab_base_pre


def quantize(src: Path, dst: Path, ftype_name: str) -> None:
    """``src`` (a GGUF file) quantized to ``dst`` by libllama's ``llama_model_quantize``."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        sys.exit(f"llama_model_quantize {src} -> {dst} ({ftype_name}) failed")


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[3] not in ("f32", "q8_0", "q4_0"):
        sys.exit(__doc__)
    llama_cpp, model_dir, outfile, outtype = Path(argv[0]), Path(argv[1]), Path(argv[2]), argv[3]
    if outtype == "q4_0":
        f32 = outfile.with_name(outfile.name + ".f32.tmp")
        code = main([str(llama_cpp), str(model_dir), str(f32), "f32"])
        quantize(f32, outfile, "LLAMA_FTYPE_MOSTLY_Q4_0")
        f32.unlink()
        return code
    script = llama_cpp / "convert_hf_to_gguf.py"
    if not script.is_file():
        sys.exit(f"{llama_cpp} has no convert_hf_to_gguf.py: expected llama.cpp's source tree")
    sys.path[:0] = [str(llama_cpp / "gguf-py"), str(llama_cpp)]  # the converter's own gguf, not PyPI's
    import conversion.base
    import convert_hf_to_gguf

    text_model = conversion.base.TextModel
    text_model.get_vocab_base_pre = with_gpt2_fallback(text_model.get_vocab_base_pre, model_dir)
    sys.argv = [str(script), str(model_dir), "--outfile", str(outfile), "--outtype", outtype]
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
