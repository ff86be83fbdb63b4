"""specdec-export: HF target + draft -> a validated, self-describing bundle.

Order matters for the user: everything that can be refused from configs, tokenizers and
flags is refused before any weights load; graphs are written to a staging folder; the bundle
appears at ``out`` only after validation passed.
"""

from __future__ import annotations

import copy
import importlib.metadata as md
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specdec.errors import ConfigError, EngineError
from specdec.export.bundle import check_destination, commit, staging
from specdec.export.source import Source, check_pair, load_model, parameter_count, resolve
from specdec.manifest import GraphSpec, Manifest, ModelSpec, sha256_of

DTYPES = ("float32", "float16")
DEFAULT_MAX_SEQ = 2048
QUANTIZATIONS = (None, "int8")
MAX_GAMMA = 15


@dataclass(frozen=True)
class ExportConfig:
    """One export, as the CLI's options give it."""

    target: str
    draft: str
    out: Path
    gamma: int = 4
    max_seq_len: int | None = None  # None: 2048, or less if a model has fewer positions
    dtype: str = "float32"
    quantize: str | None = None
    trt: bool = False
    overwrite: bool = False
    target_revision: str | None = None
    draft_revision: str | None = None
    trust_remote_code: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        if not isinstance(self.gamma, int) or not 1 <= self.gamma <= MAX_GAMMA:
            raise ConfigError(f"--gamma {self.gamma}: expected an integer in 1..{MAX_GAMMA} (draft tokens per target call)")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < self.gamma + 2):
            raise ConfigError(f"--max-seq-len {self.max_seq_len}: expected an integer >= {self.gamma + 2} (gamma + 2)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype}: expected one of {', '.join(DTYPES)}")
        if self.quantize not in QUANTIZATIONS:
            raise ConfigError(f"--quantize {self.quantize}: expected int8 or nothing")
        if self.quantize and self.dtype != "float32":
            raise ConfigError(f"--quantize {self.quantize} needs --dtype float32 (dynamic int8 quantizes float32 weights)")


@dataclass
class Progress:
    """Named steps reported to a callback (the CLI draws a tqdm bar; library use passes None)."""

    report: Callable[[str], None] | None = None
    done: list[str] = field(default_factory=list)

    def __call__(self, step: str) -> None:
        self.done.append(step)
        if self.report:
            self.report(step)


def _model_spec(src: Source, model) -> ModelSpec:
    cfg = src.config
    return ModelSpec(
        source=src.name,
        revision=src.commit,
        family=src.family.name,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=src.family.kv_heads(cfg),
        head_dim=src.family.head_dim(cfg),
        hidden_size=cfg.hidden_size,
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 0) or 0,
        parameters=parameter_count(model),
    )


def default_max_seq(sources) -> int:
    """2048 rows, or fewer when a model has fewer positions (or a smaller sliding window)."""
    limits = [DEFAULT_MAX_SEQ]
    for src in sources:
        limits += [getattr(src.config, "max_position_embeddings", None) or DEFAULT_MAX_SEQ]
        limits += [src.family.window(src.config) or DEFAULT_MAX_SEQ]
    return min(limits)


def _check_trt() -> None:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise EngineError("--trt needs TensorRT: pip install 'specdec[trt]' on a machine with an NVIDIA GPU, or drop --trt") from None
    raise EngineError("--trt: building TensorRT engines is not implemented in this release yet; drop --trt (CPU and CUDA use ONNX Runtime)")


