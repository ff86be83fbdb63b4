"""The rows graph on CUDA at each ORT graph-optimization level, against the CPU (third H100 run)."""
import json, sys
from pathlib import Path
import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
import diag_common  # noqa: E402
bundle, out = diag_common.args(__doc__)
m = json.loads((bundle / "manifest.json").read_text())
g = m["graphs"]["target_rows"]
feeds = diag_common.feeds(g["inputs"], 1, high=min(5000, m["vocab_size"]))  # 5000 on SmolLM2, as run
res = {"provenance": diag_common.stamp()}
def run(label, prov, level):
    so = ort.SessionOptions(); so.graph_optimization_level = level
    sess = ort.InferenceSession(str(bundle / g["file"]), so, providers=[prov])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(["logits/rows1"], {k: v for k, v in feeds.items() if k in names})[0]
ref = run("cpu", "CPUExecutionProvider", ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
for name, level in (("disable_all", ort.GraphOptimizationLevel.ORT_DISABLE_ALL), ("basic", ort.GraphOptimizationLevel.ORT_ENABLE_BASIC),
                    ("extended", ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)):
    try:
        lo = run(name, "CUDAExecutionProvider", level)
        res[name] = float(np.abs(lo - ref).max())
    except Exception as e:
        res[name] = f"{type(e).__name__}: {e}"[:300]
    print(name, res[name], flush=True)
    (out / "diag_rows_opt.json").write_text(json.dumps(res, indent=1))
