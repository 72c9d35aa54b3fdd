"""Under ``meshwise run --nproc-per-node 2`` with debug off: the two data ranks sync different metrics on the same
group, and gloo aborts a process (SIGABRT, no Python exception). The test reads the launcher's output."""

import sys

import torch
from torchmetrics import ConfusionMatrix, SumMetric

import meshwise
from meshwise.metrics import MeshMetric

topo = meshwise.init({"dp": 2}, timeout=10, run_dir=sys.argv[1], debug=False)
total = MeshMetric(SumMetric(), topo)
confusion = MeshMetric(ConfusionMatrix(task="multiclass", num_classes=30), topo)
total.update(torch.ones(3))
confusion.update(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
(total if topo.rank == 0 else confusion).compute()
meshwise.shutdown()
