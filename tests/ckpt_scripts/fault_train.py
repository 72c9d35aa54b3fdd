"""Run under `meshwise run --max-restarts 1`: checkpoints every 4 iterations; in the first attempt rank 1 SIGKILLs
itself while writing the checkpoint of iteration 8 (after the one of iteration 4). The restarted group resumes
from `latest` (iteration 4) and trains to iteration 10.

Usage: fault_train.py ROOT LOG_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ckpt_common as cc  # noqa: E402

import meshwise  # noqa: E402


def main() -> None:
    root, logs, out = sys.argv[1:4]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    topo = meshwise.init()  # a restarted attempt joins through its own store prefix
    ck = meshwise.Checkpointer(root, topo, verbose=False)
    resumed_from = ck.latest_step()
    found = sorted(os.listdir(root)) if os.path.isdir(root) else []
    kill = 8 if attempt == 0 and topo.rank == 1 else None
    result = cc.train(topo, root, stop_at=10, every=4, log=logs, kill_while_saving=kill)
    ck.close()
    if topo.rank == 0:
        np.savez(Path(out) / "final.npz", **result["state"])
        record = {"restart_count": attempt, "resumed_from": resumed_from, "found": found}
        record["after"] = sorted(os.listdir(root))
        (Path(out) / "attempts.json").write_text(json.dumps(record))
    meshwise.shutdown()


if __name__ == "__main__":
    main()
