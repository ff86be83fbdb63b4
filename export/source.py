"""Source models: resolve a local folder or hub id, check the pair up front, then load.

Checks that need only configs and tokenizers (missing path, unsupported family, vocab and
special-token mismatch, max-seq-len beyond the model's positions) run before any weights load.
Weights load from safetensors only; remote code only when the user asks for it.

A ``.gguf`` file (llama.cpp's format) loads through transformers' GGUF loader, dequantized to
float32. Its header is read first (export/gguf_file.py): an architecture or quantization type the
loader cannot turn into an exportable checkpoint is refused before anything else loads.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import ModelError
from specdec.export import draft_spec
from specdec.export.families import Family, family_of


@dataclass(frozen=True)
class Source:
    """A resolved, checked source model (config and tokenizer only; no weights yet)."""

    name: str
    revision: str | None
    trust_remote_code: bool
    config: Any
    family: Family
    tokenizer: Any | None  # a transformers tokenizer, or None when the source has none
    gguf: Path | None = None  # a llama.cpp GGUF file the weights dequantize from
    gguf_types: tuple[str, ...] = ()  # its tensor types (GGML names: "Q4_1", "Q8_0", ...)

    @property
    def location(self) -> str:
        return _location(self.name)

    @property
    def commit(self) -> str | None:
        return getattr(self.config, "_commit_hash", None) or self.revision

    def eos_ids(self) -> tuple[int, ...]:
        """The config's EOS ids inside the vocabulary. One outside it (a GPT-2-shaped config's
        50256 over a trimmed vocabulary) can never be emitted: it is dropped with a warning, as
        transformers itself only warns."""
        eos = getattr(self.config, "eos_token_id", None)
        ids = () if eos is None else tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        vocab = self.config.vocab_size
        outside = [e for e in ids if not 0 <= e < vocab]
        if outside:
            warnings.warn(f"eos_token_id {outside}: outside the vocabulary [0, {vocab}); the model can never emit it, so the bundle "
                          "records no such EOS (set eos_token_id in the config to a token of the vocabulary)", stacklevel=2)
        return tuple(e for e in ids if 0 <= e < vocab)


def _location(src: str) -> str:
    """What transformers loads from: the folder when it exists, else the hub id."""
    path = Path(src).expanduser()
    return str(path) if path.is_dir() else src


def _looks_local(src: str) -> bool:
    return src.startswith((".", "/", "~")) or Path(src).exists() or src.count("/") > 1


def resolve(src: str, max_seq_len: int | None, revision: str | None = None, trust_remote_code: bool = False) -> Source:
    """Config and tokenizer of ``src`` (a checkpoint folder or a hub id), checked for export."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(src).expanduser()
    if path.suffix.lower() == ".gguf":
        return _resolve_gguf(src, path, max_seq_len)
    if _looks_local(src) and not path.is_dir():
        raise ModelError(f"model path {src!r} does not exist; pass a Hugging Face checkpoint folder or a hub id")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelError(f"{src!r} has no config.json; pass a Hugging Face checkpoint folder (save_pretrained output)")
    where = _location(src)
    try:
        config = AutoConfig.from_pretrained(where, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot read the config of {src!r} ({first}); check the id/folder and your network") from None
    family = _checked_family(config, src, max_seq_len)
    tokenizer = None  # a checkpoint without tokenizer files: the bundle then takes token ids only
    if not path.is_dir() or any((path / f).is_file() for f in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, revision=revision, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, TypeError, AttributeError):  # transformers fails in all of these ways
            tokenizer = None
    return Source(src, revision, trust_remote_code, config, family, tokenizer)


def _checked_family(config: Any, src: str, max_seq_len: int | None) -> Family:
    family = family_of(config, src)
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and max_seq_len is not None and max_seq_len > positions:
        raise ModelError(
            f"--max-seq-len {max_seq_len} exceeds {src}'s max_position_embeddings={positions}; pass --max-seq-len {positions} or less"
        )
    return family


def _resolve_gguf(src: str, path: Path, max_seq_len: int | None) -> Source:
    """Config and tokenizer of a GGUF file, after its header passed ``gguf_file.check_header``."""
    from transformers import AutoConfig, AutoTokenizer

    from specdec.export.gguf_file import check_header

    if not path.is_file():
        raise ModelError(f"GGUF file {src!r} does not exist; pass the path of a .gguf file")
    _, types = check_header(path)
    folder, name = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot read the config of GGUF file {src!r} ({first})") from None
    family = _checked_family(config, src, max_seq_len)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, TypeError, AttributeError, KeyError):  # no tokenizer metadata in the file
        tokenizer = None
    return Source(src, None, False, config, family, tokenizer, gguf=path, gguf_types=types)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def check_pair(target: Source, draft: Source) -> None:
    """Refuse a draft whose vocabulary or special tokens differ from the target's."""
    t, d = target.config, draft.config
    if target.family.seq2seq != draft.family.seq2seq:
        kinds = {True: "an encoder-decoder", False: "a decoder-only"}
        raise ModelError(
            f"target {target.name} is {kinds[target.family.seq2seq]} model ({t.model_type}) but draft {draft.name} is "
            f"{kinds[draft.family.seq2seq]} one ({d.model_type}); pass a draft of the same kind"
        )
    if target.family.seq2seq and getattr(t, "decoder_start_token_id", None) != getattr(d, "decoder_start_token_id", None):
        raise ModelError(
            f"special-token mismatch: target decoder_start_token_id={t.decoder_start_token_id}, draft "
            f"decoder_start_token_id={d.decoder_start_token_id}; the draft's decoder must start where the target's does"
        )
    shared = draft_spec.spec_of(d)
    if shared is not None:
        if target.family.seq2seq or d.model_type != t.model_type:
            raise ModelError(f"shared draft {draft.name} ({d.model_type}) needs a decoder-only {d.model_type} target; {target.name} is {t.model_type}")
        draft_spec.check_target(Path(draft.location), shared, target.tokenizer)
    if t.vocab_size != d.vocab_size:
        raise ModelError(
            f"vocab mismatch: target {target.name} has vocab_size={t.vocab_size}, draft {draft.name} has {d.vocab_size}; "
            "the draft must share the target's tokenizer"
        )
    if (bos := getattr(t, "bos_token_id", None)) != (draft_bos := getattr(d, "bos_token_id", None)):
        raise ModelError(
            f"special-token mismatch: target bos_token_id={bos}, draft bos_token_id={draft_bos}; "
            "the draft must share the target's tokenizer"
        )
    if set(target.eos_ids()) != set(draft.eos_ids()):
        raise ModelError(
            f"special-token mismatch: target eos_token_id={list(target.eos_ids())}, draft eos_token_id={list(draft.eos_ids())}; "
            "the draft must share the target's tokenizer"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise ModelError(
                f"tokenizer mismatch: {target.name} and {draft.name} map tokens to different ids; "
                "the draft must share the target's tokenizer"
            )


def load_model(src: Source, target: Any = None) -> Any:
    """The source's torch model in float32, eval mode, from safetensors weights (or a GGUF file).
    A shared draft (export/shared_draft.py) is assembled from ``target``, the loaded target model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from specdec.export import shared_draft

    if shared_draft.spec_of(src.config) is not None:
        if target is None:
            raise ModelError(f"{src.name} is a shared draft (it borrows its target's vocabulary matrices); pass it as --draft")
        return shared_draft.load(Path(src.location), src.config, target)

    auto = AutoModelForSeq2SeqLM if src.family.seq2seq else AutoModelForCausalLM
    if src.gguf is not None:
        from specdec.export.gguf_file import load_gguf_model

        model = load_gguf_model(auto, src.gguf)
        src.family.adapt(model)
        return model.eval()
    try:
        model = auto.from_pretrained(
            src.location,
            revision=src.revision,
            trust_remote_code=src.trust_remote_code,
            use_safetensors=True,
            dtype=torch.float32,
            attn_implementation=REFERENCE_ATTENTION,
        )
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0]
        raise ModelError(f"cannot load weights of {src.name!r} ({first}); specdec loads safetensors weights only") from None
    src.family.adapt(model)
    return model.eval()


# The attention validation compares against: transformers' eager path is every family's own
# math (its sdpa path drops Gemma 2's score soft-capping without a word, in 4.57)
REFERENCE_ATTENTION = "eager"


def parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
