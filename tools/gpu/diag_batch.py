"""BatchEngine on CUDA against the CPU, float16: which configurations go wrong (third H100 run)."""
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
import check
import diag_common
from specdec.runtime import SpeculativeDecoder
from specdec.runtime.batch import BatchEngine

bundle, out = diag_common.args(__doc__)
prompts = check.prompts_for(bundle, 4)
res = {"provenance": diag_common.stamp()}
cpu = [SpeculativeDecoder.load(bundle, provider="cpu", drafter="lookup").generate(p, max_new_tokens=12, ignore_eos=True, gamma=0).tokens for p in prompts]
res["cpu_ar"] = cpu
def run(label, provider, max_batch, n, gamma, drafter="lookup", **kw):
    try:
        with BatchEngine(bundle, max_batch=max_batch, provider=provider, drafter=drafter, **kw) as e:
            got = [r.tokens for r in e.generate_many(prompts[:n], max_new_tokens=12, ignore_eos=True, gamma=gamma)]
        res[label] = {"same": [g == c for g, c in zip(got, cpu)], "got": got}
    except Exception as ex:
        res[label] = f"{type(ex).__name__}: {ex}"
    print(label, json.dumps(res[label])[:300], flush=True)
    (out / "diag_batch.json").write_text(json.dumps(res, indent=1))
run("cuda mb1 n1 ar", "cuda", 1, 1, 0)
run("cuda mb8 n1 ar", "cuda", 8, 1, 0)
run("cuda mb8 n4 ar", "cuda", 8, 4, 0)
run("cuda mb8 n1 ar noreuse", "cuda", 8, 1, 0, prefix_reuse=False)
run("cuda mb2 n2 ar", "cuda", 2, 2, 0)
run("cpu mb8 n4 ar", "cpu", 8, 4, 0)
