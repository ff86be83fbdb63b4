"""specdec-export: HF target + draft -> a validated, self-describing bundle.

Order matters for the user: everything that can be refused from configs, tokenizers and
flags is refused before any weights load; graphs are written to a staging folder; the bundle
appears at ``out`` only after validation passed.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata as md
import json
import math
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from specdec.errors import ConfigError, ExportError
from specdec.export.bundle import check_destination, commit, staging
from specdec.export.logs import LOG_FILE, ExportLog, captured
from specdec.export.gguf_file import one_parse
from specdec.export.kinds import KINDS, ExportContext
from specdec.export.ngram import check_corpus, write_table
from specdec.export.recommend import measure
from specdec.export.source import Source, check_pair, load_model, parameter_count, resolve
from specdec.manifest import FUSED_ROLES, GraphSpec, Manifest, ModelSpec, sha256_of

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


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The batched graphs' row counts: powers of two below ``max_batch``, and ``max_batch``
    (a call of n rows runs the smallest that fits; 1 row runs the batch-1 graphs)."""
    sizes = {max_batch} if max_batch > 1 else set()
    b = 2
    while b < max_batch:
        sizes.add(b)
        b *= 2
    return tuple(sorted(sizes))


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
        if self.feature_drafter is not None and not (Path(self.feature_drafter) / "head_config.json").is_file():
            raise ConfigError(f"--feature-drafter {self.feature_drafter}: expected a folder with head_config.json (specdec train-drafter --save DIR)")
        if self.feature_drafter is not None and (self.dtype != "float32" or self.quantize == "dynamic-int8"):
            raise ConfigError(f"--feature-drafter with --dtype {self.dtype} --quantize {self.quantize}: the head reads the target's float32 embedding; "
                              "export with --dtype float32, without --quantize or with --quantize int8/int4")
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
        bundle is float16 or dynamic-int8: the head reads the target's float32 embedding and its
        LM head's float or q8_0 weights (int8 and int4 keep both; the head's own matrices take
        the drafts' precision, ``head_quantization``)."""
        if self.feature_drafter is not None:
            return Path(self.feature_drafter)
        folder = Path(self.draft)
        if (folder / "head_config.json").is_file() and self.dtype == "float32" and self.quantize != "dynamic-int8":
            return folder
        return None

    def head_quantization(self) -> str | None:
        """The feature head's matrices: the drafts' block precision (int8 under int4 by default),
        ``HEAD_DEFAULT`` when nothing names a precision, float32 under ``--draft-quantize none``
        or ``dynamic-int8`` (a whole-graph pass a head does not take)."""
        kind = self.quantization("draft") if self.quantize or self.draft_quantize else HEAD_DEFAULT
        return kind if kind in ("int8", "int4") else None

    def quantization(self, model: str) -> str | None:
        """The weights of ``model`` ("target" or "draft"): None (float) or a QUANTIZATIONS name."""
        if model == "draft" and self.draft_quantize is not None:
            return None if self.draft_quantize == "none" else self.draft_quantize
        if model == "draft":
            return DRAFT_DEFAULT.get(self.quantize, self.quantize)
        return self.quantize


@dataclass
class Progress:
    """Named steps reported to a callback (the CLI draws a tqdm bar; library use passes None)."""

    report: Callable[[str], None] | None = None
    done: list[str] = field(default_factory=list)

    def __call__(self, step: str) -> None:
        self.done.append(step)
        if self.report:
            self.report(step)


def _model_spec(src: Source, model, quantization: str | None) -> ModelSpec:
    cfg, fam = src.config, src.family
    return ModelSpec(
        source=src.name,
        revision=src.commit,
        family=fam.name,
        num_layers=fam.layers(cfg),
        num_heads=fam.heads(cfg),
        num_kv_heads=fam.kv_heads(cfg),
        head_dim=fam.head_dim(cfg),
        hidden_size=fam.hidden(cfg),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 0) or 0,
        parameters=parameter_count(model),
        quantization=quantization,
    )


def default_max_seq(sources) -> int:
    """2048 rows, or fewer when a model has fewer positions."""
    limits = [DEFAULT_MAX_SEQ]
    for src in sources:
        limits += [getattr(src.config, "max_position_embeddings", None) or DEFAULT_MAX_SEQ]
    return min(limits)


