"""specdec-export: HF target + draft -> a validated, self-describing bundle.

Order matters for the user: everything that can be refused from configs, tokenizers and
flags is refused before any weights load; graphs are written to a staging folder; the bundle
appears at ``out`` only after validation passed.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata as md
import math
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specdec.errors import ExportError
from specdec.export.bundle import check_destination, commit, staging
from specdec.export.config import ExportConfig, read_sources
from specdec.export.gguf_file import one_parse
from specdec.export.kinds import KINDS, ExportContext
from specdec.export.logs import LOG_FILE, ExportLog, captured
from specdec.export.ngram import write_table
from specdec.export.plans import GraphPlan, planned_graphs
from specdec.export.recommend import measure
from specdec.export.source import Source, load_model, parameter_count
from specdec.export.suggestion import default_drafter, headless_drafter
from specdec.manifest import GraphSpec, Manifest, ModelSpec, sha256_of


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


def _tools() -> dict[str, str]:
    out = {}
    for pkg in ("specdec", "torch", "transformers", "onnx", "onnxscript", "onnxruntime"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


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
    if cfg.head() is None and cfg.draft is not None and (Path(cfg.draft) / "head_config.json").is_file():
        fallback = headless_drafter(Path(cfg.draft), cfg)
        warnings.warn(f"{cfg.draft} holds a feature head too; it is left out of this {cfg.quantize or cfg.dtype} bundle "
                      f"(the head reads the target's float32 tables): its default drafter is {fallback['name'] + ' or the draft model, the faster measured here' if fallback else 'the draft model'}",
                      stacklevel=2)  # fmt: skip
    with one_parse():  # a GGUF source is parsed once for its header, config, tokenizer and weights
        progress("read configs")
        read = read_sources(cfg)
        with captured(log):
            return _build(cfg, read, fallback, progress, log)


def _build(cfg: ExportConfig, read: tuple[dict[str, Source], int | None, int], fallback: dict | None, progress: Progress,
           log: ExportLog) -> Manifest:  # fmt: skip
    """Load the weights, write and validate every graph, commit the bundle."""
    from specdec.export.graphs import TORCH_DTYPES
    from specdec.export.tokenizer_files import save_tokenizer
    from specdec.export.agreement import check, text_tokens

    sources, max_source, max_seq = read
    progress("load weights")
    models = {"target": load_model(sources["target"])}
    if "draft" in sources:  # none when the bundle's drafter is an EAGLE-3 head given as --draft
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
        manifest = _manifest(cfg, target, specs, graphs, max_seq, tokenizer=tokenizer, chat_template=chat_template, ngram=ngram,
                             validation=_validation(figures, tols), max_source=max_source)  # fmt: skip
        if (head := cfg.head()) is not None:
            progress("feature drafter")
            manifest = _feature_drafter(tmp, manifest, head, cfg.head_quantization(), sources["target"].config)
        if head is not None or fallback is not None:  # a choice to make: measured here, the folder's suggestion among the modes
            manifest = dataclasses.replace(manifest, drafter=measure(tmp, manifest, default_drafter(head, cfg) if head else fallback, progress))
        progress("write bundle")
        (tmp / LOG_FILE).write_text(log.text())
        manifest = dataclasses.replace(manifest, export_log=LOG_FILE, custom_ops=_custom_ops(manifest.graphs, tmp))
        manifest = commit(tmp, cfg.out, manifest)  # with every file's size and digest
    return manifest


def _validation(figures: dict, tols: dict) -> dict:
    """The manifest's ``validation``: every checked graph's figures and the tolerance the target's
    met (the draft's too, where it differs)."""
    from specdec.export.agreement import NEAR_TIE

    tol = tols["target"]
    as_json = lambda t: {"rel": t.rel if math.isfinite(t.rel) else None, "min_top1": t.min_top1, "near_tie": NEAR_TIE,  # noqa: E731
                         "min_text_top1": t.min_text_top1, "max_text_kl": t.max_text_kl if math.isfinite(t.max_text_kl) else None}
    validation = {"tolerance": as_json(tol), **figures}
    if tols.get("draft", tol) != tol:
        validation["draft_tolerance"] = as_json(tols["draft"])
    return validation


def _feature_drafter(tmp: Path, manifest: Manifest, head_dir: Path, quantize: str | None, target_config) -> Manifest:
    """The staged bundle with its target's features exposed and a saved feature head added,
    checked against PyTorch; its matrices in ``quantize``'s blocks (the drafts' precision) or
    float32. The head: specdec train-drafter --save's, or an EAGLE-3 head as Speculators,
    EAGLE or SpecForge save it (export/eagle3.py: the target graphs then return its fused
    auxiliary layers)."""
    import torch

    from specdec.export import eagle3
    from specdec.export.feature import add_eagle3, add_head, expose_features, tables
    from specdec.export.head import load_head

    if not eagle3.is_eagle3(head_dir):
        manifest = expose_features(tmp, manifest)
        embed, head_t, tied = tables(tmp, manifest)
        head, record = load_head(head_dir, torch.from_numpy(embed), torch.from_numpy(head_t), tied)
        return add_head(tmp, manifest, head, {**record, "loaded_from": str(head_dir)}, quantize=quantize)
    spec = eagle3.read(head_dir)
    layers = eagle3.check_target(spec, head_dir, target_config)
    return add_eagle3(tmp, manifest, spec, layers, {"loaded_from": str(head_dir)}, quantize, source=f"EAGLE-3 head {head_dir}")


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
        draft=specs.get("draft"),
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
    for model in sorted({g.model for g in graphs.values()}):
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
    for model in sorted({p.model for p in plans.values()}):
        names = {plans[n].batch: n for n in graphs if plans[n].kind in ROWS_KINDS and plans[n].model == model}
        if not names:
            continue
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
    from specdec.export.agreement import tolerance

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
