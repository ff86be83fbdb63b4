"""specdec-export's options (``ExportConfig``) and every refusal that configs, tokenizers and
flags can give before any weights load (export/pipeline.py runs the export itself)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import ConfigError
from specdec.export.ngram import check_corpus
from specdec.export.source import Source, check_pair, resolve

DTYPES = ("float32", "float16")
DEFAULT_MAX_SEQ = 2048
QUANTIZATIONS = (None, "int8", "int4", "dynamic-int8")  # int8/int4: weight-only MatMulNBits; dynamic-int8: quantize_dynamic
# The draft's precision when --draft-quantize is not given, per --quantize (else the same): a
# 4-bit draft accepted half as much as an 8-bit one over SmolLM2's int4 target, which made int8
# the fastest end to end (docs/quantization.md#drafts).
DRAFT_DEFAULT = {"int4": "int8"}
# A feature head's matrices when neither --quantize nor --draft-quantize is given: int8 blocks.
# Drafting reads them once a drafted token, at the bandwidth floor; q8_0 reads a quarter of the
# bytes (SmolLM2-135M: c 0.034 against 0.067 a drafted token, acceptance unchanged, 4-10% faster
# end to end: docs/training-drafters.md), and the drafts stay proposals the target verifies, so
# the output is the target's either way. --draft-quantize none keeps them float32.
HEAD_DEFAULT = "int8"
MAX_GAMMA = 15
MAX_BATCH = 64
# How batched graphs are laid out: "rows" merges a model's row counts into one graph (one
# session: the weights packed once, a few % per call at 0.5B); "per-size" keeps one graph per
# row count (a session each: the weights once per row count, ~3-8% faster calls on a model that
# fits in cache). Measured in docs/performance.md.
BATCH_GRAPHS = ("rows", "per-size")
MAX_TREE_NODES = 64


@dataclass(frozen=True)
class ExportConfig:
    """One export, as the CLI's options give it."""

    target: str
    draft: str | None  # None: no draft model (a bundle whose drafters are the feature head's and the model-free ones)
    out: Path
    gamma: int = 4
    max_seq_len: int | None = None  # None: 2048, or less if a model has fewer positions
    dtype: str = "float32"
    quantize: str | None = None
    draft_quantize: str | None = None  # None: as ``quantize`` (int8 under int4: DRAFT_DEFAULT); "none": float weights
    kernel: str = "blocks"  # what runs int8/int4 weights: export/quantize.py WeightOnly.kernel
    portable: bool = False
    max_batch: int = 1  # > 1: also batched graphs for the continuous-batching engine
    batch_graphs: str = "rows"  # "rows": one rows graph per model (export/rows.py); "per-size": one session per row count
    fused_draft: bool = False  # also the draft's fused graphs (export/fused.py), per batch size
    tree_nodes: int | None = None  # also a tree verify graph of the target for trees of this many nodes (export/tree.py)
    feature_drafter: str | None = None  # a saved feature head (specdec train-drafter --save) to add: export/feature.py
    overwrite: bool = False
    target_revision: str | None = None
    draft_revision: str | None = None
    trust_remote_code: bool = False
    ngram_corpus: Path | None = None  # text file or folder: the n-gram drafter's table
    chat_template: Path | None = None  # a Jinja chat template for a target whose tokenizer has none (or another one)
    max_source_len: int | None = None  # encoder-decoder: source tokens per request [default: the models' limit, or 512]
    max_kl: float | None = None  # bound on the mean KL over the validation text for float16/quantized models [default: validate.TOLERANCES]
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        if self.draft is not None and _eagle3_at(self.draft):  # an EAGLE-3 head as --draft: the bundle's feature drafter, no draft model
            if self.feature_drafter is not None:
                raise ConfigError(f"--draft {self.draft} is an EAGLE-3 head and --feature-drafter {self.feature_drafter} another head; pass one head")
            object.__setattr__(self, "feature_drafter", self.draft)
            object.__setattr__(self, "draft", None)
        if self.ngram_corpus is not None:
            object.__setattr__(self, "ngram_corpus", Path(self.ngram_corpus))
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", Path(self.chat_template))
            check_template(self.chat_template)
        if not isinstance(self.gamma, int) or not 1 <= self.gamma <= MAX_GAMMA:
            raise ConfigError(f"--gamma {self.gamma}: expected an integer in 1..{MAX_GAMMA} (draft tokens per target call)")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < self.gamma + 2):
            raise ConfigError(f"--max-seq-len {self.max_seq_len}: expected an integer >= {self.gamma + 2} (gamma + 2)")
        if self.batch_graphs not in BATCH_GRAPHS:
            raise ConfigError(f"--batch-graphs {self.batch_graphs!r}: expected one of {', '.join(BATCH_GRAPHS)}")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or not 1 <= self.max_batch <= MAX_BATCH:
            raise ConfigError(f"--max-batch {self.max_batch}: expected an integer in 1..{MAX_BATCH} (requests decoded together)")
        if self.feature_drafter is not None and not Path(self.feature_drafter).exists() and HUB_ID.match(self.feature_drafter):
            object.__setattr__(self, "feature_drafter", _download_head(self.feature_drafter))
        if self.feature_drafter is not None and not _is_head(Path(self.feature_drafter)):
            raise ConfigError(f"--feature-drafter {self.feature_drafter}: expected a folder with head_config.json (specdec train-drafter --save DIR) "
                              "or an EAGLE-3 head's config.json and weights (Speculators, EAGLE, SpecForge)")
        if self.feature_drafter is not None and self.quantize == "dynamic-int8":
            raise ConfigError("--feature-drafter with --quantize dynamic-int8: the head reads the target's float embedding and LM head, "
                              "which dynamic-int8 quantizes; export without --quantize, with --dtype float16, or with --quantize int8/int4")
        if self.tree_nodes is not None and (isinstance(self.tree_nodes, bool) or not isinstance(self.tree_nodes, int)
                                            or not 2 <= self.tree_nodes <= MAX_TREE_NODES):  # fmt: skip
            raise ConfigError(f"--tree-nodes {self.tree_nodes}: expected an integer in 2..{MAX_TREE_NODES} (draft-tree nodes per target call)")
        if self.max_kl is not None and not self.max_kl > 0:
            raise ConfigError(f"--max-kl {self.max_kl}: expected a bound in nats > 0 (inf: record the KL without refusing)")
        if self.max_source_len is not None and (isinstance(self.max_source_len, bool) or not isinstance(self.max_source_len, int) or self.max_source_len < 2):
            raise ConfigError(f"--max-source-len {self.max_source_len}: expected an integer >= 2 (source tokens per request)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype}: expected one of {', '.join(DTYPES)}")
        names = ", ".join(q for q in QUANTIZATIONS if q)
        if self.kernel not in ("blocks", "nbits"):
            raise ConfigError(f"--kernel {self.kernel}: expected blocks (specdec's row-invariant kernels) or nbits (ONNX Runtime's MatMulNBits)")
        if self.quantize not in QUANTIZATIONS:
            raise ConfigError(f"--quantize {self.quantize}: expected one of {names}, or nothing for float weights")
        if self.draft_quantize not in (None, "none", *QUANTIZATIONS):
            raise ConfigError(f"--draft-quantize {self.draft_quantize}: expected none or one of {names} (default: as --quantize; int8 under int4)")
        if (self.quantize or self.quantization("draft")) and self.dtype != "float32":
            raise ConfigError(f"--quantize/--draft-quantize need --dtype float32 (they quantize float32 weights), got --dtype {self.dtype}")

    def head(self) -> Path | None:
        """The feature head to add: ``feature_drafter``, else one the ``draft`` folder holds beside
        its model (``head_config.json``, as ``specdec train-drafter --save`` writes it), unless the
        bundle is dynamic-int8: the head reads the target's float embedding and its LM head's
        float or q8_0 weights (float16, int8 and int4 keep both; the head's own matrices take
        the drafts' precision, ``head_quantization``, or float16 in a float16 bundle)."""
        if self.feature_drafter is not None:
            return Path(self.feature_drafter)
        if self.draft is None:
            return None
        folder = Path(self.draft)
        if (folder / "head_config.json").is_file() and self.quantize != "dynamic-int8":
            return folder
        return None

    def head_quantization(self) -> str | None:
        """The feature head's matrices: the drafts' block precision (int8 under int4 by default),
        ``HEAD_DEFAULT`` when nothing names a precision, float32 under ``--draft-quantize none``
        or ``dynamic-int8`` (a whole-graph pass a head does not take)."""
        if self.dtype != "float32":  # a float16 bundle: the head in float16, its tables the target's
            return None
        kind = self.quantization("draft") if self.quantize or self.draft_quantize else HEAD_DEFAULT
        return kind if kind in ("int8", "int4") else None

    def quantization(self, model: str) -> str | None:
        """The weights of ``model`` ("target" or "draft"): None (float) or a QUANTIZATIONS name."""
        if model == "draft" and self.draft_quantize is not None:
            return None if self.draft_quantize == "none" else self.draft_quantize
        if model == "draft":
            return DRAFT_DEFAULT.get(self.quantize, self.quantize)
        return self.quantize


HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _download_head(repo: str) -> str:
    """A hub head's folder (its config, weights and head_config.json), downloaded to the hub cache."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo, allow_patterns=["*.json", "*.safetensors", "*.bin"])
    except Exception as e:  # offline, no such repo, no access: one line
        raise ConfigError(f"--feature-drafter {repo}: not a local folder, and the hub did not give it ({type(e).__name__}); "
                          "download the head folder and pass its path") from None


def _eagle3_at(draft: str) -> bool:
    """Whether ``--draft`` names an EAGLE-3 head: a local folder, or a hub repo whose config.json
    says so (read alone; an unreachable hub: not a head, the draft model path then says why)."""
    from specdec.export.eagle3 import is_eagle3

    if Path(draft).exists():
        return is_eagle3(Path(draft))
    if not HUB_ID.match(draft):
        return False
    try:
        from huggingface_hub import hf_hub_download

        return is_eagle3(Path(hf_hub_download(draft, "config.json")).parent)
    except Exception:
        return False


def _is_head(folder: Path) -> bool:
    """A feature head folder: specdec's (head_config.json) or an EAGLE-3 head (export/eagle3.py)."""
    from specdec.export.eagle3 import is_eagle3

    return (folder / "head_config.json").is_file() or is_eagle3(folder)


