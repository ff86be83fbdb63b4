"""diag_flat.py's 1-row body with GQA's total_sequence_length fed as a graph input (as the batch-1
graphs have it) instead of computed in the graph: CUDA against the CPU.   python diag_total.py BUNDLE OUT"""
import json, sys
from pathlib import Path
import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
import diag_common  # noqa: E402

bundle, out = diag_common.args(__doc__)
m = json.loads((bundle / "manifest.json").read_text())
g = m["graphs"]["target_rows"]
proto = onnx.load(str(bundle / g["file"]), load_external_data=False)
body = next(a.g for a in proto.graph.node[3].attribute if a.name == "then_branch")
nodes = list(body.node)
for n in nodes:
    if n.op_type == "GroupQueryAttention":
        n.input[6] = "total_sequence_length"
inputs = list(proto.graph.input) + [onnx.helper.make_tensor_value_info("total_sequence_length", onnx.TensorProto.INT32, [])]
flat = onnx.helper.make_graph(nodes, "rows1_total", inputs, list(body.output), list(proto.graph.initializer))
model = onnx.helper.make_model(flat, opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
path = bundle / "diag_total.onnx"
onnx.save_model(model, str(path))
feeds = {**diag_common.feeds(g["inputs"], 1, high=500), "total_sequence_length": np.array(3, np.int32)}
got = {}
for prov in ("CPUExecutionProvider", "CUDAExecutionProvider"):
    sess = ort.InferenceSession(str(path), providers=[prov])
    ins = {i.name for i in sess.get_inputs()}
    got[prov] = sess.run([body.output[0].name], {k: v for k, v in feeds.items() if k in ins})[0]
path.unlink()
res = {"provenance": diag_common.stamp(), "max_abs_diff": float(np.abs(got["CPUExecutionProvider"] - got["CUDAExecutionProvider"]).max()), "scale": float(np.abs(got["CPUExecutionProvider"]).max())}
print("total as input:", res, flush=True)
(out / "diag_total.json").write_text(json.dumps(res))
