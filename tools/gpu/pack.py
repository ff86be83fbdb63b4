"""Pack what a GPU check needs beyond the slim tree into pieces that each fit one device call.

The GPU test machine (one H100, Python 3.12, torch 2.11, transformers 5.x, a CPU-only
onnxruntime, no network) takes at most 64 MiB per call, working tree included. What the check
needs is ~450 MB: onnxruntime-gpu (CUDA 13 build), transformers 4.57 and the tokenizers /
huggingface_hub it pins, gguf, blake3, the demo pair, the SmolLM2 draft and its GGUF target, and
the bundles exported here (--prebuilt). This script downloads the wheels from the package index, unpacks them (an unpacked wheel on
PYTHONPATH is an install), adds the models, and writes one xz-compressed tar split into
pieces of --piece-mib under --out, with the payload's sha256 and the GGUF's size beside them:

    python tools/gpu/pack.py --out .gpu        # here, once (~4 min on 2 cores)

docs/gpu.md gives the whole procedure: slim tree, one device call per piece, then
tools/gpu/check.sh joins them and runs the check.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The device image's Python; the wheels must match it.
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
            *sum((["--platform", f"manylinux_2_{n}_x86_64"] for n in (17, 27, 28)), []), "--platform", "manylinux2014_x86_64"]  # fmt: skip
WHEELS = [
    "onnxruntime-gpu==1.31.1",  # links libcublas.so.13 / libcudart.so.13: the image's CUDA 13 pip libraries
    "transformers==4.57.6",  # the export stack's version (the image has 5.x)
    "tokenizers==0.22.2",  # transformers 4.57 refuses the image's 0.23 at import
    "huggingface_hub==0.36.2",  # ... and its 1.x
    "gguf==0.19.0",  # transformers' GGUF loader
    "blake3==1.0.11",  # specdec's bundle digests
]
# Parts of the wheels no check runs: TensorRT's provider library (no TensorRT there) and
# onnxruntime's own graph tools.
DROP = ("onnxruntime/capi/libonnxruntime_providers_tensorrt.so", "onnxruntime/transformers/", "onnxruntime/tools/", "onnxruntime/quantization/")
GGUF = "gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO = ["models/demo/target", "models/demo/draft", "models/demo/head"]  # sent only where a demo bundle is exported there
SMOLLM2 = ["models/smollm2-draft"]  # with onnxruntime-gpu (the check): transformers' assisted generation drafts with it


def download(dest: Path, ort: bool = True) -> list[Path]:
    names = [w for w in WHEELS if ort or not w.startswith("onnxruntime")]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(dest), *names], check=True)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != len(names):
        raise SystemExit(f"expected {len(names)} wheels in {dest}, found {[w.name for w in wheels]}")
    return wheels


def add_wheel(tar: tarfile.TarFile, wheel: Path, prefix: str) -> None:
    """Unpack ``wheel`` into the tar under ``prefix``/, without the parts in DROP."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir() or info.filename.startswith(DROP):
                continue
            data = z.read(info)
            member = tarfile.TarInfo(f"{prefix}/{info.filename}")
            member.size, member.mode = len(data), 0o755 if info.filename.endswith(".so") or ".so." in info.filename else 0o644
            tar.addfile(member, io.BytesIO(data))


def smollm2_gguf() -> Path:
    sys.path.insert(0, str(ROOT))
    from specdec.commands.demo import smollm2_gguf as find

    return find()


def _exported(build: Path, name: str) -> bool:
    done = build / f"{name}.done"
    return done.exists() and json.loads(done.read_text())["rc"] == 0 and (build / name / "manifest.json").exists()


def _check():
    """tools/gpu/check.py, whose export jobs both sides share."""
    sys.path.insert(0, str(ROOT / "tools" / "gpu"))
    import check

    return check


def prebuild(names: list[str], build: Path) -> list[str]:
    """Export ``names`` (tools/gpu/check.py's jobs) here, into ``build``: on the first H100 slot
    six exports at once took 6 of its 15 minutes, sending a bundle takes seconds."""
    if not names:
        return []
    check = _check()
    jobs = check.export_jobs(ROOT / "models", smollm2_gguf(), build, quick=False)
    unknown = sorted(set(names) - set(jobs))
    if unknown:
        raise SystemExit(f"--prebuilt {unknown}: expected names among {sorted(jobs)}")
    build.mkdir(parents=True, exist_ok=True)
    todo = {n: jobs[n] for n in names if not _exported(build, n)}
    if len(todo) < len(names):
        print(f"reusing {sorted(set(names) - set(todo))} in {build} (delete it to export again)", flush=True)
    if todo:
        check.run_exports(todo, build)
    for name in names:
        done = json.loads((build / f"{name}.done").read_text())
        if done["rc"] != 0:
            raise SystemExit(f"export {name} failed: {done['log_tail']}")
        print(f"exported {name} in {done['seconds']:.0f} s ({done['bundle_mib']:.0f} MiB)", flush=True)
    return names


