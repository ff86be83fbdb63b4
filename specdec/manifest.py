"""The bundle manifest: the one contract between export, engines and runtime.

``specdec-export`` writes ``manifest.json`` next to the graphs; engines and the runtime read
every graph's input/output names, dtypes and shapes, and which tensor plays which part
(``GraphIO``), from here and never hard-code them. The runtime picks graphs by
(model, role, flavour) with ``Manifest.graph``.
Loading checks that every path stays inside the bundle and that every file has the recorded
size and digest (specdec/integrity.py). Pure Python: no torch, no ONNX.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec import integrity
from specdec.errors import BundleError

SCHEMA_VERSION = 2  # 2: graphs carry their I/O roles; role "prefill" became "dynamic"
BLOCKS_LAYOUT = 2  # MatMulBlocks' weight bytes (engines/csrc/blocks.c): 2 = panels of 16 columns (1: a column at a time, never read now)
MANIFEST_NAME = "manifest.json"
DTYPES = ("float32", "float16", "int64", "int32", "bool")
MODELS = ("target", "draft", "head")  # head: the feature drafter (export/head.py), one layer over the target's features
FUSED_ROLES = ("fused", "fused_greedy")  # the draft's γ steps in one call (export/fused.py): sampling, and argmax only
ROLES = ("dynamic", "verify", "step", "encoder", "tree", "move", *FUSED_ROLES)  # move: export/kv_move.py
FLAVOURS = ("ort", "portable")


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output. A shape entry is an int (static) or a name (dynamic)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise BundleError(f"tensor {self.name!r} has dtype {self.dtype!r}; expected one of {DTYPES}")
        object.__setattr__(self, "shape", tuple(self.shape))


@dataclass(frozen=True)
class GraphIO:
    """Which tensor of a graph plays which part: engines bind by these names.

    Every graph: ``ids`` int64 [1, S], ``positions`` int64 [1, S], ``logits`` float [1, S, V],
    and per layer a (key, value) pair of ``past`` inputs (the cache buffers) and ``present``
    outputs. The length scalars depend on the flavour: "ort" graphs take ``seqlens``
    (int32 [1], rows visible - 1) and ``total`` (int32 [], rows visible) and write the full
    buffer in place; "portable" graphs take ``past_length`` (int64 [], committed rows) and
    return only the S new rows.

    Encoder-decoder bundles (export/seq2seq.py): an "encoder" graph has ``ids`` [1, N] (the
    source) and ``cross`` outputs, a (key, value) pair [1, H, N, D] per decoder layer; their
    decoder graphs take the same ``cross`` names as inputs. A batched encoder (batch > 1) takes
    B padded sources [B, N] and their ``mask`` and writes [B, H, N, D].
    """

    ids: str
    positions: str | None  # None in an encoder graph
    logits: str | None  # a fused draft graph: its probs [B, γ, V] (None in the greedy one)
    past: tuple[tuple[str, str], ...]
    present: tuple[tuple[str, str], ...]
    seqlens: str | None = None
    total: str | None = None
    past_length: str | None = None
    tokens: str | None = None  # fused draft graph (export/fused.py): the drafted tokens [B, γ]
    uniforms: str | None = None  # its per-row sampling inputs
    temperature: str | None = None
    top_k: str | None = None
    top_p: str | None = None
    cross: tuple[tuple[str, str], ...] = ()  # encoder-decoder: per decoder layer, the cross-attention K/V
    tree_bias: str | None = None  # tree verify graph (export/tree.py): float32 [1, 1, N, N], 0 for ancestors
    features: str | None = None  # float32 [1, S, d]: the hidden state the LM head reads (target graphs of a
    #                              bundle with a feature drafter), or the head's own predicted features
    context: str | None = None  # the head's input: float32 [1, S, d], the target's features one position back
    # A batched graph (export/batched.py): per row b, its attention's total_sequence_length
    # (int32 [], rows visible), fed by the runtime. CUDA's GroupQueryAttention went wrong when
    # that scalar was computed inside the graph from seqlens_k (docs/gpu.md); empty in a graph
    # exported before, which computes it.
    totals: tuple[str, ...] = ()
    mask: str | None = None  # a batched encoder graph (export/seq2seq.py): attention_mask int64 [B, N], 1 a source token, 0 padding

    def __post_init__(self) -> None:
        for name in ("past", "present", "cross"):
            object.__setattr__(self, name, tuple(tuple(pair) for pair in getattr(self, name)))
        object.__setattr__(self, "totals", tuple(self.totals))

    def names(self) -> set[str]:
        """Every tensor name this mapping refers to."""
        out = {self.ids, self.positions, self.logits, self.seqlens, self.total, self.past_length}
        out |= {self.tokens, self.uniforms, self.temperature, self.top_k, self.top_p, self.tree_bias, self.features, self.context, self.mask}
        out |= {n for pair in (*self.past, *self.present, *self.cross) for n in pair} | set(self.totals)
        return out - {None}


def body_output(name: str, rows: int, largest: int) -> str:
    """A rows graph's output ``name`` of its body of ``rows`` rows (export/rows.py): the
    largest body's keep their names (the graph's ``io`` names them), the others get /rows<B>."""
    return name if rows == largest else f"{name}/rows{rows}"


@dataclass(frozen=True)
class GraphSpec:
    """One ONNX graph in the bundle.

    ``role``: "verify" (target, static K tokens per call), "step" (draft, static 1 token per
    call), "dynamic" (any length: prompts, 1-token target steps, short verify calls),
    "fused" / "fused_greedy" (draft, γ steps and their token choice in one call: export/fused.py),
    "encoder" (an encoder-decoder's encoder, run once per request: export/seq2seq.py), or "tree"
    (the target over a draft tree of N nodes, ancestors-only attention: export/tree.py), or
    "move" (a tree's accepted KV rows moved on the cache's device: export/kv_move.py).
    ``tokens`` is the static number of new tokens per call (tokens drafted, for a fused graph),
    or None when it is dynamic.
    ``data`` lists external-data files the graph reads.
    """

    file: str
    sha256: str
    model: str  # "target", "draft" or "head"
    role: str
    tokens: int | None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    io: GraphIO
    data: tuple[str, ...] = ()
    flavour: str = "ort"  # "ort": contrib ops allowed; "portable": standard ops, static shapes
    batch: int = 1  # rows per call; > 1: a batched graph (export/batched.py), one KV pair per row and layer
    rows: tuple[int, ...] = ()  # a rows graph (export/rows.py): the row counts B it runs, one body each, B <= batch; () for a fixed B

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(t if isinstance(t, TensorSpec) else TensorSpec(**t) for t in self.inputs))
        object.__setattr__(self, "outputs", tuple(t if isinstance(t, TensorSpec) else TensorSpec(**t) for t in self.outputs))
        object.__setattr__(self, "io", self.io if isinstance(self.io, GraphIO) else GraphIO(**self.io))
        object.__setattr__(self, "data", tuple(self.data))
        object.__setattr__(self, "rows", tuple(self.rows))
        if (self.model, self.role, self.flavour) not in {(m, r, f) for m in MODELS for r in ROLES for f in FLAVOURS}:
            raise BundleError(f"graph {self.file}: model/role/flavour {self.model}/{self.role}/{self.flavour} is not one this specdec reads; re-export the bundle")
        unknown = self.io.names() - {t.name for t in (*self.inputs, *self.outputs)}
        if unknown:
            raise BundleError(f"graph {self.file}: I/O roles name tensors {sorted(unknown)} it does not have; re-export the bundle")


@dataclass(frozen=True)
class ModelSpec:
    """Shape facts about one source model, as the runtime needs them."""

    source: str
    revision: str | None
    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_position_embeddings: int
    parameters: int
    quantization: str | None = None  # None (float weights), "int8"/"int4" (block weights: MatMulBlocks) or "dynamic-int8"


def is_stop(value) -> bool:
    """A drafter entry's "stop_below": a probability in [0, 1) (0: the head's chain is not stopped)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < 1


