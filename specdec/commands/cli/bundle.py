"""The bundle's commands: ``export`` (and ``specdec-export``), ``inspect``, ``push``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

from specdec.commands.cli.options import BUNDLE, with_progress
from specdec.errors import ConfigError


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
@click.option("--feature-drafter", default=None, help="A feature head to add: a folder from specdec train-drafter --save, or an EAGLE-3 head "
              "(folder or hub id) as Speculators, EAGLE or SpecForge save it; the target's graphs then return their features (--drafter feature).")
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
        manifest = with_progress("specdec-export", lambda report: export_bundle(cfg, Progress(report)), steps, phases=sys.stdout)
        click.echo(summary(cfg.out, manifest, bundle_size(cfg.out)))
        if uri:  # validated above; push checks every digest again and writes the manifest last
            push(cfg.out, uri)
            click.echo(f"pushed to {uri}; serve it with: specdec serve {uri}")


def summary(out: Path, m, size: int) -> str:
    """A short human summary of a bundle."""
    lines = [f"bundle {out}  ({size / 2**20:.1f} MiB, schema {m.schema_version})"]
    for role in ("target", "draft", "head"):
        s = getattr(m, role)
        if s is None:
            if role == "draft":
                lines.append("  draft  none (the bundle drafts with its feature head)")
            continue
        lines.append(
            f"  {role:6} {s.source}  {s.family}  {s.parameters / 1e6:.2f}M params  "
            f"{s.num_layers} layers  {s.num_heads}/{s.num_kv_heads} heads  head_dim {s.head_dim}"
        )
    quant = f"  quantization {m.quantization}" if m.quantization else ""
    if m.draft is not None and m.target.quantization != m.draft.quantization:
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


@click.command("inspect")
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


@click.command("push")
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