def pack(out: Path, piece_mib: int, prebuilt: list[str], device_exports: list[str], data: Path | None = None, ort: bool = True) -> list[Path]:
    out = out.resolve()  # the exports run in the build folder: relative paths would land inside it
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*"):
        old.unlink()
    build = out.parent / ".gpu-build"
    prebuilt = prebuild(prebuilt, build)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wheels = download(tmp / "wheels", ort)
        raw = tmp / "payload.tar"
        # Order matters: what the exports need comes first, so that the first pieces alone
        # unpack it and exports start on the machine while the rest travels (check.sh
        # --export-early); onnxruntime-gpu, the bulk, comes last, under a prefix of its own.
        gguf = smollm2_gguf()
        with tarfile.open(raw, "w") as tar:
            for wheel in wheels:
                if not wheel.name.startswith("onnxruntime"):
                    add_wheel(tar, wheel, "site")
            for folder in (DEMO if any(n.startswith("demo-") for n in device_exports) else []) + (SMOLLM2 if ort else []):
                tar.add(ROOT / folder, arcname=folder)
            tar.add(gguf, arcname=GGUF)
            if data is not None:  # a distill plan for tools/gpu/drafter.py (specdec distill --plan-only), with any answers it holds
                for path in [data / "plan.json", data / "prompts.npz", *sorted(data.glob("shard-*.npz"))]:
                    tar.add(path, arcname=f"data/{path.name}")
            for name in prebuilt:  # after the GGUF: --export-early starts the others without waiting for these
                tar.add(build / name, arcname=f"work/{name}")
                tar.add(build / f"{name}.done", arcname=f"work/{name}.done")
            for wheel in wheels:
                if wheel.name.startswith("onnxruntime"):
                    add_wheel(tar, wheel, "ortgpu")
        (out / "gguf.size").write_text(f"{gguf.stat().st_size}\n")
        (out / "prebuilt.txt").write_text("".join(f"{n}\n" for n in prebuilt))  # the device exports the rest
        print(f"payload {raw.stat().st_size / 2**20:.0f} MiB before compression", flush=True)
        subprocess.run(["xz", "-6", "-T0", "-f", str(raw)], check=True)  # -> payload.tar.xz
        packed = raw.with_suffix(".tar.xz")
        digest = hashlib.sha256(packed.read_bytes()).hexdigest()
        pieces, size = [], piece_mib * 2**20
        with packed.open("rb") as fh:
            while chunk := fh.read(size):
                piece = out / f"part-{len(pieces):02d}"
                piece.write_bytes(chunk)
                pieces.append(piece)
    (out / "payload.sha256").write_text(f"{digest}  payload.tar.xz\n")
    return pieces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu", help="folder for the pieces (git-ignored)")
    ap.add_argument("--piece-mib", type=int, default=54, help="piece size: 64 MiB per call minus the slim tree (~7 MiB) and slack")
    ap.add_argument("--prebuilt", default="demo-fp16,smollm2-fp16",
                    help="check.py's bundles to export here and send whole ('' for none)")
    ap.add_argument("--data", type=Path, default=None, help="a specdec distill --plan-only folder to send, with its answers if any (tools/gpu/drafter.py answers it there, or trains on them with --minutes 0)")
    ap.add_argument("--no-ort", action="store_true", help="leave onnxruntime-gpu out (a drafter run needs torch and transformers only)")
    ap.add_argument("--device-exports", default="",
                    help="check.py's bundles the device exports (check.sh --export-early, --bundles naming them): their sources travel")
    args = ap.parse_args()
    if shutil.which("xz") is None:
        raise SystemExit("xz is needed (apt-get install xz-utils)")
    prebuilt, device = ([n for n in v.split(",") if n] for v in (args.prebuilt, args.device_exports))
    names = set(_check().export_jobs(ROOT / "models", Path("x.gguf"), Path("work"), quick=False))
    if set(device) - names:
        raise SystemExit(f"--device-exports {sorted(set(device) - names)}: expected names among {sorted(names)}")
    pieces = pack(args.out, args.piece_mib, prebuilt, device, args.data, not args.no_ort)
    total = sum(p.stat().st_size for p in pieces) / 2**20
    print(f"{len(pieces)} pieces, {total:.0f} MiB, in {args.out}: send one per device call (docs/gpu.md)")


if __name__ == "__main__":
    main()