def _tools() -> dict[str, str]:
    out = {}
    for pkg in ("specdec", "torch", "transformers", "onnx", "onnxscript", "onnxruntime"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


class GraphPlan(NamedTuple):
    name: str
    model: str  # "target" or "draft"
    role: str  # the runtime's use: "dynamic", "verify", "step", "encoder", "fused", "fused_greedy"
    tokens: int | str | None  # per call; None: dynamic; "K": gamma + 1; "gamma": drafted per fused call; "tree": --tree-nodes
    flavour: str = "ort"
    batch: int = 1  # rows per call
    kind: str = "decoder"  # how it is exported and validated: a key of export/kinds.py KINDS


# The static graphs are their model's dynamic graph with S fixed (kind "static"): after it.
GRAPHS = (
    GraphPlan("target_dynamic", "target", "dynamic", None),
    GraphPlan("target_verify", "target", "verify", "K", kind="static"),
    GraphPlan("draft_dynamic", "draft", "dynamic", None),
    GraphPlan("draft_step", "draft", "step", 1, kind="static"),
)
# Standard ops, static shapes (the kind of graph TensorRT builds from; no TensorRT build is
# made here). Prompts use the ORT dynamic graph (both flavours share one cache layout), so
# there is no portable dynamic graph.
PORTABLE_GRAPHS = (
    GraphPlan("target_verify_portable", "target", "verify", "K", "portable", kind="portable"),
    GraphPlan("draft_step_portable", "draft", "step", 1, "portable", kind="portable"),
)


# Encoder-decoder bundles (export/seq2seq.py): each model's encoder, run once per request, and
# its decoder graphs (batch 1; with --max-batch a rows graph per model too). The ORT flavour only so far.
SEQ2SEQ_GRAPHS = (
    GraphPlan("target_encoder", "target", "encoder", None, kind="encoder"),
    GraphPlan("target_dynamic", "target", "dynamic", None, kind="seq2seq"),
    GraphPlan("target_verify", "target", "verify", "K", kind="seq2seq"),
    GraphPlan("draft_encoder", "draft", "encoder", None, kind="encoder"),
    GraphPlan("draft_dynamic", "draft", "dynamic", None, kind="seq2seq"),
    GraphPlan("draft_step", "draft", "step", 1, kind="seq2seq"),
)
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


def planned_graphs(cfg: ExportConfig, seq2seq: bool = False) -> tuple[GraphPlan, ...]:
    if seq2seq:  # batched: an encoder of B sources, and one rows graph per model (its 1-row body included)
        if cfg.max_batch == 1:
            return SEQ2SEQ_GRAPHS
        sizes = (1, *batch_sizes(cfg.max_batch))
        encoders = tuple(GraphPlan(f"{m}_encoder_rows", m, "encoder", None, batch=cfg.max_batch, kind="encoder_batched") for m in ("target", "draft"))
        return SEQ2SEQ_GRAPHS + encoders + tuple(GraphPlan(f"{m}_batch{b}", m, "dynamic", None, batch=b, kind="seq2seq_batched")
                                                 for b in sizes for m in ("target", "draft"))  # fmt: skip
    fused = tuple(GraphPlan(f"draft_{role}", "draft", role, "gamma", kind="fused") for role in FUSED_ROLES) if cfg.fused_draft else ()
    batched = []
    rows = (1,) if cfg.batch_graphs == "rows" else ()  # a rows graph's 1-row body (one row alone, in the same session): the dynamic graph renamed
    for b in (*rows, *batch_sizes(cfg.max_batch)) if cfg.max_batch > 1 else ():  # merged into one rows graph per model (_merge_rows)
        batched += [GraphPlan(f"{m}_batch{b}", m, "dynamic", None, batch=b, kind="batched_one" if b == 1 else "batched") for m in ("target", "draft")]
        if cfg.fused_draft and b > 1:
            batched += [GraphPlan(f"draft_{role}_batch{b}", "draft", role, "gamma", batch=b, kind="fused") for role in FUSED_ROLES]
    tree = (GraphPlan("target_tree", "target", "tree", "tree", kind="tree"),) if cfg.tree_nodes else ()
    return GRAPHS + fused + (PORTABLE_GRAPHS if cfg.portable else ()) + tuple(batched) + tree


def _read_sources(cfg: ExportConfig) -> tuple[dict[str, Source], int | None, int]:
    """Both models' configs and tokenizers, checked as a pair; the max source length (None:
    decoder-only) and the KV rows."""
    sources = {
        "target": resolve(cfg.target, cfg.max_seq_len, cfg.target_revision, cfg.trust_remote_code),
        "draft": resolve(cfg.draft, cfg.max_seq_len, cfg.draft_revision, cfg.trust_remote_code),
    }
    check_pair(sources["target"], sources["draft"])
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


def export_bundle(cfg: ExportConfig, progress: Progress | None = None) -> Manifest:
    """Export, validate and write the bundle at ``cfg.out``; returns its manifest. What the
    libraries print meanwhile goes to the bundle's ``export.log`` (export/logs.py); a failure
    that is not a refusal of specdec's own becomes an ExportError naming the step, the stack's
    versions and a log written beside ``cfg.out``."""
    from specdec.errors import SpecDecError
    from specdec.export.versions import check_transformers, tested_range

    progress = progress or Progress()
    check_destination(cfg.out, cfg.overwrite)
    check_transformers()
    with captured(torch=False) as log:  # _export widens it to torch's loggers once the configs passed
        try:
            return _export(cfg, progress, log)
        except SpecDecError:
            raise
        except Exception as e:  # noqa: BLE001 - a library's failure: one line for the user, the traceback in a log
            failed = cfg.out.with_name(cfg.out.name + ".export-failed.log")
            failed.write_text(log.text() + "\n" + "".join(traceback.format_exception(e)))
            step = progress.done[-1] if progress.done else "start"
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            raise ExportError(f"export failed at step {step!r} ({type(e).__name__}: {first}) with {_stack()} (tested: {tested_range()}); "
                              f"the traceback and library output are in {failed}") from e


def _stack() -> str:
    """The versions an export failure depends on, as one phrase."""
    tools = _tools()
    return ", ".join(f"{p} {tools[p]}" for p in ("transformers", "torch", "onnxscript") if p in tools)


def _export(cfg: ExportConfig, progress: Progress, log: ExportLog) -> Manifest:
    """Everything that configs, tokenizers and flags can refuse, before torch is imported; then
    the export."""
    fallback = None
    if cfg.head() is None and (Path(cfg.draft) / "head_config.json").is_file():
        fallback = headless_drafter(Path(cfg.draft), cfg)
        warnings.warn(f"{cfg.draft} holds a feature head too; it is left out of this {cfg.quantize or cfg.dtype} bundle "
                      f"(the head reads the target's float32 tables): its default drafter is {fallback['name'] if fallback else 'the draft model'}",
                      stacklevel=2)  # fmt: skip
    with one_parse():  # a GGUF source is parsed once for its header, config, tokenizer and weights
        progress("read configs")
        read = _read_sources(cfg)
        with captured(log):
            return _build(cfg, read, fallback, progress, log)


def _build(cfg: ExportConfig, read: tuple[dict[str, Source], int | None, int], fallback: dict | None, progress: Progress,
           log: ExportLog) -> Manifest:  # fmt: skip
    """Load the weights, write and validate every graph, commit the bundle."""
    from specdec.export.graphs import TORCH_DTYPES
    from specdec.export.tokenizer_files import save_tokenizer
    from specdec.export.validate import NEAR_TIE, check, text_tokens

    sources, max_source, max_seq = read
    progress("load weights")
    models = {"target": load_model(sources["target"])}
    models["draft"] = load_model(sources["draft"], target=models["target"])
    specs = {role: _model_spec(sources[role], models[role], cfg.quantization(role)) for role in models}

    # Graphs are traced from a copy in the bundle's dtype; validation compares them with the
    # float32 source, so the recorded figures are the deviation from the model the user gave.
    exported = {role: m if cfg.dtype == "float32" else copy.deepcopy(m).to(TORCH_DTYPES[cfg.dtype]) for role, m in models.items()}
    with staging(cfg.out) as tmp:
        plans = planned_graphs(cfg, max_source is not None)
        ctx = ExportContext(cfg, max_seq, tmp, max_source, models, specs, {}, text_tokens(sources["target"].tokenizer, max_seq),
                            {role: sources[role].gguf_types for role in sources})  # fmt: skip
        for p in plans:  # in plan order, into ctx.graphs: a derived kind reads the graphs it is made from
            ctx.graphs[p.name] = _export_graph(p, ctx, exported[p.model], progress)
        progress("share weights")
        graphs = _share_weights(ctx.graphs, tmp)
        plans = {p.name: p for p in plans}
        if cfg.max_batch > 1 and cfg.batch_graphs == "rows":
            progress("merge batched graphs")
            graphs, plans = _merge_rows(graphs, plans, tmp)
        ctx = ctx._replace(graphs=graphs)
        figures, tols = _validate(ctx, plans, progress)
        check(figures, tols)  # batched graphs too; portable graphs stay float
        tol = tols["target"]

        target = sources["target"]
        tokenizer = chat_template = None
        if target.tokenizer is not None:
            save_tokenizer(target.tokenizer, tmp / "tokenizer")
            tokenizer = "tokenizer"
            chat_template = save_chat_template(target.tokenizer, tmp / "tokenizer", cfg.chat_template)
        ngram = None
        if cfg.ngram_corpus is not None:
            progress("count n-grams")
            ngram = write_table(cfg.ngram_corpus, target.tokenizer, target.config.vocab_size, tmp)
        as_json = lambda t: {"rel": t.rel if math.isfinite(t.rel) else None, "min_top1": t.min_top1, "near_tie": NEAR_TIE,  # noqa: E731
                             "min_text_top1": t.min_text_top1, "max_text_kl": t.max_text_kl if math.isfinite(t.max_text_kl) else None}
        validation = {"tolerance": as_json(tol), **figures}
        if tols.get("draft", tol) != tol:
            validation["draft_tolerance"] = as_json(tols["draft"])
        manifest = _manifest(cfg, target, specs, graphs, max_seq, tokenizer=tokenizer, chat_template=chat_template, ngram=ngram,
                             validation=validation, max_source=max_source)  # fmt: skip
        if (head := cfg.head()) is not None:
            progress("feature drafter")
            manifest = _feature_drafter(tmp, manifest, head, cfg.head_quantization())
        if head is not None or fallback is not None:  # a choice to make: measured here, the folder's suggestion among the modes
            manifest = dataclasses.replace(manifest, drafter=measure(tmp, manifest, default_drafter(head, cfg) if head else fallback, progress))
        progress("write bundle")
        (tmp / LOG_FILE).write_text(log.text())
        manifest = dataclasses.replace(manifest, export_log=LOG_FILE, custom_ops=_custom_ops(manifest.graphs, tmp))
        manifest = commit(tmp, cfg.out, manifest)  # with every file's size and digest
    return manifest


def _feature_drafter(tmp: Path, manifest: Manifest, head_dir: Path, quantize: str | None) -> Manifest:
    """The staged bundle with its target's features exposed and a saved feature head (specdec
    train-drafter --save) added, checked against PyTorch; its matrices in ``quantize``'s blocks
    (the drafts' precision) or float32."""
    import torch

    from specdec.export.feature import add_head, expose_features, tables
    from specdec.export.head import load_head

    manifest = expose_features(tmp, manifest)
    embed, head_t, tied = tables(tmp, manifest)
    head, record = load_head(head_dir, torch.from_numpy(embed), torch.from_numpy(head_t), tied)
    return add_head(tmp, manifest, head, {**record, "loaded_from": str(head_dir)}, quantize=quantize)


def _recommended(folder: Path, cfg: ExportConfig, with_head: bool) -> dict | None:
    """``head_config.json``'s suggestion (one of the modes export measures, export/recommend.py) for a bundle with the head ("serve", its fields
    overridden by "serve" → the ``--quantize`` name, e.g. "int8": {"gamma": 2, "why": ...}, for
    a quantized target) or without it ("serve" → "without_head"), as a manifest ``drafter``
    entry (with its "stop_below" for the head's chain: ``runtime.proposers.FeatureHead``); None
    when it names nothing this bundle runs (a drafter that needs a head it lacks, or not, a tree
    without --tree-nodes, a bad γ or stop_below)."""
    from specdec.manifest import is_stop
    from specdec.runtime.drafters import DRAFTERS

    serve = json.loads((folder / "head_config.json").read_text()).get("serve") or {}
    entry = {**serve, **(serve.get(cfg.quantize) or {})} if with_head else serve.get("without_head") or {}
    name, gamma = entry.get("drafter", "feature" if with_head else None), entry.get("gamma", 1 if with_head else cfg.gamma)
    reg = DRAFTERS.get(name)
    if reg is None or reg.needs_head != with_head or (reg.tree and not cfg.tree_nodes) or not isinstance(gamma, int) or gamma < 1:
        return None
    why = entry.get("why", f"suggested{'' if with_head else ' without the head'} by its folder's head_config.json")
    stop = entry.get("stop_below", 0.0) if reg.needs_head and not reg.tree else 0.0
    if not is_stop(stop):
        return None
    return {"name": name, "gamma": min(gamma, cfg.gamma), "why": why, **({"stop_below": float(stop)} if stop else {})}


def default_drafter(head: Path, cfg: ExportConfig) -> dict:
    """The head folder's suggestion for a bundle with its feature head (``head_config.json``'s
    "serve": {"drafter", "gamma", "why"}) when this bundle has what it needs, else the head's
    chain at γ = 1: one of the modes export measures (export/recommend.py)."""
    return _recommended(head, cfg, with_head=True) or {
        "name": "feature", "gamma": 1, "why": "the feature head's chain (its folder recommends nothing this bundle runs)"}


def headless_drafter(folder: Path, cfg: ExportConfig) -> dict | None:
    """The default drafter of a bundle that leaves ``folder``'s head out (float16 or quantized):
    ``head_config.json``'s "serve" → "without_head", when it names a drafter this bundle runs
    without a head; else None (the draft model at the bundle's γ)."""
    return _recommended(folder, cfg, with_head=False)


def check_template(path: Path) -> None:
    """A ConfigError unless ``path`` is a file holding a Jinja template that parses."""
    from jinja2 import Environment, TemplateSyntaxError

    if not path.is_file():
        raise ConfigError(f"--chat-template {path}: not a file; expected a Jinja chat template (as a tokenizer's chat_template.jinja)")
    try:
        Environment().parse(path.read_text())
    except (TemplateSyntaxError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path}: not a Jinja template ({e}); fix it or drop the option to keep the tokenizer's own") from None


def save_chat_template(tokenizer, folder: Path, given: Path | None = None) -> str | None:
    """Write ``given``'s text, else the tokenizer's chat template (its default one, when it has
    several), as ``chat_template.jinja`` in ``folder``; returns its bundle path, or None without one."""
    template = given.read_text() if given is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not isinstance(template, str) or not template.strip():
        return None
    (folder / "chat_template.jinja").write_text(template)
    return f"{folder.name}/chat_template.jinja"


def _custom_ops(graphs: dict[str, GraphSpec], folder: Path) -> dict | None:
    """The manifest's word on specdec's own ops, where a graph uses them (int8/int4 blocks)."""
    import onnx

    from specdec.engines.blocks_op import DOMAIN, LIBRARY, WITHOUT
    from specdec.manifest import BLOCKS_LAYOUT

    ops = sorted({n.op_type for g in graphs.values() for n in onnx.load(str(folder / g.file), load_external_data=False).graph.node
                  if n.domain == DOMAIN})  # fmt: skip
    return {"domain": DOMAIN, "ops": ops, "library": LIBRARY, "without": WITHOUT, "layout": BLOCKS_LAYOUT} if ops else None


def _manifest(cfg: ExportConfig, target: Source, specs: dict[str, ModelSpec], graphs: dict[str, GraphSpec], max_seq: int, *,
              tokenizer: str | None, chat_template: str | None, ngram: dict | None, validation: dict,
              max_source: int | None = None) -> Manifest:  # fmt: skip
    """The manifest of an exported bundle."""
    return Manifest(
        gamma=cfg.gamma,
        max_seq_len=max_seq,
        max_batch=cfg.max_batch,
        vocab_size=target.config.vocab_size,
        dtype=cfg.dtype,
        quantization=cfg.quantize,
        bos_token_id=getattr(target.config, "bos_token_id", None),  # transformers 5.x configs lack what they do not set (t5-small's)
        eos_token_ids=target.eos_ids(),
        pad_token_id=getattr(target.config, "pad_token_id", None),
        target=specs["target"],
        draft=specs["draft"],
        graphs=graphs,
        tokenizer=tokenizer,
        chat_template=chat_template,
        ngram=ngram,
        validation=validation,
        tools=_tools(),
        max_source_len=max_source,
        decoder_start_token_id=getattr(target.config, "decoder_start_token_id", None) if max_source is not None else None,
    )


def _export_graph(plan: GraphPlan, ctx: ExportContext, model, progress: Progress) -> GraphSpec:
    """Export one graph by its kind (export/kinds.py); then, unless the kind stays float,
    optimize it for ONNX Runtime and quantize it (--quantize)."""
    from specdec.export.optimize import optimize_for_cpu
    from specdec.export.quantize import external_files, quantize_int8, quantize_weight_only, scheme_for

    cfg, spec, kind = ctx.cfg, ctx.specs[plan.model], KINDS[plan.kind]
    progress(f"export {plan.name}")
    tokens = {"K": cfg.gamma + 1, "gamma": cfg.gamma, "tree": cfg.tree_nodes}.get(plan.tokens, plan.tokens)
    file = f"{plan.name}.onnx"
    inputs, outputs, io = kind.export(ctx, plan, model, spec, ctx.tmp / file, tokens)
    if not kind.float_only and not kind.derived:
        progress(f"optimize {plan.name}")
        optimize_for_cpu(ctx.tmp / file, ctx.max_seq)
        quantization = cfg.quantization(plan.model)
        if quantization:
            progress(f"quantize {plan.name}")
            if quantization == "dynamic-int8":
                quantize_int8(ctx.tmp / file)
            else:
                quantize_weight_only(ctx.tmp / file, quantization, scheme_for(quantization, ctx.gguf_types.get(plan.model, ()), cfg.kernel))
    return GraphSpec(file, sha256_of(ctx.tmp / file), plan.model, plan.role, tokens, inputs, outputs, io, external_files(ctx.tmp / file),
                     plan.flavour, plan.batch)  # fmt: skip


def _share_weights(graphs: dict[str, GraphSpec], tmp: Path) -> dict[str, GraphSpec]:
    """Each model's graphs rewritten to read one ``<model>.weights`` file (export/weights.py)."""
    from specdec.export.weights import share_weights

    out = dict(graphs)
    for model in ("target", "draft"):
        names = [n for n, g in graphs.items() if g.model == model]
        shared = share_weights(tmp, model, [graphs[n].file for n in names])
        for n in names:
            out[n] = dataclasses.replace(graphs[n], sha256=sha256_of(tmp / graphs[n].file), data=(shared.file,) if shared.file else ())
    return out


ROWS_KINDS = ("batched", "batched_one", "seq2seq_batched")  # the kinds a model's row counts are merged from


def _merge_rows(graphs: dict[str, GraphSpec], plans: dict[str, GraphPlan], tmp: Path) -> tuple[dict[str, GraphSpec], dict[str, GraphPlan]]:
    """Each model's batched graphs (1, 2, 4, .. rows) merged into one rows graph, ``<model>_rows``
    (export/rows.py): one session for every row count, so the weights are packed once."""
    from specdec.export.rows import merge_rows

    graphs, plans = dict(graphs), dict(plans)
    for model in ("target", "draft"):
        names = {plans[n].batch: n for n in graphs if plans[n].kind in ROWS_KINDS and plans[n].model == model}
        kind = plans[names[max(names)]].kind  # the largest body's (a 1-row body may be derived)
        spec = merge_rows(tmp, {b: graphs[n] for b, n in names.items()}, f"{model}_rows.onnx")
        for n in names.values():
            (tmp / graphs.pop(n).file).unlink()
            plans.pop(n)
        name = f"{model}_rows"
        graphs[name] = dataclasses.replace(spec, sha256=sha256_of(tmp / spec.file))
        plans[name] = GraphPlan(name, model, "dynamic", None, batch=spec.batch, kind=kind)
    return graphs, plans


def _validate(ctx: ExportContext, plans: dict[str, GraphPlan], progress: Progress) -> tuple[dict, dict]:
    """Figures per checked graph (each kind's own check against PyTorch) and the tolerance each
    must meet: the model's precision's, or the float one for a kind that stays float."""
    from specdec.export.validate import tolerance

    figures, tols = {}, {}
    for name, g in ctx.graphs.items():
        kind = KINDS[plans[name].kind]
        progress(f"validate {name}")
        found = kind.validate(ctx, name, g)
        if found is None:
            continue
        key, figures[key] = found
        tols[key] = tolerance(ctx.cfg.dtype, None if kind.float_only else ctx.cfg.quantization(g.model), g.model, ctx.cfg.max_kl)
    return figures, tols


def bundle_size(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