@dataclass(frozen=True)
class Manifest:
    """Everything the runtime needs to know about a bundle."""

    gamma: int
    max_seq_len: int
    vocab_size: int
    dtype: str
    quantization: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    target: ModelSpec
    draft: ModelSpec | None  # None: no draft model (an EAGLE-3 head given as --draft: the feature drafters run)
    graphs: dict[str, GraphSpec]
    max_batch: int = 1  # requests a batched engine may run together (batched graphs for 2..max_batch rows)
    tokenizer: str | None = None  # relative folder holding tokenizer.json, or None
    chat_template: str | None = None  # relative path of the target tokenizer's Jinja chat template, or None
    ngram: dict[str, Any] | None = None  # {"file", "sha256", "corpus", "tokens"}: the n-gram drafter's table
    validation: dict[str, Any] = field(default_factory=dict)
    tools: dict[str, str] = field(default_factory=dict)
    max_source_len: int | None = None  # encoder-decoder bundles: source tokens per request; None: decoder-only
    decoder_start_token_id: int | None = None  # encoder-decoder bundles: the decoder's first token
    integrity: dict[str, Any] | None = None  # {"algorithm", "files": {path: {"size", "digest"}}}; None: an older bundle
    head: ModelSpec | None = None  # the feature drafter (specdec train-drafter): one decoder layer over the target's features
    feature: dict[str, Any] | None = None  # {"width", "training": {...}}: how the head was trained, and the feature width d
    drafter: dict[str, Any] | None = None  # {"name", "gamma", "why"[, "stop_below"]}: the bundle's default drafter and γ; None: the draft model at gamma
    export_log: str | None = None  # relative path of what the libraries printed during export (not hashed: a bundle loads without it)
    custom_ops: dict[str, Any] | None = None  # {"domain", "ops", "library", "without", "layout"}: specdec's own kernels the graphs use (int8/int4)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise BundleError(
                f"manifest schema_version={self.schema_version}; this specdec reads {SCHEMA_VERSION}: re-export the bundle"
            )
        if self.gamma < 1:
            raise BundleError(f"manifest gamma={self.gamma}; expected >= 1: re-export the bundle")
        if self.custom_ops is not None and self.custom_ops.get("layout") != BLOCKS_LAYOUT:
            raise BundleError(f"manifest custom_ops layout={self.custom_ops.get('layout')!r}: this specdec's MatMulBlocks reads weight layout "
                              f"{BLOCKS_LAYOUT} (panels of 16 columns); the bundle was exported by an earlier specdec: re-export it")  # fmt: skip
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        d = self.drafter
        if d is not None and not (isinstance(d, dict) and isinstance(d.get("name"), str)
                                  and isinstance(d.get("gamma"), int) and 1 <= d["gamma"] <= self.gamma):  # fmt: skip
            raise BundleError(f"manifest drafter={d!r}: expected {{'name': a drafter, 'gamma': 1..{self.gamma}}}; re-export the bundle")
        stop = (d or {}).get("stop_below", 0.0)
        if not is_stop(stop):
            raise BundleError(f"manifest drafter stop_below={stop!r}: expected a probability in [0, 1) (0: off); fix the manifest or re-export the bundle")

    def default_drafter(self) -> tuple[str, int]:
        """(name, γ): what decodes a request that names neither (``specdec-export`` chooses it)."""
        return (self.drafter["name"], self.drafter["gamma"]) if self.drafter else ("model", self.gamma)

    def head_first(self) -> int:
        """The first position the feature head reads (``feature.first``): 0 for specdec's heads,
        1 for EAGLE-3 heads, which pair token j with the target's feature of j - 1 from j = 1."""
        return int((self.feature or {}).get("first", 0))

    def draft_stop(self) -> float:
        """The feature head's chain stops after a draft it gives less than this probability
        (``runtime.proposers.FeatureHead``; the drafter entry's "stop_below", 0: off)."""
        return float((self.drafter or {}).get("stop_below", 0.0))

    @property
    def seq2seq(self) -> bool:
        """An encoder-decoder bundle: requests give a source, decoding starts at decoder_start_token_id."""
        return self.max_source_len is not None

    @property
    def k(self) -> int:
        """Tokens per verify call, γ + 1."""
        return self.gamma + 1

    def graph(self, model: str, role: str, flavour: str = "ort", batch: int = 1) -> tuple[str, GraphSpec]:
        """The (name, spec) of ``model``'s graph for ``role`` in ``flavour`` with ``batch`` rows."""
        for name, g in self.graphs.items():
            if (g.model, g.role, g.flavour, g.batch) == (model, role, flavour, batch):
                return name, g
        have = sorted(f"{g.model}/{g.role}/{g.flavour}/batch {g.batch}" for g in self.graphs.values())
        raise BundleError(
            f"bundle has no {model} {role} graph of flavour {flavour!r} with batch {batch} (it has {', '.join(have)}); "
            "re-export it with specdec-export (--max-batch for batched graphs)"
        )

    def batch_sizes(self) -> tuple[int, ...]:
        """Row counts of the batched calls (the same for both models), ascending: a rows graph's
        bodies above 1 (export/rows.py), or an older bundle's one graph per row count."""
        return tuple(sorted({b for g in self.graphs.values() for b in (g.rows or (g.batch,)) if b > 1}))

    def rows_graph(self, model: str) -> tuple[str, GraphSpec] | None:
        """``model``'s rows graph (one session for every row count), or None (an older bundle's
        graph per row count, or no batched graphs)."""
        return next(((n, g) for n, g in self.graphs.items() if g.model == model and g.rows), None)

    def files(self) -> list[str]:
        """Every file the manifest names, relative to the bundle."""
        out = []
        for g in self.graphs.values():
            out += [g.file, *g.data]
        if self.ngram:
            out.append(self.ngram["file"])
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:  # checked first: an old manifest lacks newer fields
            raise BundleError(f"manifest schema_version={version}; this specdec reads {SCHEMA_VERSION}: re-export the bundle with specdec-export")
        try:
            d = dict(d)
            d["target"] = ModelSpec(**d["target"])
            d["draft"] = ModelSpec(**d["draft"]) if d.get("draft") is not None else None
            if d.get("head") is not None:
                d["head"] = ModelSpec(**d["head"])
            d["graphs"] = {k: GraphSpec(**v) for k, v in d["graphs"].items()}
            if d.get("integrity") is not None:
                d["integrity"] = integrity.check_table(d["integrity"])
            return cls(**d)
        except (KeyError, TypeError) as e:
            raise BundleError(f"manifest is malformed ({e}); re-export the bundle with specdec-export") from None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def inside(bundle: Path, rel: str) -> Path:
    """The path of ``rel`` in ``bundle``; refuses absolute paths and anything that leaves it."""
    root = bundle.resolve()
    p = (root / rel).resolve()
    if Path(rel).is_absolute() or (p != root and root not in p.parents):
        raise BundleError(f"manifest path {rel!r} leaves the bundle {bundle}; refusing to read it")
    return p


