"""One rank of tests/slurm/real_slurm.py: meshwise.init under srun, then each rank's node and rank 0's warnings."""

import json
import warnings

import meshwise
from meshwise.errors import PlacementWarning

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    topo = meshwise.init()
placement = [str(w.message) for w in caught if issubclass(w.category, PlacementWarning)]
print(
    json.dumps(
        {"rank": topo.rank, "launcher": topo.environment.launcher, "nodes": list(topo.nodes), "warnings": placement}
    )
)
meshwise.shutdown()
