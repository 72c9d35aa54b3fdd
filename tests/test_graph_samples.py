"""Variable meshes per sample (``meshwise.data.GraphSamples``): every sample its own graph, partitioned per sample.

In one process: each item is exactly ``node_parts`` of its sample's graph (rank by rank), its fields read on the
part's rows only (owned + halo, targets owned), ``node_parts``' cache stays bounded, and the loader serves one graph a
data rank. On real gloo groups (one launch): a message-passing model trained on 6 graphs of 20 to 48 nodes at
dp=2 x domain=2 and at domain=4 ends with the parameters of one process on the whole graphs (float64, <= 1e-12).
Refused: a graph of fewer nodes than split ranks, naming the sample and the fix.
"""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from meshwise.data import GraphSamples, mesh_dataloader, node_parts
from meshwise.environment import Environment
from meshwise.errors import DataError
from meshwise.layout import Layout
from meshwise.testing import run_distributed
from meshwise.topology import Topology

F, H, LR = 2, 6, 0.05  # features, width, learning rate
SIZES = ((5, 4), (6, 5), (4, 9), (7, 6), (6, 6), (8, 6))  # 20, 30, 36, 42, 36, 48 nodes: each graph its own


def mesh(nx: int, ny: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A jittered grid triangulated into an unstructured mesh, node ids shuffled; edges both ways."""
    rng = np.random.default_rng(seed)
    grid = np.array([(i, j) for i in range(nx) for j in range(ny)], dtype=np.float64)
    perm = rng.permutation(len(grid))  # node k sits at grid point perm[k]
    ids = np.argsort(perm)
    g = np.arange(nx * ny).reshape(nx, ny)
    a, b, c, d = g[:-1, :-1].ravel(), g[1:, :-1].ravel(), g[:-1, 1:].ravel(), g[1:, 1:].ravel()
    pairs = np.concatenate([np.stack(p) for p in ((a, b), (b, c), (c, a), (b, d), (d, c))], axis=1)
    edges = ids[np.unique(np.concatenate([pairs, pairs[::-1]], axis=1), axis=1)]
    return edges, grid[perm] + rng.uniform(-0.3, 0.3, grid.shape)


def graph(i: int) -> dict:
    """Sample i: its own mesh, an input field and a target (the input's mean over in-neighbours, shifted)."""
    nx, ny = SIZES[i % len(SIZES)]
    edges, coords = mesh(nx, ny, seed=i)
    n = len(coords)
    u = np.stack([np.sin(coords[:, 0] * 0.7 + i), np.cos(coords[:, 1] * 0.5 - 0.3 * i)], axis=1)
    mean = np.zeros_like(u)
    np.add.at(mean, edges[1], u[edges[0]])
    target = mean / np.bincount(edges[1], minlength=n)[:, None] + 0.1 * u
    return {"edges": edges, "num_nodes": n, "coords": coords, "input": u, "target": target}


def layout_topology(mesh: dict, rank: int) -> Topology:
    """A real Topology for ``rank`` of ``mesh`` with no process group (enough to read and load)."""
    world = int(np.prod(list(mesh.values())))
    env = Environment("none", rank, world, rank, world, "127.0.0.1", 0)
    return Topology(Layout.resolve(mesh, world, None), env, torch.device("cpu"), "gloo", datetime.timedelta(30), None)


class Recorded:
    """A node field that records every row read from it (as a Zarr or HDF5 array would be read)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.shape, self.dtype, self.rows = array, array.shape, array.dtype, []

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, key):
        self.rows += np.arange(len(self.array))[key].tolist()
        return self.array[key]


# ---- in one process
def test_each_item_is_node_parts_of_its_own_graph_read_on_owned_and_halo_rows_only():
    from meshwise.data import graph as graph_module

    parts = 3
    graphs = [graph(i) for i in range(11)]  # more graphs than node_parts keeps: the cache stays bounded
    for rank in range(parts):
        topo = layout_topology({"dp": 1, "domain": parts}, rank)
        recorded = [dict(g, input=Recorded(g["input"]), target=Recorded(g["target"])) for g in graphs]
        data = GraphSamples(recorded, topo, "domain")
        assert len(data) == len(graphs)
        first = None
        for i, g in enumerate(graphs):
            item = data[i]
            expected = node_parts(g["edges"], g["num_nodes"], parts, coords=g["coords"])
            part = item["part"]
            assert part is expected[rank]  # node_parts' own parts (kept: the same object while in its cache)
            assert set(item) == {"input", "target", "part"}
            assert np.array_equal(item["input"].numpy(), g["input"][part.nodes])  # owned, then halo
            assert np.array_equal(item["target"].numpy(), g["target"][part.owned])  # targets: owned only
            assert sorted(recorded[i]["input"].rows) == sorted(part.nodes.tolist())  # read once, those rows only
            assert sorted(recorded[i]["target"].rows) == part.owned.tolist()
            assert len(part.halo) > 0 and len(part.nodes) < g["num_nodes"]
            assert len(graph_module._CACHE) <= graph_module._CACHE_SIZE
            first = first or part
        again = data[0]["part"]  # evicted since (11 graphs > the cache's 8): computed again, equal
        assert again is not first and all(
            np.array_equal(getattr(again, f), getattr(first, f)) for f in ("owned", "halo", "src", "dst", "send_index")
        )
    # through the loader: one graph a data rank a step, its fields [1, rows, ...], its part in a list of one
    topo = layout_topology({"dp": 2, "domain": parts}, 4)  # data rank 1, domain rank 1
    data = GraphSamples(graphs[:6], topo, "domain")
    loader = mesh_dataloader(data, topo, global_batch_size=topo.data_size, seed=3)
    seen = []
    for batch in loader:
        ((i,),) = [batch["index"].tolist()]
        (part,) = batch["part"]
        g = graphs[i]
        assert part is node_parts(g["edges"], g["num_nodes"], parts, coords=g["coords"])[1]
        assert torch.equal(batch["input"], torch.from_numpy(g["input"][part.nodes])[None])
        assert torch.equal(batch["target"], torch.from_numpy(g["target"][part.owned])[None])
        seen.append(i)
    assert len(seen) == 3 and loader.bytes_read == sum(
        (len(p.nodes) + len(p.owned)) * F * 8 for p in (data[i]["part"] for i in seen)
    )
    whole = GraphSamples(graphs[:2], layout_topology({"dp": 1}, 0), None)[1]  # dim=None: the whole graph
    assert whole["part"].owned.tolist() == list(range(graphs[1]["num_nodes"])) and not len(whole["part"].halo)
    assert np.array_equal(whole["input"].numpy(), graphs[1]["input"])


class Lazy:
    """A lazy sequence of graphs: sample i is built when it is read."""

    def __init__(self, graphs: list[dict]) -> None:
        self.graphs = graphs

    def __len__(self) -> int:
        return len(self.graphs)

    def __getitem__(self, i: int) -> dict:
        return self.graphs[i]


def test_a_graph_with_fewer_nodes_than_split_ranks_is_refused_naming_the_sample_and_the_fix():
    topo = layout_topology({"domain": 4}, 0)
    tiny = {"edges": np.array([[0, 1, 2], [1, 2, 0]]), "coords": np.zeros((3, 2)), "input": np.ones((3, F))}
    graphs = [graph(0), graph(1), tiny, graph(3)]
    message = r"sample 2's graph has 3 node\(s\), fewer than the 4 ranks of split dim 'domain'.*drop \(or merge\)"
    with pytest.raises(DataError, match=message):  # a list: checked when the dataset is built
        GraphSamples(graphs, topo, "domain")
    lazy = GraphSamples(Lazy(graphs), topo, "domain")  # a lazy sequence: when the sample is read
    assert lazy[1]["part"].parts == 4
    with pytest.raises(DataError, match=message):
        lazy[2]
    with pytest.raises(DataError, match="sample 1: node field 'input' has 29 rows for 30 nodes"):
        GraphSamples([graph(0), dict(graph(1), input=graph(1)["input"][1:])], topo, "domain")
    with pytest.raises(DataError, match="'dp' is not one of this mesh.*dim=None for whole graphs"):
        GraphSamples(graphs[:2], layout_topology({"dp": 2, "domain": 2}, 0), "dp")
    with pytest.raises(DataError, match=r"sample 0: .*gives split rank 0 every node"):  # node_parts' own, named
        GraphSamples([graph(0)], topo, "domain", halo=9)[0]


# ---- training on real gloo groups
class MessagePassing(nn.Module):
    """Encode, two message-passing layers (sum of messages over in-edges), decode; the part comes with the batch.
    The first layer reads the loaded halo, the second gets its halo from ``exchange``."""

    def __init__(self, exchange) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.msg = nn.Linear(F, H), nn.Linear(H, H)
        self.upd, self.dec = nn.Linear(2 * H, H), nn.Linear(H, F)
        self.exchange = exchange
        self.double()

    def layer(self, h: torch.Tensor, part) -> torch.Tensor:
        owned, src, dst = len(part.owned), torch.from_numpy(part.src), torch.from_numpy(part.dst)
        m = h.new_zeros(h.shape[0], owned, H).index_add(1, dst, self.msg(h)[:, src])
        return torch.tanh(self.upd(torch.cat([h[:, :owned], m], dim=-1)))

    def forward(self, x: torch.Tensor, part) -> torch.Tensor:
        h = self.layer(torch.tanh(self.enc(x)), part)
        return self.dec(self.layer(self.exchange(h, part), part))


def _train(topo, dim: str | None) -> dict:
    """Train on GraphSamples through mesh_dataloader and the trainer, one graph a data rank a step, one epoch."""
    from ignite.engine import Events

    import meshwise
    from meshwise.parallel import node_halo_exchange

    graphs = [graph(i) for i in range(len(SIZES))]
    data = GraphSamples(graphs, topo, dim)
    loader = mesh_dataloader(data, topo, global_batch_size=topo.data_size, seed=5)
    exchange = (lambda h, part: node_halo_exchange(h, part, topo, dim, axis=1)) if dim else (lambda h, part: h)
    model = meshwise.parallelize(MessagePassing(exchange), topo, dp="replicate")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    forward = lambda m, b: m(b["input"], *b["part"])  # noqa: E731 (one part: a batch of two graphs fails loudly)
    trainer = meshwise.create_trainer(model, opt, nn.functional.mse_loss, topo, loss_weight="tokens", forward=forward)
    steps: list[int] = []
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: steps.append(int(e.state.batch["index"][0])))
    trainer.run(loader, max_epochs=1)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    parts = [data[i]["part"] for i in steps]
    read = sum((len(p.nodes) + len(p.owned)) * F * 8 for p in parts)
    whole = sum(graphs[i]["num_nodes"] * 2 * F * 8 for i in steps)
    return {
        "params": {k: v.detach().clone() for k, v in full.items()},
        "steps": steps,
        "data_rank": topo.data_rank,
        "bytes": (loader.bytes_read, read, whole),
        "halo": sum(len(p.halo) for p in parts),
    }


def _on_the_mesh() -> dict:
    import meshwise

    out = {}
    for name, sizes in (("dp2domain2", {"dp": 2, "domain": 2}), ("domain4", {"domain": 4})):
        topo = meshwise.init(sizes, timeout=60)
        out[name] = _train(topo, "domain")
        meshwise.shutdown()
    return out


def _one_process(steps: list[list[int]]) -> dict:
    """One process on the whole graphs, by hand: each step the mean squared error over every node (and feature) of
    its graphs, one SGD step."""
    model = MessagePassing(lambda h, part: h)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for graphs in steps:
        opt.zero_grad()
        sse, count = 0.0, 0
        for i in graphs:
            g = graph(i)
            whole = SimpleNamespace(owned=np.arange(g["num_nodes"]), src=g["edges"][0], dst=g["edges"][1])
            out = model(torch.from_numpy(g["input"])[None], whole)
            sse = sse + ((out - torch.from_numpy(g["target"])[None]) ** 2).sum()
            count += g["target"].size
        (sse / count).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(150)
def test_a_model_on_per_sample_parts_at_dp2_domain2_and_domain4_trains_like_one_process_on_whole_graphs():
    import meshwise

    res = run_distributed(_on_the_mesh, 4, timeout=120)
    for name, data_size in (("dp2domain2", 2), ("domain4", 1)):
        ranks = [r[name] for r in res]
        by_data_rank = {r["data_rank"]: r["steps"] for r in ranks}
        assert len(by_data_rank) == data_size and all(r["steps"] == by_data_rank[r["data_rank"]] for r in ranks)
        steps = [list(s) for s in zip(*(by_data_rank[d] for d in range(data_size)))]  # each step's global batch
        assert sorted(i for s in steps for i in s) == list(range(len(SIZES)))  # one epoch: every graph once
        one = _one_process(steps)
        for r in ranks:
            worst = max(float((r["params"][k] - one[k]).abs().max()) for k in one)
            assert worst <= 1e-12, (name, worst)
            loaded, parts, whole = r["bytes"]
            assert loaded == parts < whole and r["halo"] > 0  # its rows of each graph only
    topo = meshwise.init({"dp": 1})  # the same script on one process (dim=None: whole graphs) gives the same
    try:
        alone = _train(topo, None)
    finally:
        meshwise.shutdown()
    split = res[0]["domain4"]
    assert alone["steps"] == split["steps"]
    assert max(float((alone["params"][k] - split["params"][k]).abs().max()) for k in alone["params"]) <= 1e-12


def test_node_samples_read_only_the_parts_rows_of_each_sample_from_npy_zarr_and_hdf5(tmp_path):
    """A time series on one mesh, stored sample-major ([time, nodes, features], as weather and CFD data are): item t
    holds the part's rows of step t (owned + halo) and of step t + 1 (owned: the target), read without reading a
    whole step; Zarr's chunks are each read once and counted whole."""
    import h5py
    import zarr

    from meshwise.data import NodeSamples

    rng = np.random.default_rng(5)
    n, steps = 300, 6
    coords = rng.uniform(size=(n, 2))
    near = np.argsort(((coords[:, None] - coords[None]) ** 2).sum(-1), axis=1)[:, 1:4]
    edges = np.stack([near.ravel(), np.repeat(np.arange(n), 3)])
    u = rng.standard_normal((steps, n, 2))
    np.save(tmp_path / "u.npy", u)
    z = zarr.open_array(str(tmp_path / "u.zarr"), mode="w", shape=u.shape, chunks=(2, 64, 2), dtype=u.dtype)
    z[...] = u
    with h5py.File(tmp_path / "u.h5", "w") as f:
        f.create_dataset("u", data=u, chunks=(1, 64, 2))
    parts = node_parts(edges, n, 3, coords=coords)
    with h5py.File(tmp_path / "u.h5") as f:
        for source in (u, np.load(tmp_path / "u.npy", mmap_mode="r"), z, f["u"]):
            for p in parts:
                data = NodeSamples({"input": source, "target": source}, p, shift={"target": 1})
                assert len(data) == steps - 1
                for t in range(len(data)):
                    item = data[t]
                    assert torch.equal(item["input"], torch.from_numpy(u[t][p.nodes]))
                    assert torch.equal(item["target"], torch.from_numpy(u[t + 1][p.owned]))
    data = NodeSamples({"input": z}, parts[0])
    data[0]
    touched = np.unique(parts[0].nodes // 64)
    assert data.bytes_read == 2 * sum(min(64, n - 64 * c) for c in touched) * 2 * 8  # 2 steps a chunk, 2 features
    with pytest.raises(DataError, match=r"shape \[300, 2\]: NodeSamples reads arrays \[samples, nodes, ...\]"):
        NodeSamples({"input": u[0]}, parts[0])
    with pytest.raises(DataError, match="shift names \\['label'\\], which are not fields"):
        NodeSamples({"input": u}, parts[0], shift={"label": 1})


def test_a_sample_major_series_reordered_once_reads_each_step_of_a_part_in_a_few_runs(tmp_path):
    """reorder_nodes rewrites a [time, nodes, features] series a step at a time in partition order (and the edges
    sorted by destination: each part's in-edges one range of edges.npy); NodeSamples on the rewritten files gives
    every part the same rows as on the original, in a few runs of rows instead of hundreds."""
    from meshwise.data import NodeSamples, reorder_nodes
    from meshwise.data.graph import _runs

    rng = np.random.default_rng(7)
    n, steps = 400, 4
    coords = rng.uniform(size=(n, 2))
    near = np.argsort(((coords[:, None] - coords[None]) ** 2).sum(-1), axis=1)[:, 1:5]
    edges = np.stack([near.ravel(), np.repeat(np.arange(n), 4)])
    u = rng.standard_normal((steps, n, 3))
    np.save(tmp_path / "u.npy", u)
    source = np.load(tmp_path / "u.npy", mmap_mode="r")
    reorder_nodes(tmp_path / "ordered", edges, {"u": source}, 4, coords=coords, sample_major=["u"])
    order, new_edges = np.load(tmp_path / "ordered" / "order.npy"), np.load(tmp_path / "ordered" / "edges.npy")
    assert np.all(np.diff(new_edges[1]) >= 0)  # sorted by destination
    ordered = np.load(tmp_path / "ordered" / "u.npy", mmap_mode="r")
    assert np.array_equal(ordered, u[:, order])
    before, after = node_parts(edges, n, 4, coords=coords), node_parts(new_edges, n, 4)
    for p, q in zip(after, before):
        inward = np.flatnonzero((new_edges[1] >= p.owned[0]) & (new_edges[1] <= p.owned[-1]))
        assert np.all(np.diff(inward) == 1)  # the part's in-edges: one range of the file
        a, b = NodeSamples({"u": ordered}, p), NodeSamples({"u": source}, q)
        for t in range(steps):  # the same nodes' rows, renumbered
            got, want = a[t]["u"], b[t]["u"]
            assert torch.equal(got[np.argsort(order[p.nodes])], want[np.argsort(q.nodes)])
        assert _runs(p.nodes) * 10 < _runs(q.nodes), (_runs(p.nodes), _runs(q.nodes))
    with pytest.raises(DataError, match=r"sample_major names \['v'\]"):
        reorder_nodes(tmp_path / "other", edges, {"u": source}, 4, coords=coords, sample_major=["v"])
    with pytest.raises(DataError, match=r"'u' has 4 nodes along axis 0, the graph 400"):
        reorder_nodes(tmp_path / "other", edges, {"w": u[0], "u": source}, 4, coords=coords)  # u not named