def check_template(path: Path) -> None:
    """A ConfigError unless ``path`` is a file holding a Jinja template that parses."""
    from jinja2 import Environment, TemplateSyntaxError

    if not path.is_file():
        raise ConfigError(f"--chat-template {path}: not a file; expected a Jinja chat template (as a tokenizer's chat_template.jinja)")
    try:
        Environment().parse(path.read_text())
    except (TemplateSyntaxError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path}: not a Jinja template ({e}); fix it or drop the option to keep the tokenizer's own") from None


def default_max_seq(sources) -> int:
    """2048 rows, or fewer when a model has fewer positions."""
    limits = [DEFAULT_MAX_SEQ]
    for src in sources:
        limits += [getattr(src.config, "max_position_embeddings", None) or DEFAULT_MAX_SEQ]
    return min(limits)


DEFAULT_MAX_SOURCE = 512


def check_seq2seq(cfg: ExportConfig, sources: dict[str, Source]) -> int | None:
    """Refuse options an encoder-decoder bundle cannot have yet; its max source length (None: decoder-only)."""
    if not sources["target"].family.seq2seq:
        if cfg.max_source_len is not None:
            raise ConfigError(f"--max-source-len {cfg.max_source_len}: {cfg.target} is decoder-only; the option is for encoder-decoder models (T5, BART, Marian)")
        return None
    flags = {"--batch-graphs per-size": cfg.max_batch > 1 and cfg.batch_graphs != "rows", "--fused-draft": cfg.fused_draft,
             "--portable": cfg.portable, "--tree-nodes": bool(cfg.tree_nodes),
             "--feature-drafter": cfg.head() is not None}
    bad = [f for f, on in flags.items() if on]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: not supported for encoder-decoder bundles yet ({cfg.target}); export without {' and '.join(bad)}")
    known = [n for n in (src.family.max_source(src.config) for src in sources.values()) if n]  # T5: none of its own
    limit = min(known) if known else None
    if cfg.max_source_len is not None and limit is not None and cfg.max_source_len > limit:
        raise ConfigError(f"--max-source-len {cfg.max_source_len} exceeds the encoders' {limit} positions; pass --max-source-len {limit} or less")
    return cfg.max_source_len or min(DEFAULT_MAX_SOURCE, limit or DEFAULT_MAX_SOURCE)


def read_sources(cfg: ExportConfig) -> tuple[dict[str, Source], int | None, int]:
    """Both models' configs and tokenizers, checked as a pair; the max source length (None:
    decoder-only) and the KV rows."""
    sources = {"target": resolve(cfg.target, cfg.max_seq_len, cfg.target_revision, cfg.trust_remote_code)}
    if cfg.draft is not None:
        sources["draft"] = resolve(cfg.draft, cfg.max_seq_len, cfg.draft_revision, cfg.trust_remote_code)
        check_pair(sources["target"], sources["draft"])
    head = cfg.head()
    if head is not None:
        from specdec.export import eagle3

        if eagle3.is_eagle3(head):  # refused before any graph is exported
            eagle3.check_target(eagle3.read(head), head, sources["target"].config)
    check_corpus(cfg.ngram_corpus, sources["target"].tokenizer is not None)
    max_source = check_seq2seq(cfg, sources)
    if cfg.tree_nodes:
        from specdec.export.tree import unsupported

        bad = unsupported(sources["target"].config)
        if bad:
            raise ConfigError(f"--tree-nodes {cfg.tree_nodes}: {cfg.target} has {', '.join(bad)}, which tree verify graphs do not take yet; "
                              "export without --tree-nodes")  # fmt: skip
    max_seq = cfg.max_seq_len or default_max_seq(sources.values())
    return sources, max_source, max_seq
