"""Node-set parts of graphs (``meshwise.data.node_parts``, ``read_nodes``) and the node halo exchange
(``meshwise.parallel.node_halo_exchange``): partitions, k-hop halos against a breadth-first oracle, reads of only
the owned and halo rows, refusals, and a message-passing model at dp=2 x domain=2 and domain=4 that trains to the
parameters of one process on the whole graph (float64) with metrics on owned nodes equal to the whole graph's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from meshwise.data import node_parts, partition_nodes, read_nodes
from meshwise.data.graph import read_rows
from meshwise.errors import DataError
from meshwise.testing import run_distributed


def mesh(nx: int = 9, ny: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """An unstructured 2-D triangle mesh: jittered grid points, two triangles a cell, node ids shuffled (so an id
    says nothing of position); edges both ways. Returns (edges [2, E], coords [N, 2])."""
    rng = np.random.default_rng(seed)
    grid = np.array([(i, j) for i in range(nx) for j in range(ny)], dtype=np.float64)
    perm = rng.permutation(len(grid))  # node k sits at grid point perm[k]
    ids = np.argsort(perm)
    pairs = set()
    for i in range(nx - 1):
        for j in range(ny - 1):
            a, b, c, d = (ids[(i + di) * ny + j + dj] for di, dj in ((0, 0), (1, 0), (0, 1), (1, 1)))
            for u, v in ((a, b), (b, c), (c, a), (b, d), (d, c)):
                pairs |= {(int(u), int(v)), (int(v), int(u))}
    coords = grid[perm] + rng.uniform(-0.3, 0.3, grid.shape)
    return np.array(sorted(pairs)).T, coords


def k_hop(edges: np.ndarray, nodes: set[int], k: int) -> set[int]:
    """Oracle: every node with a path of at most k edges into ``nodes``, breadth first."""
    reach, frontier = set(nodes), set(nodes)
    for _ in range(k):
        frontier = {int(s) for s, d in edges.T if int(d) in frontier} - reach
        reach |= frontier
    return reach


# ---- in one process
@pytest.mark.parametrize("parts, halo", [(2, 1), (3, 2), (4, 1)])
def test_parts_are_balanced_and_their_halos_are_the_k_hop_neighbourhoods(parts, halo):
    edges, coords = mesh()
    n = len(coords)
    got = node_parts(edges, n, parts, halo=halo, coords=coords)
    assert sorted(np.concatenate([p.owned for p in got]).tolist()) == list(range(n))  # each node owned once
    assert max(len(p.owned) for p in got) - min(len(p.owned) for p in got) <= 1
    for p in got:
        assert set(p.halo.tolist()) == k_hop(edges, set(p.owned.tolist()), halo) - set(p.owned.tolist())
        assert list(p.halo_owner) == sorted(p.halo_owner)  # grouped by owner: one block per sender
        local = p.nodes
        inward = {(int(s), int(d)) for s, d in edges.T if int(d) in set(p.owned.tolist())}
        assert {(int(local[s]), int(local[d])) for s, d in zip(p.src, p.dst)} == inward
        for q in got:  # what q sends p is exactly p's halo rows owned by q, in p's order
            sent = q.owned[q.send_index[sum(q.send_counts[: p.rank]) : sum(q.send_counts[: p.rank + 1])]]
            assert (
                sent.tolist() == p.halo[p.halo_owner == q.rank].tolist()
                and q.send_counts[p.rank] == (p.recv_counts[q.rank])
            )
    assert node_parts(edges, n, parts, halo=halo, coords=coords) is got  # kept for the same graph and split


def test_a_space_filling_curve_keeps_halos_small():
    edges, coords = mesh(24, 24)
    n = len(coords)
    curve = sum(len(p.halo) for p in node_parts(edges, n, 4, coords=coords))
    by_id = sum(len(p.halo) for p in node_parts(edges, n, 4))  # ids are shuffled: ranges of ids are scattered
    assert curve < by_id / 4, (curve, by_id)
    vector = partition_nodes(n, 4, coords=coords)
    assert [len(p.halo) for p in node_parts(edges, n, 4, vector=vector)] == [
        len(p.halo) for p in node_parts(edges, n, 4, coords=coords)
    ]


def test_each_rank_reads_only_its_nodes_and_halo_from_npy_zarr_and_hdf5(tmp_path):
    import h5py
    import zarr

    edges, coords = mesh()
    n = len(coords)
    field = np.random.default_rng(1).standard_normal((n, 5, 3))
    np.save(tmp_path / "u.npy", field)
    z = zarr.open(str(tmp_path / "u.zarr"), mode="w", shape=field.shape, chunks=(16, 5, 3), dtype=field.dtype)
    z[:] = field
    with h5py.File(tmp_path / "u.h5", "w") as f:
        f["u"] = field
    part = node_parts(edges, n, 3, coords=coords)[1]
    with h5py.File(tmp_path / "u.h5", "r") as f:
        for source in (np.load(tmp_path / "u.npy", mmap_mode="r"), z, f["u"]):
            rows, nbytes = read_nodes(source, part)
            touched = np.unique(part.nodes // 16)  # Zarr reads whole chunks of 16 nodes (the last one shorter)
            chunked = int(np.sum(np.minimum(16 * touched + 16, n) - 16 * touched)) if source is z else len(part.nodes)
            assert np.array_equal(rows, field[part.nodes]) and nbytes == chunked * 5 * 3 * 8


class CountingChunks:
    """A chunked array (chunks of 16 rows) that records the chunks each read touches."""

    def __init__(self, data: np.ndarray) -> None:
        self.data, self.shape, self.dtype, self.chunks, self.reads = data, data.shape, data.dtype, (16, 5, 3), []

    def __getitem__(self, key):
        rows = np.arange(len(self.data))[key]
        self.reads.append(set((rows // 16).tolist()))
        return self.data[key]


def test_rows_in_any_order_read_each_touched_chunk_once():
    field = np.random.default_rng(2).standard_normal((2000, 5, 3))
    asks = [
        np.r_[np.arange(600, 1200), np.arange(590, 600), [5, 1999, 1300], np.arange(1500, 1210, -1), [700, 5]],
        np.arange(1999, -1, -1),  # a block asked backwards
        np.random.default_rng(3).permutation(2000)[:300],
        np.arange(0),
    ]
    for ids in asks:
        source = CountingChunks(field)
        rows, nbytes = read_rows(source, ids)
        touched = set((ids // 16).tolist())
        assert np.array_equal(rows, field[ids]) and nbytes == sum(min(16, 2000 - 16 * c) for c in touched) * 120
        assert sum(len(r) for r in source.reads) == len(touched) == len(set().union(*source.reads))
        flat, nb = read_rows(field, ids)
        assert np.array_equal(flat, field[ids]) and nb == len(ids) * 120


def test_bad_graphs_and_partitions_are_refused_with_the_fix():
    edges, coords = mesh(4, 4)
    with pytest.raises(DataError, match="name nodes outside 0..15"):
        node_parts(np.concatenate([edges, [[3], [16]]], axis=1), 16, 2)
    with pytest.raises(DataError, match="cannot divide 16 node.* over 17 split rank"):
        node_parts(edges, 16, 17)
    with pytest.raises(DataError, match="one integer part per node \\(16\\)"):
        node_parts(edges, 16, 2, vector=[0, 1] * 7)
    with pytest.raises(DataError, match="every part a node"):
        node_parts(edges, 16, 3, vector=[0, 1] * 8)
    with pytest.raises(DataError, match="gives split rank 0 every node of the graph"):
        node_parts(edges, 16, 2, halo=8, coords=coords)
    with pytest.raises(DataError, match="halo must be an int >= 0"):
        node_parts(edges, 16, 2, halo=-1)


# ---- training on real gloo groups
T, G, F, H, LR, STEPS = 13, 4, 2, 6, 0.05, 3  # time steps, global batch, features, width, lr, steps


class MessagePassing(nn.Module):
    """Two message-passing layers over in-edges (sum of messages), on a rank's part: the first reads the loaded halo,
    the second gets its halo from the node halo exchange. On one process the part is the whole graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.msg = nn.Linear(F, H), nn.Linear(H, H)
        self.upd, self.dec = nn.Linear(2 * H, H), nn.Linear(H, F)
        self.double()

    def place(self, part, exchange) -> None:
        self.part, self.exchange = part, exchange
        self.src, self.dst = torch.from_numpy(part.src), torch.from_numpy(part.dst)

    def layer(self, h: torch.Tensor) -> torch.Tensor:
        owned = len(self.part.owned)
        m = h.new_zeros(h.shape[0], owned, H).index_add(1, self.dst, self.msg(h)[:, self.src])
        return torch.tanh(self.upd(torch.cat([h[:, :owned], m], dim=-1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer(torch.tanh(self.enc(x)))  # x: owned + loaded halo rows
        return self.dec(self.layer(self.exchange(h)))


def _data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    edges, coords = mesh()
    t = np.arange(T)[None, :, None]
    u = np.sin(coords[:, None, :1] * 0.7 + 0.3 * t) * np.cos(coords[:, None, 1:] * 0.5 - 0.2 * t)
    return edges, coords, np.concatenate([u, u**2], axis=-1)  # node-major [N, T, F]


def _batches(rows: np.ndarray, owned: int, data_rank: int, data_size: int) -> list[dict]:
    """Samples t -> t + 1, G a step, this data rank's share of each global batch."""
    local = G // data_size
    out = []
    for step in range(STEPS):
        ts = [step * G + data_rank * local + i for i in range(local)]
        x = torch.from_numpy(np.stack([rows[:, t] for t in ts]))
        target = x.new_tensor(np.stack([rows[:owned, t + 1] for t in ts]))
        out.append({"input": x, "target": target, "index": torch.tensor(ts)})  # the samples' ids: split ranks agree
    return out


def _train(topo, dim: str | None):
    from torchmetrics import MeanSquaredError

    import meshwise
    from meshwise.metrics import MeshMetric
    from meshwise.parallel import node_halo_exchange

    edges, coords, field = _data()
    size = topo.size(dim) if dim else 1
    part = node_parts(edges, len(coords), size, coords=coords)[topo.coordinate(dim) if dim else 0]
    rows, nbytes = read_nodes(field, part)  # owned + 1-hop halo rows only
    model = MessagePassing()
    model.place(part, (lambda h: node_halo_exchange(h, part, topo, dim, axis=1)) if dim else (lambda h: h))
    model = meshwise.parallelize(model, topo, dp="replicate")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = meshwise.create_trainer(model, opt, nn.functional.mse_loss, topo, loss_weight="tokens")
    trainer.run(_batches(rows, len(part.owned), topo.data_rank, topo.data_size), max_epochs=1)
    mse = MeshMetric(MeanSquaredError().set_dtype(torch.float64), topo)
    with torch.no_grad():
        for b in _batches(rows, len(part.owned), topo.data_rank, topo.data_size):
            mse.update(model(b["input"]), b["target"])
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    params = {k: v.detach().clone() for k, v in full.items()}
    return {"params": params, "mse": float(mse.compute()), "bytes": nbytes, "nodes": len(part.nodes)}


def _own_parts(topo, folder: str) -> list[bool]:
    """read_node_part (a rank's own edges, one all-to-all of halo ids) against node_parts (every edge, every part)."""
    from meshwise.data import read_node_part

    edges, n = np.load(f"{folder}/edges.npy"), len(np.load(f"{folder}/order.npy"))
    out = []
    for halo in (0, 1, 2):
        got = read_node_part(folder, topo, "domain", halo=halo)
        want = node_parts(edges, n, topo.size("domain"), halo=halo)[topo.coordinate("domain")]
        out.append(
            all(
                np.array_equal(getattr(got, f.name), getattr(want, f.name))
                if isinstance(getattr(got, f.name), np.ndarray)
                else getattr(got, f.name) == getattr(want, f.name)
                for f in dataclasses.fields(want)
            )
        )
    return out


def _on_the_mesh(folder: str) -> dict:
    import meshwise

    out = {}
    topo = meshwise.init({"dp": 2, "domain": 2}, timeout=60)
    out["dp2domain2"] = _train(topo, "domain")
    out["own dp2domain2"] = _own_parts(topo, folder)
    meshwise.shutdown()
    topo = meshwise.init({"domain": 4}, timeout=60)
    out["domain4"] = _train(topo, "domain")
    out["own domain4"] = _own_parts(topo, folder)
    meshwise.shutdown()
    return out


def test_a_graph_model_at_dp2_domain2_and_domain4_trains_like_one_process(tmp_path):
    """... and, in the same launch, each rank's part of a reordered graph read from its own edges only
    (read_node_part) equals node_parts' at halo 0, 1 and 2."""
    import meshwise
    from meshwise.data import reorder_nodes

    edges, coords = mesh(24, 20)
    reorder_nodes(tmp_path / "graph", edges, {}, 4, coords=coords)
    res = run_distributed(_on_the_mesh, 4, str(tmp_path / "graph"), timeout=240)
    assert all(r["own dp2domain2"] == [True] * 3 and r["own domain4"] == [True] * 3 for r in res), res[0]
    topo = meshwise.init({"dp": 1})  # the whole graph in this process
    try:
        one = _train(topo, None)
    finally:
        meshwise.shutdown()
    _, _, field = _data()
    for mesh_name in ("dp2domain2", "domain4"):
        for r in res:
            got = r[mesh_name]
            worst = max(float((got["params"][k] - one["params"][k]).abs().max()) for k in one["params"])
            assert worst <= 1e-12, (mesh_name, worst)
            assert abs(got["mse"] - one["mse"]) <= 1e-12 * max(1.0, one["mse"])
            assert got["bytes"] == got["nodes"] * T * F * 8 < field.nbytes  # its rows only


def test_reorder_writes_each_part_as_one_range_and_refuses_a_folder_with_data(tmp_path):
    from meshwise.data import reorder_nodes

    edges, coords = mesh(16, 16)
    n = len(coords)
    field = np.random.default_rng(2).standard_normal((n, 3))
    report = reorder_nodes(tmp_path / "ordered", edges, {"u": field}, 4, coords=coords)
    order, new_edges = np.load(tmp_path / "ordered" / "order.npy"), np.load(tmp_path / "ordered" / "edges.npy")
    assert np.array_equal(np.load(tmp_path / "ordered" / "u.npy"), field[order])
    parts, before = node_parts(new_edges, n, 4), node_parts(edges, n, 4, coords=coords)  # ranges of ids, now
    for p, q in zip(parts, before):  # the same partition, renumbered: each owned set one contiguous range
        assert sorted(order[p.owned].tolist()) == q.owned.tolist() and np.all(np.diff(p.owned) == 1)
        assert sorted(order[p.halo].tolist()) == sorted(q.halo.tolist())
    assert all(a < b for a, b in zip(report["runs_after"], report["runs_before"])), report
    with pytest.raises(DataError, match="already holds files"):
        reorder_nodes(tmp_path / "ordered", edges, {"u": field}, 4, coords=coords)
    assert np.array_equal(np.load(tmp_path / "ordered" / "u.npy"), field[order])  # nothing overwritten


def test_the_example_stopped_at_dp2_domain2_and_resumed_at_domain4_equals_one_process(tmp_path):
    """examples/graph/train.py as `meshwise run` runs it (forked ranks): 4 steps at dp=2 x domain=2, resumed from its
    checkpoint at domain=4 (other parts, the same data cursor) to step 8, against one process's 8 unbroken steps."""
    import json
    from pathlib import Path

    from meshwise.testing import run_script

    root = Path(__file__).resolve().parents[1]
    script = root / "examples" / "graph" / "train.py"
    common = ["--data", str(tmp_path / "data"), "--side", "20", "--time-steps", "25", "--batch", "4"]
    split = [*common, "--run-dir", str(tmp_path / "split")]
    out = run_script(script, 4, [*split, "--steps", "4"], mesh="dp=2,domain=2", cwd=root, timeout=180)
    assert "mesh dp=2 x domain=2: 400 nodes, part 0 owns 200" in out[0], out[0]
    run_script(script, 4, [*split, "--steps", "8", "--out", str(tmp_path / "a.json")], mesh="domain=4", cwd=root)
    one = [*common, "--run-dir", str(tmp_path / "one"), "--steps", "8", "--out", str(tmp_path / "b.json")]
    run_script(script, 1, one, mesh="dp=1", cwd=root)
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["step"] == b["step"] == 8
    assert max(abs(x - y) for x, y in zip(a["weights"], b["weights"])) <= 1e-12
    assert a["bytes"] < b["bytes"] / 2  # a quarter of the nodes and their halo, against the whole field


def test_a_node_list_on_the_sphere_splits_into_balanced_uneven_parts():
    """A weather-style grid: points on the sphere as one 1-D node list (a Fibonacci lattice, 3-D positions), edges to
    each point's 6 nearest; 5 parts of 1,001 nodes (sizes 200 or 201) along the 3-D Morton curve keep halos small."""
    n, parts = 1001, 5
    k = np.arange(n) + 0.5
    lat, lon = np.arcsin(1 - 2 * k / n), np.pi * (1 + 5**0.5) * k
    xyz = np.stack([np.cos(lat) * np.cos(lon), np.cos(lat) * np.sin(lon), np.sin(lat)], axis=1)
    near = np.argsort(((xyz[:, None] - xyz[None]) ** 2).sum(-1), axis=1)[:, 1:7]
    edges = np.stack([near.ravel(), np.repeat(np.arange(n), 6)])  # messages from the 6 nearest into each point
    got = node_parts(edges, n, parts, coords=xyz)
    assert sorted(len(p.owned) for p in got) == [200, 200, 200, 200, 201]
    assert max(p.halo_share for p in got) < 0.6  # a ring around each 200-node cap, not the sphere
    scattered = node_parts(edges, n, parts, vector=np.random.default_rng(0).permutation(np.arange(n) % parts))
    assert min(p.halo_share for p in scattered) > 3 * max(p.halo_share for p in got)


@pytest.mark.parametrize("parts", [2, 4])
def test_k_layers_over_the_reach_edges_of_a_k_hop_part_give_the_owned_nodes_the_whole_graphs_values(parts):
    """No exchange at all: with a k-hop halo, k message-passing layers over the part's reach edges compute every owned
    node as the whole graph does (float64); with a (k-1)-hop halo they cannot."""
    edges, coords = mesh()
    n = len(coords)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 4, dtype=torch.float64, generator=g)
    w_self, w_msg = (
        torch.randn(4, 4, dtype=torch.float64, generator=g),
        torch.randn(4, 4, dtype=torch.float64, generator=g),
    )

    def layers(h, src, dst, k):
        for _ in range(k):
            h = torch.tanh(h @ w_self + torch.zeros_like(h).index_add(0, dst, h[src] @ w_msg))
        return h

    e = torch.from_numpy(edges)
    for k in (1, 2, 3):
        whole = layers(x, e[0], e[1], k)
        for halo, exact in ((k, True), (k - 1, False)):
            if halo < 1:
                continue
            worst = 0.0
            for p in node_parts(edges, n, parts, halo=halo, coords=coords):
                assert p.depth == halo and (halo > 1 or p.reach_src is p.src)
                src, dst = torch.from_numpy(p.reach_src), torch.from_numpy(p.reach_dst)
                got = layers(x[torch.from_numpy(p.nodes)], src, dst, k)[: len(p.owned)]
                worst = max(worst, float((got - whole[torch.from_numpy(p.owned)]).abs().max()))
            assert (worst <= 1e-12) if exact else (worst > 1e-6), (k, halo, worst)


def test_a_halo_deeper_than_the_models_layers_is_warned_and_layers_are_checked():
    """`layers` (the model's message-passing layers on the loaded rows before it exchanges): a deeper halo is read,
    kept and exchanged for nothing, so it is warned, by node_parts and GraphSamples alike; as deep or shallower, not."""
    import warnings

    from meshwise.data import GraphSamples
    from meshwise.errors import DataWarning

    edges, coords = mesh()
    n = len(coords)
    with pytest.warns(DataWarning, match=r"a halo of 2 hops for a model that runs 1 layer\(s\).*give halo=1"):
        node_parts(edges, n, 2, halo=2, coords=coords, layers=1)
    with pytest.warns(DataWarning, match=r"hops 1\.\.3 are read"):
        GraphSamples([{"edges": edges, "coords": coords}], None, None, halo=3, layers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        node_parts(edges, n, 2, halo=2, coords=coords, layers=2)
        node_parts(edges, n, 2, halo=1, coords=coords, layers=3)  # exchanges between layers: fine
    with pytest.raises(DataError, match="layers must be an int >= 0"):
        node_parts(edges, n, 2, layers=-1)
