"""The GPU check's results.json (tools/gpu/check.py, as the device call brought it back) as the
tables docs/gpu.md renders: one list of rows per question.

    python tools/gpu/report.py /work/.device/.../results.json --out docs/bench/gpu
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _count(cmp: dict | None) -> str:
    if not cmp:
        return "–"
    diffs = cmp["first_diff"]
    same = sum(d is None for d in diffs)
    return f"{same} / {len(diffs)}" + ("" if same == len(diffs) else f" (first difference at token {min(d for d in diffs if d is not None)})")


def exact_rows(stages: dict) -> list[dict]:
    rows = []
    for name, stage in stages.items():
        if not name.startswith("exact ") or "result" not in stage:
            continue
        bundle, r = name.removeprefix("exact "), stage["result"]
        rows.append({"bundle": bundle, "drafter": "autoregressive (γ = 0)", "identical_on_device": "–", "identical_to_cpu": _count(r["ar_vs_cpu"])})
        for drafter, d in r["drafters"].items():
            if "refused" in d:
                if "lacks" in d["refused"]:
                    continue  # the bundle has no graph for it: nothing to say about the GPU
                rows.append({"bundle": bundle, "drafter": drafter, "identical_on_device": "refused at load", "identical_to_cpu": d["refused"].split(":", 1)[0]})
                continue
            rows.append({"bundle": bundle, "drafter": drafter, "identical_on_device": _count(d["vs_ar_on_device"]), "identical_to_cpu": _count(d["vs_cpu"])})
        for b in r.get("batches", [r["batch"]] if "batch" in r else []):  # "batch": the first two runs
            rows.append({"bundle": bundle, "drafter": f"BatchEngine, {b['rows']} rows, {b['drafter']}", "identical_on_device": _count(b["vs_ar_on_device"]),
                         "identical_to_cpu": _count(b["vs_cpu"])})  # fmt: skip
    return rows


def traffic_rows(stages: dict) -> list[dict]:
    rows = []
    for name, stage in stages.items():
        if name.startswith("traffic ") and "result" in stage:
            r = stage["result"]
            host = list(r["bound_host_bytes_per_call"].values())
            off = sorted(ops for p, ops in r["ops_by_provider"].items() if p != "CUDAExecutionProvider" for ops in ops)
            rows.append({"bundle": name.removeprefix("traffic "), "kv_mib": round(r["kv_cache_bytes"] / 2**20, 1),
                         "memcpy_per_call": r["memcpy_nodes_per_run"], "memcpy_kib_per_call": round(r["memcpy_bytes_per_run"] / 1024, 1),
                         "host_kib_1": round(host[0] / 1024, 1), "host_kib_k": round(host[1] / 1024, 1), "off_gpu": ", ".join(off) or "none"})  # fmt: skip
    return rows


def speed_rows(stages: dict) -> tuple[list[dict], list[dict]]:
    single, batch = [], []
    for name, stage in stages.items():
        if not name.startswith("speed ") or "result" not in stage:
            continue
        bundle, r = name.removeprefix("speed "), stage["result"]
        for mode, d in r["single"].items():
            if "tok_s" in d:
                acc = "–" if d["acceptance"] is None else f"{d['acceptance']:.2f}"
                single.append({"bundle": bundle, "mode": "autoregressive" if mode == "ar" else mode, "tok_s": d["tok_s"], "speedup": d["speedup"], "acceptance": acc,
                               "load_average": round(r.get("load_average", float("nan")), 1)})  # fmt: skip
        for label, d in r["batch"].items():
            if "tok_s" in d:
                rows, _, mode = label.split(" ")
                batch.append({"bundle": bundle, "rows": int(rows), "mode": "autoregressive" if mode == "ar" else f"speculative ({d['drafter']})",
                              "requests": d["requests"], "tok_s": d["tok_s"], "load_seconds": r.get("batch_load_seconds", "–")})  # fmt: skip
        if "batch_error" in r:
            batch.append({"bundle": bundle, "rows": "–", "mode": r["batch_error"][:160], "requests": "–", "tok_s": "–", "load_seconds": "–"})
    return single, batch


def with_baseline(rows: list[dict], base: list[dict], keys: tuple[str, ...], command: str) -> None:
    """Each row gains its baseline's tok/s (the row with the same ``keys``) and its ratio to it."""
    found = {tuple(b[k] for k in keys): b["tok_s"] for b in base}
    for row in rows:
        b = found.get(tuple(row[k] for k in keys))
        row["baseline_tok_s"] = b if b is not None else "–"
        row["vs_baseline"] = round(row["tok_s"] / b, 2) if isinstance(b, (int, float)) and isinstance(row["tok_s"], (int, float)) else "–"


