"""Estimate every zoo and realmodels case (CPU target) in one process with the tree at ROOT; print name ->
(peak_allocated, peak_reserved, device_total, forward_activations) as JSON. Used to check that a change
leaves every estimate as it was: run once per tree and compare (results/steptime_estimates_unchanged.md)."""
import json, sys, os
root = sys.argv[1]
sys.path.insert(0, root)
os.chdir(root)
import benchmarks.accuracy_cpu as acc
import benchmarks.realmodels as real
from benchmarks.zoo import CASES as ZOO
out = {}
for name in ZOO:
    try:
        e = acc.estimate_one(name)["estimate"]
        out["zoo:" + name] = [e["peak_allocated"], e["peak_reserved"], e["device_total"], e["forward_activations"]]
    except Exception as err:
        out["zoo:" + name] = repr(err)[:200]
for name in real.CASES:
    try:
        e = real.estimate_one(name)["estimate"]
        out["real:" + name] = [e["peak_allocated"], e["peak_reserved"], e["device_total"], e["forward_activations"]]
    except Exception as err:
        out["real:" + name] = repr(err)[:200]
print(json.dumps(out))
