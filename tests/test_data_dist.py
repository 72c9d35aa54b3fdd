"""Real multi-process runs: read strategies agree on dp=2 x tp=2; split parts and exact eval on dp=2 x cp=2."""

from __future__ import annotations

import numpy as np
import torch

from meshwise.data import ArrayDataset, Shard, mesh_dataloader
from meshwise.testing import run_distributed

N, SHAPE = 11, (1, 12, 6)


def _field(root):
    field = np.random.default_rng(1).standard_normal((N, *SHAPE)).astype(np.float32)
    np.save(f"{root}/field.npy", field)
    return field


def _strategies(topo, root):
    field = np.load(f"{root}/field.npy")
    out = {}
    for mode in ("train", "eval"):
        runs = {}
        for read, workers in (("each", 0), ("broadcast", 0), ("scatter", 0), ("scatter", 2), ("broadcast", 1)):
            ds = ArrayDataset({"input": f"{root}/field.npy", "label": np.arange(N) * 3})
            ld = mesh_dataloader(
                ds, topo, global_batch_size=6, mode=mode, seed=5, drop_last=False, read=read, num_workers=workers
            )
            batches = [{k: v.clone() for k, v in b.items()} for b in ld]
            for b in batches:
                v = b["valid"]
                assert torch.equal(b["input"][v], torch.from_numpy(field[b["index"][v].numpy()]))
                assert torch.equal(b["label"][v], b["index"][v] * 3)
                assert torch.all(b["input"][~v] == 0) and torch.all(b["index"][~v] == -1)
            runs[(read, workers)] = (batches, ld.bytes_read, len(ld), ld.state_dict())
        ref = runs[("each", 0)][0]
        for key, (batches, _, steps, _) in runs.items():
            assert steps == len(batches) == len(ref), key
            for a, b in zip(batches, ref):
                assert all(torch.equal(a[k], b[k]) for k in b), f"{key} differs from read='each'"
        out[mode] = {
            "index": [b["index"].tolist() for b in ref],
            "bytes": {f"{r}/{w}": v[1] for (r, w), v in runs.items()},
            "state": runs[("each", 0)][3],
        }
    return out


def test_read_strategies_identical_on_dp2_tp2(tmp_path):
    field = _field(tmp_path)
    res = run_distributed(_strategies, 4, str(tmp_path), mesh={"dp": 2, "tp": 2}, timeout=90)
    # ranks 0,1 are data rank 0 (tp 0, 1); ranks 2,3 data rank 1
    for mode in ("train", "eval"):
        assert res[0][mode]["index"] == res[1][mode]["index"] and res[2][mode]["index"] == res[3][mode]["index"]
        assert len({len(r[mode]["index"]) for r in res}) == 1, "all ranks run the same number of steps"
        assert len({str(r[mode]["state"]) for r in res}) == 1, "the cursor is global"
        seen = [i for r in (res[0], res[2]) for b in r[mode]["index"] for i in b if i >= 0]
        assert sorted(seen) == list(range(N)), "disjoint data ranks cover the epoch once"
        row = field[0].nbytes + 8
        for r in range(4):
            b = res[r][mode]["bytes"]
            rows = b["each/0"] // row
            assert b["each/0"] == rows * row
            assert b["broadcast/0"] == (b["each/0"] if r % 2 == 0 else 0), "only the replica leader reads"
            assert b["broadcast/1"] == b["broadcast/0"]
            assert b["scatter/0"] == b["scatter/2"] < b["each/0"]
        for leader in (0, 2):
            assert (
                res[leader][mode]["bytes"]["scatter/0"] + res[leader + 1][mode]["bytes"]["scatter/0"]
                == (res[leader][mode]["bytes"]["each/0"])
            ), "scatter: the replica ranks' reads add up to one copy"


def _split_eval(topo, root):
    import torch.distributed as dist

    field = np.load(f"{root}/field.npy")
    ds = ArrayDataset({"input": f"{root}/field.npy"})
    ld = mesh_dataloader(ds, topo, global_batch_size=4, mode="eval", parts={"input": Shard(1, halo=2)})
    indices, count = [], torch.zeros(1)
    for b in ld:
        v = b["valid"]
        full = ld.as_dtensor(b["input"], "input").full_tensor()  # a collective over cp every step
        assert tuple(full.shape) == (2, *SHAPE)
        assert torch.equal(full[v], torch.from_numpy(field[b["index"][v].numpy()]))
        part = ld.parts["input"]
        assert torch.equal(b["input"], full[(slice(None), *part.region)])
        count += v.sum()
        dist.all_reduce(count, group=topo.group(topo.metric_dims))  # as a metric would, padded steps included
        indices.append(b["index"].tolist())
    return {"index": indices, "bytes": ld.bytes_read, "region": [(s.start, s.stop) for s in ld.parts["input"].region]}


def test_split_parts_and_exact_eval_on_dp2_cp2(tmp_path):
    field = _field(tmp_path)
    res = run_distributed(_split_eval, 4, str(tmp_path), mesh={"dp": 2, "cp": 2}, timeout=90)
    assert res[0]["index"] == res[1]["index"] and res[2]["index"] == res[3]["index"], "split ranks share samples"
    assert len({len(r["index"]) for r in res}) == 1 == len(res[0]["index"]) - 2  # ceil(11 / 4) = 3 steps
    seen = [i for r in (res[0], res[2]) for b in r["index"] for i in b if i >= 0]
    assert sorted(seen) == list(range(N)), "exact eval: every sample once"
    assert res[0]["region"][1] == (0, 8) and res[1]["region"][1] == (4, 12)
    rows = [sum(i >= 0 for b in r["index"] for i in b) for r in res]
    assert [r["bytes"] for r in res] == [n * 8 * 6 * 4 for n in rows], "each rank reads its part with halo"
    assert res[0]["bytes"] < rows[0] * field[0].nbytes
