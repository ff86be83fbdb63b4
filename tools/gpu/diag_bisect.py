"""First node of the rows graph whose output differs on CUDA from the CPU (third H100 run)."""
import json, sys
from pathlib import Path
import numpy as np
import onnx
import onnxruntime as ort
bundle, out, first = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 400
m = json.loads((bundle / "manifest.json").read_text())
g = m["graphs"]["target_rows"]
proto = onnx.load(str(bundle / g["file"]), load_external_data=False)
outs = [o for n in proto.graph.node[:first] for o in n.output if o]
kinds = {o: (n.op_type, n.name) for n in proto.graph.node[:first] for o in n.output}
have = {o.name for o in proto.graph.output}
for o in outs:
    if o not in have:
        proto.graph.output.append(onnx.ValueInfoProto(name=o))
path = bundle / "diag_bisect.onnx"
onnx.save_model(proto, str(path))
rng = np.random.default_rng(0)
s, feeds = 3, {}
for t in g["inputs"]:
    n = t["name"]
    feeds[n] = (rng.integers(100, 5000, (1, s)).astype(np.int64) if n == "input_ids" else np.tile(np.arange(s), (1, 1)).astype(np.int64) if n == "position_ids"
                else np.full((1,), s - 1, np.int32) if n == "seqlens_k" else np.zeros(t["shape"], dtype=t["dtype"]))
got = {}
for prov in ("CPUExecutionProvider", "CUDAExecutionProvider"):
    sess = ort.InferenceSession(str(path), providers=[prov])
    names = {i.name for i in sess.get_inputs()}
    fetch = [o.name for o in sess.get_outputs() if o.name in outs]
    got[prov] = dict(zip(fetch, sess.run(fetch, {k: v for k, v in feeds.items() if k in names})))
rows = []
for o in outs:
    a, b = got["CPUExecutionProvider"].get(o), got["CUDAExecutionProvider"].get(o)
    if a is None or b is None or a.shape != b.shape or a.dtype.kind not in "fiu":
        rows.append({"output": o, "op": kinds[o][0], "note": "shapes differ" if a is not None and b is not None else "missing"}); continue
    d = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.size else 0.0
    rows.append({"output": o, "op": kinds[o][0], "node": kinds[o][1], "shape": list(a.shape), "max_abs_diff": d, "scale": float(np.abs(a).max()) if a.size else 0.0})
bad = [r for r in rows if r.get("max_abs_diff", 0) > 0.05 * max(1.0, r.get("scale", 0)) or "note" in r]
print("first differing:", json.dumps(bad[:12])[:3000], flush=True)
(out / "diag_bisect.json").write_text(json.dumps({"rows": rows, "first_bad": bad[:40]}, indent=1, default=str))
path.unlink()
