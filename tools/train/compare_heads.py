"""Held-out one-step figures of feature heads on the same conversations (issue 44's table of what was tried).

    python tools/train/compare_heads.py --data DIR/corpus --features DIR/features --gguf G --heads models/smollm2-draft OUT/head

DIR/corpus is a ``specdec distill`` folder, DIR/features the ``--features-cache`` of
tools/gpu/drafter.py (each answer's features as JOB.npz). Every head is evaluated on the folder's
held-out-topic conversations (export/head_data.py ``distilled``), by kind (chat, code) and
temperature, as ``export/train_head.py evaluate`` does: α at T = 1 and argmax agreement, one step
from the target's own features. On the greedy (T = 0) groups also the unrolled greedy chain
(``chain_agreement``, ``--depth`` drafts): the share of positions whose first k drafts all equal
the target's argmax, the head's tokens per verify call at γ = 1..depth, and the same counted
where decoding starts its calls (``decoded_tokens_per_call``: what `specdec bench` measures).

``--bundle B --bench chat,code`` adds the benchmark's own prompts (`specdec bench --corpus
chat|chat-code`, through B's chat template) as groups "bench chat" / "bench code": their greedy
answers (``--bench-tokens``, transformers) and features, so a head's figures on the corpus's
held-out topics and on the prompts it is benchmarked on sit side by side. Prints a JSON record.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np


def head_rows(heads: dict[str, dict[str, dict[str, float]]]) -> list[dict[str, str]]:
    """A row per head for docs' bench_table: "α / argmax" per group, the group's name as a field
    ("chat T=0" -> chat_T_0)."""
    field = lambda k: "".join(c if c.isalnum() else "_" for c in k).replace("__", "_")  # noqa: E731
    return [{"head": head, **{field(k): f"{v['alpha_t1']:.3f} / {v['argmax_t0']:.3f}" for k, v in groups.items()}} for head, groups in heads.items()]


def chain_rows(chains: dict[str, dict[str, dict]]) -> list[dict[str, str]]:
    """A row per head and greedy group for docs' bench_table: the chain's shares by depth and the
    tokens per call at the deepest γ."""
    return [{"head": head, "group": group, "chain": " / ".join(f"{c:.3f}" for c in v["chain"]), "tokens_per_call": f"{v['tokens_per_call'][-1]:.2f}"}
            for head, groups in chains.items() for group, v in groups.items()]  # fmt: skip


def bench_group(model, bundle: Path, kind: str, tokens: int):
    """The benchmark's prompts of ``kind`` (specdec.bench.corpus ``chat_prompts``), each with
    its greedy answer (transformers, up to ``tokens``) and features: Sequences trained on the answer."""
    import torch

    from specdec.bench.corpus import CHAT_CORPORA, chat_prompts
    from specdec.distill.hf import features
    from specdec.export.head_data import Sequences, conversation
    from specdec.manifest import load_manifest
    from specdec.runtime.text import TextCodec

    manifest = load_manifest(bundle)
    count = {"chat": 12, "code": 8}.get(kind)
    if kind not in CHAT_CORPORA.values() or count is None:
        sys.exit(f"--bench {kind}: expected chat or code")
    answers = []
    for job, p in enumerate(chat_prompts(bundle, manifest, TextCodec.from_bundle(bundle, manifest), kind, count)):
        out = model.generate(torch.tensor([p]), max_new_tokens=tokens, do_sample=False)
        answers.append(SimpleNamespace(job=job, prompt=list(p), answer=out[0, len(p) :].tolist()))
    feats = {job: f for job, f, _ in features(model, answers, 4)}
    group = Sequences([], [], feats=[])
    for a in answers:
        ids, mask = conversation(a, manifest.max_seq_len)
        group.ids.append(ids)
        group.mask.append(mask)
        group.feats.append(feats[a.job][: len(ids)])
    return group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--features", type=Path, required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", type=Path, help="the target's GGUF")
    src.add_argument("--model", type=Path, help="the target's transformers folder")
    ap.add_argument("--heads", type=Path, nargs="+", required=True, help="folders with head_config.json and head.safetensors")
    ap.add_argument("--depth", type=int, default=3, help="drafts per greedy chain on the T = 0 groups (0: none)")
    ap.add_argument("--bundle", type=Path, help="a bundle of the target (its chat template) for --bench")
    ap.add_argument("--bench", default="", help="also the benchmark's prompts of these kinds: chat, code (comma-separated)")
    ap.add_argument("--bench-tokens", type=int, default=128)
    ap.add_argument("--draft-temperatures", default="", help="also α at T = 1 when the head drafts at these temperatures τ (comma-separated)")
    args = ap.parse_args()
    if args.bench and args.bundle is None:
        ap.error("--bench needs --bundle (the prompts go through its chat template)")
    try:
        taus = tuple(float(t) for t in args.draft_temperatures.split(",") if t)
    except ValueError:
        taus = (0.0,)
    if any(t <= 0 for t in taus):
        ap.error(f"--draft-temperatures {args.draft_temperatures!r}: expected positive numbers, comma-separated (e.g. 0.8,0.9)")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from drafter import load_target, target_tables

    from specdec.bench.report import provenance
    from specdec.distill.run import read_prompts
    from specdec.distill.shards import answers
    from specdec.export.head import load_head
    from specdec.export.head_data import Sequences, conversation, held_out_topic
    from specdec.export.train_head import chain_agreement, evaluate

    plan = json.loads((args.data / "plan.json").read_text())
    reqs, temps = plan["requests"], plan["settings"]["temperatures"]
    _, _, max_seq = read_prompts(args.data)
    groups: dict[str, Sequences] = {}
    for a in answers(args.data):
        req = reqs[a.job // len(temps)]
        if not held_out_topic(req["topic"]):
            continue
        with np.load(args.features / f"{a.job}.npz") as z:
            f = z["f"]
        ids, mask = conversation(a, max_seq)
        for key in (f"{req['kind']} T={temps[a.job % len(temps)]:g}", "all"):
            g = groups.setdefault(key, Sequences([], [], feats=[]))
            g.ids.append(ids)
            g.mask.append(mask)
            g.feats.append(f[: len(ids)])
    model = load_target(args.gguf, args.model, "cpu")
    for kind in filter(None, args.bench.split(",")):
        groups[f"bench {kind} T=0"] = bench_group(model, args.bundle, kind, args.bench_tokens)
    embed, head_t, tied = target_tables(model)
    out = {"provenance": {**provenance(), "command": " ".join(["python", "tools/train/compare_heads.py", *sys.argv[1:]])},
           "conversations": {k: len(g) for k, g in sorted(groups.items())}, "positions": {k: g.trained for k, g in sorted(groups.items())}, "heads": {}}  # fmt: skip
    for folder in args.heads:
        head, _ = load_head(folder, embed, head_t, tied)
        out["heads"][str(folder)] = {k: evaluate(head, g, draft_temperatures=taus) for k, g in sorted(groups.items())}
        if args.depth:
            out.setdefault("chains", {})[str(folder)] = {k: chain_agreement(head, g, args.depth) for k, g in sorted(groups.items()) if k.endswith(" T=0")}
        print(folder, out["heads"][str(folder)], flush=True, file=sys.stderr)
    out["head_rows"] = head_rows(out["heads"])
    if args.depth:
        out["chain_rows"] = chain_rows(out["chains"])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
