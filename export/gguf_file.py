"""GGUF files (llama.cpp's format) as export sources, through transformers' GGUF loader.

transformers reads a GGUF file's metadata into a config and a tokenizer, and dequantizes its
tensors into a float32 checkpoint (gguf-py's NumPy dequantizers; llama.cpp's permuted q/k rows
undone). What it cannot load would fail late and vaguely (a KeyError deep in the loader, or a
NotImplementedError after the tokenizer took seconds), so the header is checked first and
either refusal names the value and what is supported.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from specdec.errors import ModelError

# GGUF ``general.architecture`` -> the transformers model type it loads as: the families specdec
# exports (export/families.py) that transformers' GGUF loader also reads. (llama.cpp writes
# Mistral checkpoints as "llama", and gguf-py has no "mistral" tensor map for the loader to use;
# Phi-3 files carry no LongRoPE factors the loader reads, so they load as the short-context variant.)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text",
                 "phi3": "phi3"}  # fmt: skip

# Tensor types gguf-py dequantizes in NumPy, as llama.cpp's usual file types use them.
QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _reader(path: Path) -> Any:
    try:
        import gguf
    except ImportError:
        raise ModelError(f"{path.name}: reading GGUF files needs the gguf and accelerate packages; pip install -e \".[export]\"") from None
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:  # bad magic, truncated file
        raise ModelError(f"{path}: not a readable GGUF file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def check_header(path: Path) -> tuple[str, tuple[str, ...]]:
    """The file's architecture and tensor types, or a ModelError naming what is not supported."""
    reader = _reader(path)
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in ARCHITECTURES:
        raise ModelError(f"{path.name}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    types = tuple(sorted({t.tensor_type.name for t in reader.tensors}))
    bad = [t for t in types if t not in QUANT_TYPES]
    if bad:
        names = sorted({t.name for t in reader.tensors if t.tensor_type.name in bad})
        raise ModelError(
            f"{path.name}: GGUF tensor type {', '.join(bad)} (e.g. {names[0]}) cannot be dequantized; "
            f"supported: {', '.join(QUANT_TYPES)}; convert the file with llama.cpp's llama-quantize to one of them"
        )
    return arch, types


def load_gguf_model(auto: Any, path: Path) -> Any:
    """The GGUF file's model, dequantized to float32 (``auto``: a transformers Auto class)."""
    import torch

    from specdec.export.source import REFERENCE_ATTENTION

    try:
        with _no_conversion_bar():
            model = auto.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation=REFERENCE_ATTENTION)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot load the weights of GGUF file {path.name} ({first})") from None
    # transformers 5 marks the model as GGUF-quantized, though its weights are float32 by now,
    # and then refuses to save_pretrained it (bench-peers saves the checkpoint every peer reads)
    model.hf_quantizer = None
    model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    return model


@contextlib.contextmanager
def _no_conversion_bar():
    """transformers 5.x draws the loader's "Converting and de-quantizing" bar with tqdm itself,
    past the progress-bar switch export/logs.py turns off (4.57's went through it): off here too,
    so the export's screen keeps its one line per phase."""
    import functools
    import importlib

    module = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    bar = getattr(module, "tqdm", None)
    if bar is None:
        yield
        return
    module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        module.tqdm = bar


@contextlib.contextmanager
def one_parse():
    """Within the block, each GGUF file is parsed once. transformers parses a file anew for its
    config, its tokenizer and its weights, and the header check is a fourth parse; each reads
    every metadata field into NumPy (SmolLM2-135M: a 49152-token vocabulary and its 48900 merges,
    seconds apiece on this CPU). The readers are memory maps: sharing one is safe."""
    try:
        import gguf
    except ImportError:
        yield
        return
    original, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(Path(path).resolve()), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader  # transformers imports it from the module at each call
    try:
        yield
    finally:
        gguf.GGUFReader = original