def load_manifest(bundle: str | Path, verify: str = "full", *, stamps: bool = True, verify_hashes: bool | None = None) -> Manifest:
    """Read and check ``bundle/manifest.json``: paths stay inside, files exist and match.

    Args:
        bundle: the folder specdec-export wrote.
        verify: "full" (default) checks every file's size and digest: graphs, weights, tokenizer,
            chat template, n-gram table. "size" checks sizes only, for a fast start of a bundle you
            trust: a truncated file is refused, but a bundle with changed bytes (a flaky disk or
            copy, an edit) loads and runs as another model.
        stamps: skip hashing files this user verified before and has not changed since
            (``integrity.Stamps``); False hashes everything (``specdec inspect``).
        verify_hashes: the older spelling; False means verify="size".

    Returns:
        The manifest. A ``BundleError`` names the file that is missing or differs, and how.
    """
    if verify_hashes is not None:
        verify = "full" if verify_hashes else "size"
    if verify not in integrity.MODES:
        raise BundleError(f"verify={verify!r}: expected one of {', '.join(integrity.MODES)}")
    bundle = Path(bundle)
    path = bundle / MANIFEST_NAME
    if not bundle.is_dir():
        raise BundleError(f"bundle {str(bundle)!r} is not a folder; pass the folder specdec-export wrote")
    if not path.is_file():
        raise BundleError(f"{path} is missing; {bundle} is not a complete bundle: re-export with specdec-export")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path} is not valid JSON ({e}); re-export the bundle") from None
    if not isinstance(raw, dict):
        raise BundleError(f"{path} holds {type(raw).__name__}, expected an object; re-export the bundle")
    m = Manifest.from_dict(raw)
    for rel in m.files() + [r for r in (m.tokenizer, m.chat_template) if r]:
        if not inside(bundle, rel).exists():
            raise BundleError(f"bundle file {rel!r} is missing from {bundle}; re-export the bundle")
    integrity.check(_expected(m, bundle, verify), verify, integrity.Stamps() if stamps else None)
    return m


