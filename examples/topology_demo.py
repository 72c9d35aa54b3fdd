"""Print the topology table and check the data-parallel groups with one all-reduce per dim.

Runs anywhere: `python examples/topology_demo.py` (one process) or
`meshwise run --nproc-per-node 4 --mesh dp=-1,tp=2 examples/topology_demo.py`.
"""

import torch
import torch.distributed as dist

import meshwise


def main() -> None:
    topo = meshwise.init()  # the mesh comes from --mesh / MESHWISE_MESH, default dp=-1
    if topo.is_leader():
        print(topo.describe(), flush=True)
    checks = []
    for dim in topo.dims:
        value = torch.tensor([float(topo.rank)])
        dist.all_reduce(value, group=topo.group(dim))
        expected = float(sum(topo.group_ranks(dim)))
        checks.append((dim, value.item() == expected))
    # The data-parallel view: one sample stream per data rank, shared by its replica ranks.
    streams = torch.zeros(topo.world_size)
    streams[topo.rank] = topo.data_rank
    dist.all_reduce(streams)
    if topo.is_leader():
        for dim, ok in checks:
            print(f"all_reduce over {dim!r} groups: {'ok' if ok else 'WRONG'}")
        print(f"data rank of each global rank: {streams.long().tolist()} (data size {topo.data_size})")
    if not all(ok for _, ok in checks):
        raise SystemExit(f"{topo.label()}: a group all_reduce gave the wrong sum")
    meshwise.shutdown()


if __name__ == "__main__":
    main()
