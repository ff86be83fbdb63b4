"""What bundle verification costs: hashing throughput, and load times with and without it.

    python tools/bench_load.py [--bundle DIR ...] [--out docs/bench/integrity/results.json]

Hashing: one file of --hash-mib MiB (page cache warm), read with ``integrity.digest`` per
algorithm (BLAKE3 on all cores, as load uses it) and with BLAKE3 on one core. Per bundle
(default: the demo bundle, exported on first use): ``load_manifest`` with verify="full" and no
stamps (a first load, or ``specdec inspect``), "full" with this user's stamps (a later load of
the unchanged bundle), and "size"; then ``SpeculativeDecoder.load`` (manifest, sessions,
tokenizer) in the same three ways. Medians of --repeat runs; files are in the page cache, so a
first load from a cold disk adds its read time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from specdec import integrity
from specdec.manifest import load_manifest


def timed(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def hashing(mib: int, repeat: int) -> dict:
    """GB/s and s/GB of each algorithm over one file of ``mib`` MiB."""
    import blake3

    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/tmp")) as f:
        block = os.urandom(1 << 20)
        for _ in range(mib):
            f.write(block)
        f.flush()
        path = Path(f.name)
        integrity.digest(path, "sha256")  # into the page cache
        one_core = functools.partial(_blake3_one_core, path, blake3)
        runs = {name: functools.partial(integrity.digest, path, name) for name in integrity.ALGORITHMS} | {"blake3 (1 thread)": one_core}
        out = {}
        for name, fn in runs.items():
            s = timed(fn, repeat)
            out[name] = {"GB_per_s": round(mib * (1 << 20) / s / 1e9, 3), "s_per_GB": round(s / (mib * (1 << 20) / 1e9), 3)}
    return {"file_MiB": mib, "algorithms": out}


def _blake3_one_core(path: Path, blake3) -> str:
    h = blake3.blake3(max_threads=1)
    with open(path, "rb", buffering=0) as f:
        while block := f.read(integrity.BLOCK):
            h.update(block)
    return h.hexdigest()


def bundle_figures(bundle: Path, repeat: int) -> dict:
    """Load times of ``bundle`` in each verification mode (manifest only, then a whole decoder)."""
    m = load_manifest(bundle, verify="size")
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    hashed = sum(e["size"] for e in (m.integrity or {"files": {}})["files"].values())
    modes = {
        "full, no stamps (first load; specdec inspect)": dict(verify="full", stamps=False),
        "full, stamped (a later load of the unchanged bundle)": dict(verify="full"),
        "size (opt-out: sizes only)": dict(verify="size"),
    }
    integrity.RACY_NS = 0  # the bundle may be minutes old; stamp it now (the bench does not write it)
    load_manifest(bundle)  # the stamps the "stamped" rows use
    out = {"bundle": str(bundle), "bytes": size, "hashed_bytes": hashed, "algorithm": (m.integrity or {}).get("algorithm", "sha256 (graphs only)"),
           "load_manifest_s": {k: round(timed(lambda kw=kw: load_manifest(bundle, **kw), repeat), 4) for k, kw in modes.items()}}  # fmt: skip
    try:
        import specdec.runtime.decoder as decoder

        real = decoder.load_manifest
        loads = {}
        for k, kw in modes.items():  # the decoder loads with the defaults; each mode is patched in
            decoder.load_manifest = functools.partial(real, **kw)
            loads[k] = round(timed(lambda: decoder.SpeculativeDecoder.load(bundle), repeat), 4)
        decoder.load_manifest = real
        out["decoder_load_s"] = loads
    except Exception as e:  # the runtime is not this tool's subject: record why it could not load
        out["decoder_load_s"] = f"not measured: {type(e).__name__}: {e}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, action="append", help="A bundle folder (repeatable) [default: the demo bundle].")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/integrity/results.json"))
    ap.add_argument("--hash-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    if not a.bundle:
        from specdec.demo import bundle_for, default_models

        a.bundle = [bundle_for(default_models())[0]]
    results = {
        "command": "python " + " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "processor": _cpu(), "python": platform.python_version(), "blake3": _version("blake3"),
                    "load_average": os.getloadavg()},  # shared cores: above the core count, figures run slow
        "note": "page cache warm (files read before timing); medians of --repeat runs; a cold disk adds its read time to a first load",
        "hashing": hashing(a.hash_mib, a.repeat),
        "bundles": [bundle_figures(b, a.repeat) for b in a.bundle],
    }
    rates = results["hashing"]["algorithms"]
    results["first_load_hashing_s"] = {  # from the rates above: a 538 MB real-model bundle, an 8B fp16 model
        f"{gb} GB": {name: round(gb * r["s_per_GB"], 2) for name, r in rates.items()} for gb in (0.538, 16)
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


def _cpu() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _version(pkg: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
