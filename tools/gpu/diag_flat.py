"""The rows graph's 1-row body taken out of its If and run as a graph of its own, every node's
output compared between CUDA and the CPU: is the If the fault, else which node first differs
(third H100 run: BatchEngine float16 wrong on CUDA, the rows graph wrong even under plain
session.run).   python diag_flat.py BUNDLE OUT"""
import json, sys
from pathlib import Path
import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
import diag_common  # noqa: E402

bundle, out = diag_common.args(__doc__)
try:
    ort.preload_dlls()
except Exception:
    pass
m = json.loads((bundle / "manifest.json").read_text())
g = m["graphs"]["target_rows"]
proto = onnx.load(str(bundle / g["file"]), load_external_data=False)
body = next(a.g for a in proto.graph.node[3].attribute if a.name == "then_branch")  # rows/if1
flat = onnx.helper.make_graph(list(body.node), "rows1_flat", list(proto.graph.input), list(body.output), list(proto.graph.initializer))
model = onnx.helper.make_model(flat, opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
names = [o for n in body.node for o in n.output[:1] if o and n.op_type in ("MatMul", "GroupQueryAttention", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization", "Gather", "Add", "Mul", "Sigmoid", "Cast")]
kinds = {o: n.op_type for n in body.node for o in n.output}
feeds = diag_common.feeds(g["inputs"], 1, high=500)
res = {"provenance": diag_common.stamp()}
for label, extra in (("flat", []), ("flat_all_outputs", names)):
    mm = onnx.ModelProto(); mm.CopyFrom(model)
    have = {o.name for o in mm.graph.output}
    for o in extra:
        if o not in have:
            mm.graph.output.append(onnx.ValueInfoProto(name=o))
    path = bundle / f"diag_{label}.onnx"
    onnx.save_model(mm, str(path))
    got = {}
    for prov in ("CPUExecutionProvider", "CUDAExecutionProvider"):
        try:
            sess = ort.InferenceSession(str(path), providers=[prov])
            ins = {i.name for i in sess.get_inputs()}
            fetch = [o.name for o in sess.get_outputs()]
            got[prov] = dict(zip(fetch, sess.run(fetch, {k: v for k, v in feeds.items() if k in ins})))
        except Exception as e:
            got[prov] = f"{type(e).__name__}: {e}"[:400]
    path.unlink()
    a, b = got["CPUExecutionProvider"], got.get("CUDAExecutionProvider")
    if isinstance(a, str) or isinstance(b, str):
        res[label] = {"error": a if isinstance(a, str) else b}
    else:
        rows = []
        for o in ([body.output[0].name] if label == "flat" else names):
            x, y = a.get(o), b.get(o)
            if x is None or y is None or x.shape != y.shape:
                rows.append({"output": o, "op": kinds.get(o), "note": "missing or shape"}); continue
            if x.dtype == bool or x.dtype.kind in "iu":
                rows.append({"output": o, "op": kinds.get(o), "equal": bool(np.array_equal(x, y)), "values": x.ravel()[:4].tolist(), "cuda": y.ravel()[:4].tolist()}); continue
            d = float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()) if x.size else 0.0
            rows.append({"output": o, "op": kinds.get(o), "shape": list(x.shape), "max_abs_diff": d, "scale": float(np.abs(x).max()) if x.size else 0.0})
        bad = [r for r in rows if r.get("max_abs_diff", 0) > 0.02 * max(1.0, r.get("scale", 0)) or r.get("equal") is False or "note" in r]
        res[label] = {"rows": rows[:400], "first_bad": bad[:20]}
    print(label, json.dumps(res[label].get("first_bad", res[label]))[:2500], flush=True)
    (out / "diag_flat.json").write_text(json.dumps(res, indent=1, default=str))
