"""GPU check: the world's NCCL process group and every sub-group the topology made carry collectives correctly.

Mesh ``dp=-1, cp, tp`` (cp and tp are 2 where the world divides, else 1; one GPU: all dims of size 1). For every
group in ``topo.group_dims`` (each dim, and the flattened batch/metric/replica/all selections): the group's
backend, its ranks against meshwise's arithmetic (``topo.group_ranks``), and all_reduce, all_gather_into_tensor,
broadcast from the group's first rank and reduce_scatter_tensor of float64 values on ``topo.device``, each
against the value computed from the ranks alone; then a DTensor ``Shard(0) -> Replicate`` over the tp submesh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from _common import init, report, two_if

import meshwise


def main() -> None:
    topo = init({"dp": -1, "cp": two_if(4), "tp": two_if(2)})
    dev = topo.device
    checked = []
    for dims in topo.group_dims:
        group = topo.group(dims)
        ranks = topo.group_ranks(dims)
        assert dist.get_process_group_ranks(group) == ranks, (dims, dist.get_process_group_ranks(group), ranks)
        backend = str(dist.get_backend(group))
        assert backend == topo.backend, (dims, backend, topo.backend)
        n = len(ranks)
        me = torch.tensor([float(topo.rank), 1.0], dtype=torch.float64, device=dev)

        total = me.clone()
        dist.all_reduce(total, group=group)
        assert total.tolist() == [float(sum(ranks)), float(n)], (dims, total.tolist(), ranks)

        gathered = torch.empty(2 * n, dtype=torch.float64, device=dev)
        dist.all_gather_into_tensor(gathered, me, group=group)
        assert gathered[0::2].tolist() == [float(r) for r in ranks], (dims, gathered.tolist(), ranks)

        sent = torch.full((3,), float(topo.rank), dtype=torch.float64, device=dev)
        dist.broadcast(sent, src=ranks[0], group=group)
        assert sent.tolist() == [float(ranks[0])] * 3, (dims, sent.tolist())

        # row i of every rank holds (rank + i): after reduce-scatter rank at index j holds sum(ranks) + n * j
        rows = torch.arange(n, dtype=torch.float64, device=dev) + topo.rank
        mine = torch.empty(1, dtype=torch.float64, device=dev)
        dist.reduce_scatter_tensor(mine, rows, group=group)
        j = ranks.index(topo.rank)
        assert mine.item() == float(sum(ranks) + n * j), (dims, mine.item(), ranks)
        checked.append("+".join(dims))

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    tp_mesh = topo.submesh("tp")
    whole = torch.arange(4 * topo.size("tp") * 3, dtype=torch.float64, device=dev).reshape(-1, 3)
    dt = distribute_tensor(whole, tp_mesh, [Shard(0)])
    assert dt.to_local().device == dev, dt.to_local().device
    assert torch.equal(dt.redistribute(tp_mesh, [Replicate()]).to_local(), whole)
    report("groups", topo, groups=checked)
    meshwise.shutdown()


if __name__ == "__main__":
    main()
