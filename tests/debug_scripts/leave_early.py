"""Under ``meshwise run --nproc-per-node 2``: rank 1 ends its script without meshwise.shutdown() before a metric sync.

Rank 0 prints the error it gets; the test reads it from the launcher's output.
"""

import sys
import time

import torch
from torchmetrics import SumMetric

import meshwise
from meshwise.metrics import MeshMetric

topo = meshwise.init({"dp": 2}, timeout=3, run_dir=sys.argv[1])
metric = MeshMetric(SumMetric(), topo)
metric.update(torch.ones(1))
if topo.rank == 1:
    sys.exit(0)  # atexit leaves an exit record for the rank that waits on this one
time.sleep(1)
try:
    metric.compute()
    print("NO ERROR", flush=True)
except meshwise.CollectiveTimeoutError as exc:
    print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
meshwise.shutdown()