def _loaded(m: Manifest, bundle: Path) -> set[str]:
    """The bundle paths the runtime reads: graphs, their data, n-gram table, chat template, tokenizer files."""
    out = set(m.files()) | ({m.chat_template} if m.chat_template else set())
    if m.tokenizer:
        folder = inside(bundle, m.tokenizer)
        out |= {f"{m.tokenizer.rstrip('/')}/{p.relative_to(folder).as_posix()}" for p in folder.rglob("*") if p.is_file()}
    return out


def _what(m: Manifest, rel: str) -> str:
    """What a bundle file is, for messages."""
    graphs = {g.file: f"graph {name}" for name, g in m.graphs.items()}
    data = {d: f"{g.model} weights" for g in m.graphs.values() for d in g.data}
    named = {**data, **graphs, **({m.ngram["file"]: "n-gram table"} if m.ngram else {}), **({m.chat_template: "chat template"} if m.chat_template else {})}
    if rel in named:
        return named[rel]
    return "tokenizer file" if m.tokenizer and rel.startswith(m.tokenizer.rstrip("/") + "/") else "file"


def _expected(m: Manifest, bundle: Path, verify: str) -> list[integrity.Expected]:
    """What to check: the integrity table, or an older bundle's graph and n-gram sha256 (with a warning)."""
    loaded = _loaded(m, bundle)
    if m.integrity is not None:
        algo, table = m.integrity["algorithm"], m.integrity["files"]
        unhashed = sorted(loaded - set(table))
        if unhashed:
            raise BundleError(f"bundle files {unhashed[:4]} are not in the manifest's integrity table; re-export the bundle with specdec-export")
        return [integrity.Expected(inside(bundle, rel), rel, _what(m, rel), e["size"], algo, e["digest"]) for rel, e in table.items()]
    old = {g.file: g.sha256 for g in m.graphs.values()} | ({m.ngram["file"]: m.ngram["sha256"]} if m.ngram else {})
    unhashed = sorted(loaded - set(old))
    if unhashed and verify == "full":
        warnings.warn(f"bundle {bundle} comes from an older specdec that hashed only its graphs: {', '.join(unhashed[:4])}"
                      f"{' …' if len(unhashed) > 4 else ''} are not verified; re-export it with specdec-export to cover them", stacklevel=3)  # fmt: skip
    return [integrity.Expected(inside(bundle, rel), rel, _what(m, rel), None, "sha256", d) for rel, d in old.items()]