def _tools() -> dict[str, str]:
    out = {}
    for pkg in ("specdec", "torch", "transformers", "onnx", "onnxscript", "onnxruntime"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


GRAPHS = (  # name, model, role, tokens per call (None: dynamic; "K": gamma + 1)
    ("target_prefill", "target", "prefill", None),
    ("target_verify", "target", "verify", "K"),
    ("draft_prefill", "draft", "prefill", None),
    ("draft_step", "draft", "step", 1),
)


def export_bundle(cfg: ExportConfig, progress: Progress | None = None) -> Manifest:
    """Export, validate and write the bundle at ``cfg.out``; returns its manifest."""
    from specdec.export.graphs import TORCH_DTYPES, export_decoder
    from specdec.export.optimize import optimize_for_cpu
    from specdec.export.quantize import external_files, quantize_int8
    from specdec.export.validate import TOLERANCES, check, validate_model

    progress = progress or Progress()
    check_destination(cfg.out, cfg.overwrite)
    if cfg.trt:
        _check_trt()
    progress("read configs")
    sources = {
        "target": resolve(cfg.target, cfg.max_seq_len, cfg.target_revision, cfg.trust_remote_code),
        "draft": resolve(cfg.draft, cfg.max_seq_len, cfg.draft_revision, cfg.trust_remote_code),
    }
    check_pair(sources["target"], sources["draft"])
    max_seq = cfg.max_seq_len or default_max_seq(sources.values())

    progress("load weights")
    models = {role: load_model(src) for role, src in sources.items()}
    specs = {role: _model_spec(sources[role], models[role]) for role in models}

    # Graphs are traced from a copy in the bundle's dtype; validation compares them with the
    # float32 source, so the recorded figures are the deviation from the model the user gave.
    exported = {role: m if cfg.dtype == "float32" else copy.deepcopy(m).to(TORCH_DTYPES[cfg.dtype]) for role, m in models.items()}
    with staging(cfg.out) as tmp:
        graphs: dict[str, GraphSpec] = {}
        for name, role, kind, tokens in GRAPHS:
            progress(f"export {name}")
            tokens = cfg.gamma + 1 if tokens == "K" else tokens
            spec = specs[role]
            file = f"{name}.onnx"
            inputs, outputs = export_decoder(
                exported[role], tmp / file, tokens, max_seq, spec.num_kv_heads, spec.head_dim, cfg.dtype
            )
            progress(f"optimize {name}")
            optimize_for_cpu(tmp / file, max_seq)
            if cfg.quantize == "int8":
                progress(f"quantize {name}")
                quantize_int8(tmp / file)
            data = external_files(tmp / file)
            graphs[name] = GraphSpec(file, sha256_of(tmp / file), role, kind, tokens, inputs, outputs, data)

        figures = {}
        for role, prefill, decode in (("target", "target_prefill", "target_verify"), ("draft", "draft_prefill", "draft_step")):
            progress(f"validate {role}")
            s = specs[role]
            kv = (s.num_layers, s.num_kv_heads, max_seq, s.head_dim, cfg.dtype)
            figures[role] = validate_model(
                models[role], tmp, (prefill, graphs[prefill]), (decode, graphs[decode]), kv, seed=cfg.seed
            )
        tol = TOLERANCES[(cfg.dtype, cfg.quantize)]
        check(figures, tol)

        tokenizer = None
        if sources["target"].tokenizer is not None:
            sources["target"].tokenizer.save_pretrained(tmp / "tokenizer")
            tokenizer = "tokenizer"
        target_src = sources["target"]
        manifest = Manifest(
            gamma=cfg.gamma,
            max_seq_len=max_seq,
            vocab_size=target_src.config.vocab_size,
            dtype=cfg.dtype,
            quantization=cfg.quantize,
            bos_token_id=target_src.config.bos_token_id,
            eos_token_ids=target_src.eos_ids(),
            pad_token_id=getattr(target_src.config, "pad_token_id", None),
            target=specs["target"],
            draft=specs["draft"],
            graphs=graphs,
            tokenizer=tokenizer,
            validation={"tolerance": {"max_abs": tol.max_abs if math.isfinite(tol.max_abs) else None, "min_top1": tol.min_top1}, **figures},
            tools=_tools(),
        )
        progress("write bundle")
        commit(tmp, cfg.out, manifest)
    return manifest


def bundle_size(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


