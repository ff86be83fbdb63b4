"""The rows graph, plain session.run on CUDA against the CPU (third H100 run's BatchEngine fault)."""
import json, sys
from pathlib import Path
import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
import diag_common  # noqa: E402
bundle, out = diag_common.args(__doc__)
m = json.loads((bundle / "manifest.json").read_text())
res = {"provenance": diag_common.stamp()}
try:
    ort.preload_dlls()
except Exception as e:
    res["preload"] = str(e)
for gname, rowset in (("target_dynamic", (1,)), ("target_rows", (1,))):
    g = m["graphs"][gname]
    for rows in rowset:
        feeds = diag_common.feeds(g["inputs"], rows, high=min(5000, m["vocab_size"]))  # 5000 on SmolLM2, as run
        fetch = "logits" if gname.endswith("dynamic") else ("logits/rows1" if rows == 1 else "logits/rows2")
        r = {}
        for prov in ("CUDAExecutionProvider", "CPUExecutionProvider"):
            try:
                sess = ort.InferenceSession(str(bundle / g["file"]), providers=[prov])
                names = {i.name for i in sess.get_inputs()}
                lo = sess.run([fetch], {k: v for k, v in feeds.items() if k in names})[0]
                r[prov] = {"nan": int(np.isnan(lo).sum()), "argmax": lo.argmax(-1).tolist(), "absmax": float(np.nanmax(np.abs(lo))), "inputs": sorted(names)[:5]}
                r[prov + "_logits"] = lo
                res.setdefault("all", {})[f"{gname}{rows}{prov}"] = lo
            except Exception as e:
                r[prov] = f"{type(e).__name__}: {e}"[:500]
        a, b = r.pop("CUDAExecutionProvider_logits", None), r.pop("CPUExecutionProvider_logits", None)
        if a is not None and b is not None:
            r["max_abs_diff"] = float(np.nanmax(np.abs(a - b)))
        res[f"{gname} rows{rows}"] = r
        print(gname, rows, json.dumps(r)[:600], flush=True)
        if "all" in res:
            a = res["all"]
            for k1 in a:
                for k2 in a:
                    if k1 < k2:
                        print("diff", k1, k2, float(np.abs(a[k1] - a[k2]).max()), flush=True)
        (out / "diag_rows.json").write_text(json.dumps({k: v for k, v in res.items() if k != "all"}, indent=1))