def peer_rows(stages: dict, single: list[dict]) -> list[dict]:
    rows = []
    for name, stage in stages.items():
        if not name.startswith("transformers ") or "result" not in stage:
            continue
        bundle, r = name.removeprefix("transformers "), stage["result"]
        ours = [s for s in single if s["bundle"] == bundle]
        best = max((s for s in ours if s["mode"] != "autoregressive"), key=lambda s: s["tok_s"], default=None)
        ar = next((s for s in ours if s["mode"] == "autoregressive"), None)
        rows.append({"bundle": bundle, "dtype": r["dtype"], "transformers": r["generate"]["tok_s"], "assisted": r["assisted"]["tok_s"],
                     "load_average": round(r.get("load_average", float("nan")), 1),
                     "assisted_same_tokens": _count(r["assisted_equals_generate"]),
                     "specdec_ar": ar["tok_s"] if ar else "–", "specdec_best": f"{best['tok_s']} ({best['mode']})" if best else "–",
                     "vs_assisted": round(best["tok_s"] / r["assisted"]["tok_s"], 2) if best else "–"})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, nargs="?", help="results.json from the device call")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/bench/gpu")
    ap.add_argument("--baseline", type=Path, help="another results.json of the same session and machine (say --provider cuda): its tok/s beside each speed row, and the ratio")
    args = ap.parse_args()
    if args.results is None:
        ap.error("give results.json")
    data = json.loads(args.results.read_text())
    stages = data["stages"]
    prov = data.get("provenance", {})
    if not prov.get("commit"):  # installed on the device, not a checkout: the commit that was sent
        prov["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    single, batch = speed_rows(stages)
    if args.baseline:
        base = json.loads(args.baseline.read_text())
        base_single, base_batch = (base["speed_rows"], base["batch_rows"]) if "speed_rows" in base else speed_rows(base["stages"])  # reported or raw
        with_baseline(single, base_single, ("bundle", "mode"), base["provenance"]["command"])
        with_baseline(batch, base_batch, ("bundle", "rows", "mode"), base["provenance"]["command"])
        prov["baseline"] = {"command": base["provenance"]["command"], "date": base["provenance"].get("date")}
    env = stages.get("environment", {}).get("result", {})
    body = {
        "provenance": prov,
        "gpu": env.get("gpu", "–"),
        "environment": env,
        "exact_rows": exact_rows(stages),
        "traffic_rows": traffic_rows(stages),
        "speed_rows": single,
        "batch_rows": batch,
        "peer_rows": peer_rows(stages, single),
        "stage_rows": [{"stage": k, "seconds": v.get("seconds", "–"), "outcome": "ok" if "result" in v else (v.get("error") or v.get("skipped", "?"))[:160]}
                       for k, v in stages.items()],  # fmt: skip
        "wall_seconds": data.get("wall_seconds"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(body, indent=1, default=str))
    print(f"wrote {args.out / 'results.json'}: {len(body['exact_rows'])} exactness rows, {len(single)} speed rows, {len(batch)} batch rows")


if __name__ == "__main__":
    main()
