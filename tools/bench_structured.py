"""Structured outputs on a real bundle: validity, the grammar's cost, and what speculation gives.

    python tools/bench_structured.py BUNDLE [--drafter D] [--gamma G] [--rounds 2] [--tokens 160] [--llamacpp GGUF] [--out DIR]

Eight everyday extraction requests (``TASKS``: a person, a recipe, an event, a tool call's
arguments, ...) through the bundle's chat template (plain text without one), each with its JSON
schema. Four modes per
request, interleaved (``specdec.bench.sweep.interleaved``), greedy:

    ar        γ = 0, free text                 ar+json      γ = 0, held to the schema
    spec      the drafter at its γ, free       spec+json    the drafter, held to the schema

Reported per mode: decode tok/s (new tokens / decode time, prefill apart), ms per token, the
share of decode time spent in the grammar (llguidance's masks and matcher steps), acceptance,
tokens per target call, and for the constrained modes how many outputs ended inside
``--tokens`` and how many of those parse and validate (``jsonschema``). The goals it checks:
grammar time <= 10% of a token at γ = 0; spec+json >= 1.2x spec's tok/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specdec.bench.report import footer, write_results
from specdec.bench.sweep import interleaved

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "job": {"type": "string"}, "city": {"type": "string"}},
          "required": ["name", "age", "job", "city"], "additionalProperties": False}  # fmt: skip
TASKS = [
    ("Extract the person from this sentence as JSON: 'Maria Lopez, 34, works as a nurse in Madrid.'", PERSON),
    ("Give a simple pancake recipe as JSON with a name, the number of servings and a list of ingredients.",
     {"type": "object", "properties": {"name": {"type": "string"}, "servings": {"type": "integer", "minimum": 1, "maximum": 20},
                                       "ingredients": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 8}},
      "required": ["name", "servings", "ingredients"], "additionalProperties": False}),
    ("Describe the planet Mars as JSON: its name, number of moons, whether it has rings, and its distance from the sun in million km.",
     {"type": "object", "properties": {"name": {"type": "string"}, "moons": {"type": "integer", "minimum": 0, "maximum": 200},
                                       "has_rings": {"type": "boolean"}, "distance_million_km": {"type": "number"}},
      "required": ["name", "moons", "has_rings", "distance_million_km"], "additionalProperties": False}),
    ("Create a calendar event as JSON for a team meeting next Monday at 10:00 that lasts one hour.",
     {"type": "object", "properties": {"title": {"type": "string"}, "day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]},
                                       "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}, "duration_minutes": {"type": "integer", "minimum": 1, "maximum": 600}},
      "required": ["title", "day", "start", "duration_minutes"], "additionalProperties": False}),
    ("Classify the sentiment of this review as JSON with a label and a confidence: 'The movie was long but wonderful.'",
     {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["label", "confidence"], "additionalProperties": False}),
    ("Describe a laptop for sale as JSON: its name, its price in dollars and whether it is in stock.",
     {"type": "object", "properties": {"name": {"type": "string"}, "price": {"type": "number", "minimum": 0}, "in_stock": {"type": "boolean"}},
      "required": ["name", "price", "in_stock"], "additionalProperties": False}),
    ("List three countries in Europe with their capitals as JSON.",
     {"type": "object", "properties": {"countries": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
         "type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}}, "required": ["country", "capital"],
         "additionalProperties": False}}}, "required": ["countries"], "additionalProperties": False}),
    ("I need the weather in Paris in celsius. Write the arguments of a get_weather call as JSON.",
     {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
      "additionalProperties": False}),
]  # fmt: skip
MODES = ("ar", "ar+json", "spec", "spec+json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--drafter", default=None, help="the speculative modes' drafter [default: the bundle's]")
    ap.add_argument("--gamma", type=int, default=None, help="the speculative modes' γ [default: the bundle's for its drafter]")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--llamacpp", type=Path, default=None, metavar="GGUF",
                    help="also run llama.cpp on this GGUF of the same weights (free and with its json_schema grammar), in its venv")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import jsonschema

    from specdec.runtime import SpeculativeDecoder
    from specdec.serve.chat import bundle_template

    dec = SpeculativeDecoder.load(args.bundle, drafter=args.drafter)
    chat = bundle_template(args.bundle, dec.manifest, dec.codec)
    ask = [text + " Answer with JSON only." for text, _ in TASKS]
    if chat is not None:
        prompts = [dec.codec.encode(chat.render([{"role": "user", "content": t}]), special=False) for t in ask]
    else:  # a bundle without a chat template (the demo pair): the request as plain text
        prompts = [dec.codec.encode(t + "\n") for t in ask]
    runs: dict[str, list] = {m: [] for m in MODES}

    def go(mode: str, i: int):
        kw = {"max_new_tokens": args.tokens}
        if mode.startswith("ar"):
            kw["gamma"] = 0
        elif args.gamma is not None:
            kw["gamma"] = args.gamma
        if mode.endswith("+json"):
            kw["structured_outputs"] = {"json": TASKS[i][1]}
        return dec.generate(prompts[i], **kw)

    for m in MODES:  # warm-up: lazy initialisation; every schema compiled once (the cache keeps them, as a server's does)
        for i in range(len(TASKS)) if m.endswith("+json") else (0,):
            go(m, i)
    for _, (m, i) in interleaved([(m, i) for i in range(len(TASKS)) for m in MODES], args.rounds):
        res = go(m, i)
        runs[m].append((i, res))
    rows = []
    for m in MODES:
        stats = [r.stats for _, r in runs[m]]
        decode = sum(s.total_seconds - s.prefill_seconds for s in stats)
        new = sum(s.new_tokens for s in stats)
        drafted, accepted, calls = sum(s.drafted for s in stats), sum(s.accepted for s in stats), sum(s.target_calls for s in stats)
        finished = valid = 0
        for i, r in runs[m]:
            if m.endswith("+json") and r.stats.finish_reason == "eos":
                finished += 1
                try:
                    jsonschema.validate(json.loads(r.text), TASKS[i][1])
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
        drafter, gamma = stats[0].drafter, stats[0].gamma
        rows.append({"mode": m, "drafter": "-" if m.startswith("ar") else drafter, "gamma": 0 if m.startswith("ar") else gamma,
                     "requests": len(stats), "new_tokens": new, "tok_s": new / decode, "ms_per_token": 1000 * decode / new,
                     "grammar_share": sum(s.grammar_seconds for s in stats) / decode, "acceptance": accepted / drafted if drafted else None,
                     "tokens_per_call": new / calls if calls else None, "finished": finished if m.endswith("+json") else None,
                     "valid": valid if m.endswith("+json") else None,
                     "median_tok_s": statistics.median(s.new_tokens / (s.total_seconds - s.prefill_seconds) for s in stats)})  # fmt: skip
    if args.llamacpp is not None:
        rows += llamacpp_rows(args, prompts, jsonschema)
    by = {r["mode"]: r for r in rows}
    summary = {"json_over_free_spec": by["spec+json"]["tok_s"] / by["spec"]["tok_s"], "json_over_free_ar": by["ar+json"]["tok_s"] / by["ar"]["tok_s"],
               "spec_json_over_ar_json": by["spec+json"]["tok_s"] / by["ar+json"]["tok_s"],
               "grammar_share_ar": by["ar+json"]["grammar_share"], "valid": f"{by['ar+json']['valid'] + by['spec+json']['valid']}"
               f" / {by['ar+json']['finished'] + by['spec+json']['finished']}"}  # fmt: skip
    if "llama.cpp+json" in by:
        summary["spec_json_over_llamacpp_json"] = by["spec+json"]["tok_s"] / by["llama.cpp+json"]["tok_s"]
        summary["ar_json_over_llamacpp_json"] = by["ar+json"]["tok_s"] / by["llama.cpp+json"]["tok_s"]
    head = (f"bundle {args.bundle}: {len(TASKS)} JSON-schema requests (tools/bench_structured.py TASKS) {'through the chat template' if chat else 'as text'} x "
            f"{args.rounds} rounds, greedy, up to {args.tokens} new tokens, interleaved; drafter {drafter} at γ={gamma}")
    lines = [head, "", "| mode | drafter | γ | tok/s | ms/token | grammar share of decode | acceptance | tokens/call | ended (EOS) | valid |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = lambda x, fmt: "–" if x is None else format(x, fmt)  # noqa: E731
        lines.append(f"| {r['mode']} | {r['drafter']} | {r['gamma']} | {r['tok_s']:.1f} | {r['ms_per_token']:.1f} | {f(r['grammar_share'], '.1%')} | "
                     f"{f(r['acceptance'], '.3f')} | {f(r['tokens_per_call'], '.2f')} | {f(r['finished'], 'd')} | {f(r['valid'], 'd')} |")  # fmt: skip
    lines += ["", f"spec+json / spec: **{summary['json_over_free_spec']:.2f}x**; ar+json / ar: {summary['json_over_free_ar']:.2f}x; "
              f"spec+json / ar+json: {summary['spec_json_over_ar_json']:.2f}x; grammar share at γ = 0: {summary['grammar_share_ar']:.1%}; "
              f"valid outputs among those that ended: {summary['valid']}"]  # fmt: skip
    if "spec_json_over_llamacpp_json" in summary:
        lines += ["", f"spec+json / llama.cpp+json: **{summary['spec_json_over_llamacpp_json']:.2f}x**; "
                  f"ar+json / llama.cpp+json: {summary['ar_json_over_llamacpp_json']:.2f}x (llama.cpp: {args.llamacpp.name}, "
                  f"{args.threads} threads, its own JSON grammar from the same schemas)"]  # fmt: skip
    md = "\n".join(lines) + "\n"
    prov = write_results(args.out, md, {"rows": rows, "summary": summary})
    print(md + (footer(prov) if prov else ""))
    return 0


def llamacpp_rows(args, prompts: list[list[int]], jsonschema) -> list[dict]:
    """llama.cpp on the same prompt ids and schemas (specdec/bench/peers/workers/worker.py
    llama-structured, in bench-peers' llama.cpp venv, made on first use)."""
    import subprocess
    import tempfile

    from specdec.bench.peers.venv import LLAMACPP, WORKER, default_work, ensure_venv

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        spec = {"gguf": str(args.llamacpp), "prompts": prompts, "schemas": [s for _, s in TASKS], "tokens": args.tokens, "threads": args.threads,
                "rounds": args.rounds, "out": str(out)}  # fmt: skip
        subprocess.run([str(ensure_venv(LLAMACPP, default_work())), str(WORKER), "llama-structured", json.dumps(spec)], check=True)
        got = json.loads(out.read_text())
    rows = []
    for mode in ("free", "json"):
        runs = [r for r in got["runs"] if r["mode"] == mode]
        new, decode = sum(r["new_tokens"] for r in runs), sum(r["decode_seconds"] for r in runs)
        finished = valid = 0
        for r in runs:
            if mode == "json" and r["finish"] == "stop":
                finished += 1
                try:
                    jsonschema.validate(json.loads(r["text"]), TASKS[r["i"]][1])
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
        rows.append({"mode": "llama.cpp" + ("+json" if mode == "json" else ""), "drafter": f"llama-cpp-python {got['version']}", "gamma": 0,
                     "requests": len(runs), "new_tokens": new, "tok_s": new / decode, "ms_per_token": 1000 * decode / new, "grammar_share": None,
                     "acceptance": None, "tokens_per_call": None, "finished": finished if mode == "json" else None,
                     "valid": valid if mode == "json" else None,
                     "median_tok_s": statistics.median(r["new_tokens"] / r["decode_seconds"] for r in runs)})  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
