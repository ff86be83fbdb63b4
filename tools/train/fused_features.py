"""EAGLE-3's fused features against the shipped head, side by side (issue 44's table of what was tried).

    python tools/train/fused_features.py --data DIR/corpus --gguf G --init models/smollm2-draft \\
        --layers 3,15 --conversations 2000 --train-minutes 10 --out OUT

The shipped head's first drafting pass reads the target's last hidden state f (the LM head's
input). EAGLE-3 reads a fusion of a low, a middle and a high layer instead. Whether that pays
for this target is measured here before the export and the runtime carry it:

  A  the head of --init, trained on for --train-minutes (its first pass reads f);
  B  the same head with a ``fuse`` module, trained on for the same time on the same batches: its
     first pass reads W [f ; rms(h_a) ; rms(h_b)], h_l the target's hidden state after decoder
     layer l (--layers), rms() without weights. W starts at [I 0 0], so B starts exactly as A;
     the passes after the first read the head's own output in both, as drafting does.

Both train on a seeded sample of --conversations of the folder's training conversations and
are measured on all of its held-out-topic ones (export/head_data.py ``distilled``): α at T = 1
and argmax agreement one step from the target's features (``evaluate``), and on the greedy
answers the unrolled chain (``chain_agreement``). The features (f and the layers', one forward
each, bfloat16 autocast as tools/gpu/drafter.py's) are kept in OUT/features as JOB.npy. Prints
and writes OUT/fused.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn


class Fuse(nn.Module):
    """[f ; h_a ; h_b ...] [.., k d] -> W [f ; rms(h_a) ; ...] [.., d], W [d, k d] starting at [I 0 ...]."""

    def __init__(self, d: int, k: int):
        super().__init__()
        self.d = d
        self.w = nn.Linear(k * d, d, bias=False)
        with torch.no_grad():
            self.w.weight.zero_()
            self.w.weight[:, :d] = torch.eye(d)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        d = self.d
        extra = f[..., d:].unflatten(-1, (-1, d))  # [.., k - 1, d]
        extra = extra * torch.rsqrt(extra.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(extra.dtype)
        return self.w(torch.cat([f[..., :d], extra.flatten(-2)], -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="a specdec distill folder with top-K labels (tools/gpu/drafter.py --relabel)")
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--init", type=Path, required=True, help="the head both arms go on from")
    ap.add_argument("--layers", default="3,15", help="decoder layers whose outputs are fused with f (1-based)")
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--train-minutes", type=float, default=10.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--lr", type=float, default=7e-4)
    ap.add_argument("--rows", type=int, default=16, help="answers per feature forward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from drafter import load_target, target_tables
    from tqdm import tqdm

    from specdec.bench.report import provenance
    from specdec.distill.hf import features
    from specdec.distill.run import read_prompts
    from specdec.distill.shards import answers
    from specdec.export.head import load_head
    from specdec.export.head_data import Sequences, conversation, held_out_topic
    from specdec.export.train_head import Recipe, chain_agreement, evaluate, fit

    layers = tuple(int(x) for x in args.layers.split(","))
    plan = json.loads((args.data / "plan.json").read_text())
    reqs, temps = plan["requests"], plan["settings"]["temperatures"]
    _, _, max_seq = read_prompts(args.data)
    every = list(answers(args.data))
    held = [a for a in every if held_out_topic(reqs[a.job // len(temps)]["topic"])]
    pool = [a for a in every if not held_out_topic(reqs[a.job // len(temps)]["topic"])]
    pick = np.random.default_rng(args.seed).choice(len(pool), min(args.conversations, len(pool)), replace=False)
    train = [pool[i] for i in sorted(pick)]

    model = load_target(args.gguf, None, "cpu")
    cache = args.out / "features"
    cache.mkdir(parents=True, exist_ok=True)
    todo = [a for a in train + held if not (cache / f"{a.job}.npy").is_file()]
    t0 = time.perf_counter()
    with tqdm(total=sum(len(a.prompt) + len(a.answer) for a in todo), unit="tok", unit_scale=True, desc="features", mininterval=30, disable=not todo) as bar:
        for job, f, _ in features(model, todo, args.rows, bf16=True, layers=layers):
            np.save(cache / f"{job}.npy", f)
            bar.update(len(f))
    t_feat = time.perf_counter() - t0

    def sequences(group, greedy_only=False) -> Sequences:
        s = Sequences([], [], feats=[], top=[])
        for a in group:
            if greedy_only and temps[a.job % len(temps)] != 0:
                continue
            ids, mask = conversation(a, max_seq)
            s.ids.append(ids)
            s.mask.append(mask)
            s.top.append((a.top_id[: int(mask.sum())], a.top_lp[: int(mask.sum())]))
            s.feats.append(np.load(cache / f"{a.job}.npy")[: len(ids)])
        return s

    train_seqs, held_seqs, greedy = sequences(train), sequences(held), sequences(held, greedy_only=True)
    embed, head_t, tied = target_tables(model)
    recipe = Recipe(steps=10**6, batch=args.batch, window=256, windows=10**9, lr=args.lr, unroll=args.unroll, draft_vocab=8192, bf16=True, seed=args.seed)
    out = {"provenance": {**provenance(), "command": " ".join(["python", "tools/train/fused_features.py", *sys.argv[1:]])},
           "layers": list(layers), "train_conversations": len(train_seqs), "train_tokens": train_seqs.tokens, "held_out_conversations": len(held_seqs),
           "greedy_held_out": len(greedy), "features_seconds": round(t_feat, 1), "arms": {}}  # fmt: skip
    for arm in ("A", "B"):
        head, _ = load_head(args.init, embed, head_t, tied)
        recipe = replace(recipe, draft_vocab=head.cfg.draft_vocab)
        if arm == "B":
            head.fuse = Fuse(embed.shape[1], 1 + len(layers))
        torch.manual_seed(args.seed)
        record = fit(head, train_seqs, held_seqs, recipe, "cpu", lambda s: print(arm, s, flush=True), 60 * args.train_minutes)
        record["chain_greedy"] = chain_agreement(head, greedy, 3)
        record["chain_greedy_before"] = out["arms"]["A"]["chain_greedy_before"] if arm == "B" else None
        if arm == "A":
            start, _ = load_head(args.init, embed, head_t, tied)
            record["chain_greedy_before"] = chain_agreement(start.eval(), greedy, 3)
        record.pop("log")
        out["arms"][arm] = record
        print(arm, json.dumps(record), flush=True)
    (args.out / "fused.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
