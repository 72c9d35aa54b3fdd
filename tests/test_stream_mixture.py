"""Mixtures of streams (``meshwise.data.mix`` of IterableDatasets) and streams resumed at another data size.

The oracle is Megatron's blending loop (``test_mixture.megatron``) and each stream's own order (sample k of a
source is its k-th). The checks on real gloo groups run inside test_mixture's 4-rank launch (``on_the_mesh``):
a 3-source stream mixture and a plain stream stopped at dp=4 and resumed at dp=2 (x tp=2), and at one process,
see every sample of the pass exactly once.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_loader_reiterate import layout_topology
from test_mixture import megatron

from meshwise.data import Schedule, mesh_dataloader, mix
from meshwise.errors import DataError

LENGTHS = {"web": 40, "code": 24, "math": 16}
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


class Rows(torch.utils.data.IterableDataset):
    """A user's stream: sample k of source s is x = [s * 1000 + k, sin(k + s)], y = [cos(0.3 k + s)] (float64)."""

    def __init__(self, source: int, n: int) -> None:
        self.source, self.n = source, n

    def __iter__(self):
        for k in range(self.n):
            x = torch.tensor([self.source * 1000.0 + k, np.sin(k + self.source)], dtype=torch.float64)
            yield {"x": x, "y": torch.tensor([np.cos(0.3 * k + self.source)], dtype=torch.float64)}


def streams(lengths=None) -> dict[str, Rows]:
    return {n: Rows(s, k) for s, (n, k) in enumerate((lengths or LENGTHS).items())}


def ids(batches) -> list[int]:
    return [int(v) for b in batches for v in b["x"][:, 0]]


def expected(weights: dict, n: int, start: dict | None = None) -> list[int]:
    """Megatron's order of ``n`` samples from counts ``start``, as ids: source * 1000 + its count."""
    counts = dict(start or dict.fromkeys(weights, 0))
    out = []
    for s in megatron(list(weights.values()), n):
        name = list(weights)[s]
        out.append(s * 1000 + counts[name])
        counts[name] += 1
    return out


def loader_of(mixture, mesh=None, rank=0, **kw):
    return mesh_dataloader(mixture, layout_topology(mesh or {"dp": 1}, rank), global_batch_size=8, **kw)


def test_the_order_is_megatrons_over_each_streams_own_order_and_stop_ends_the_pass():
    loader = loader_of(mix(streams(), WEIGHTS, exhausted="stop"))
    got = ids(loader)
    order = expected(WEIGHTS, 200)
    # the pass ends where the first source runs out (its partial batch dropped); then every source starts over
    first_out = next(i for i, v in enumerate(order) if v % 1000 >= LENGTHS[list(LENGTHS)[v // 1000]])
    assert got == order[: first_out // 8 * 8] and len(got) > 0
    assert ids(loader) == got  # the next pass reads every source from its start again
    assert set(next(iter(loader))) == {"x", "y", "source", "valid", "index"}


def test_new_weights_on_resume_continue_every_stream_where_it_was():
    loader = loader_of(mix(streams(), WEIGHTS, exhausted="stop"))
    it = iter(loader)
    first = ids(next(it) for _ in range(3))
    state = json.loads(json.dumps(loader.state_dict()))
    counts = state["mixture"]["counts"]
    assert sum(counts.values()) == 24 and first == expected(WEIGHTS, 24)
    new = {"web": 0.2, "code": 0.2, "math": 0.6}
    resumed = loader_of(mix(streams(), new, exhausted="stop"))
    resumed.load_state_dict(state)
    rest = ids(b for _, b in zip(range(2), resumed))
    assert rest == expected(new, 16, start=counts)  # no sample repeated, none skipped: each goes on from its count
    unchanged = loader_of(mix(streams(), WEIGHTS, exhausted="stop"))
    unchanged.load_state_dict(state)  # the same weights: exactly the unbroken order
    assert ids(b for _, b in zip(range(2), unchanged)) == expected(WEIGHTS, 40)[24:]


def test_repeat_restarts_a_stream_and_a_pass_is_epoch_samples_and_a_schedule_counts_the_run():
    small = {"web": 5, "code": 3, "math": 2}
    loader = loader_of(mix(streams(small), WEIGHTS, exhausted="repeat", epoch_samples=32))
    got = ids(loader)
    assert len(got) == 32
    order = [s * 1000 + k % small[list(small)[s]] for s, k in ((v // 1000, v % 1000) for v in expected(WEIGHTS, 32))]
    assert got == order
    schedule = Schedule([(0, {"web": 1.0}), (2, {"math": 1.0})], unit="steps")  # from step 2: math only
    loader = loader_of(mix(streams(), schedule, exhausted="repeat", epoch_samples=24))
    passes = [[v // 1000 for v in ids(loader)] for _ in range(2)]
    assert passes[0] == [0] * 16 + [2] * 8 and passes[1] == [2] * 24  # the second pass is past step 2 of the run


def test_eval_reads_every_sample_of_every_stream_once_source_after_source():
    loader = loader_of(mix(streams(), WEIGHTS, exhausted="stop"), mode="eval")
    batches = list(loader)
    got = [int(v) for b in batches for v, ok in zip(b["x"][:, 0], b["valid"]) if ok]
    assert got == [s * 1000 + k for s, n in enumerate(LENGTHS.values()) for k in range(n)]
    assert [int(v) for b in batches for v, ok in zip(b["source"], b["valid"]) if ok] == [v // 1000 for v in got]


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(DataError, match="'drop' is not supported for streams"):
        mix(streams(), WEIGHTS, exhausted="drop")
    with pytest.raises(DataError, match="give mix\\(..., epoch_samples=\\)"):
        mix(streams(), WEIGHTS, exhausted="repeat")
    with pytest.raises(DataError, match=r"\['web'\] are streams and \['code'\] are not"):
        mix({"web": Rows(0, 4), "code": {"x": np.zeros((4, 2))}}, {"web": 1, "code": 1})
    with pytest.raises(DataError, match="weights sum to 0"):
        mix(streams(), {"web": 0.0}, exhausted="stop")
    loader = loader_of(mix(streams(), WEIGHTS, exhausted="stop"))
    next(iter(loader))
    state = loader.state_dict()
    other = loader_of(mix({**streams(), "news": Rows(3, 9)}, {**WEIGHTS, "news": 1}, exhausted="stop"))
    with pytest.raises(DataError, match=r"added: \['news'\], removed: \[\]"):
        other.load_state_dict(state)
    short = loader_of(mix(streams({"web": 2, "code": 24, "math": 16}), WEIGHTS, exhausted="stop"))
    state["mixture"]["counts"]["web"] = 3
    short.load_state_dict(state)
    with pytest.raises(DataError, match="the stream gave 2: the source changed since the save"):
        next(iter(short))
    linear = Schedule([(0, {"web": 1.0}), (16, {"math": 1.0})], interpolate="linear")
    loader = loader_of(mix(streams(), linear, exhausted="stop"))
    with pytest.raises(DataError, match="Schedule ends at sample 16, and this step would reach sample 24"):
        list(loader)


# ---- on real gloo groups: run inside test_mixture's 4-rank launch
STOP = 2


def _pass(topo, state=None, stop=None, mixture=True):
    """This rank's ids for ``stop`` steps (or the rest of the pass) and the loader's state after them."""
    source = mix(streams(), WEIGHTS, exhausted="stop") if mixture else Rows(0, 64)
    loader = mesh_dataloader(source, topo, global_batch_size=8)
    if state is not None:
        loader.load_state_dict(state)
    got = ids(b for i, b in zip(range(stop or 10**6), loader))
    return got, json.loads(json.dumps(loader.state_dict()))


def on_the_mesh(meshwise, out: dict) -> None:
    """Stopped at dp=4, resumed at dp=2 x tp=2: a stream mixture and a plain stream (each rank's ids)."""
    topo = meshwise.init({"dp": 4}, timeout=30)
    for kind in ("mixture", "plain"):
        out[f"stream {kind} dp4"] = _pass(topo, stop=STOP, mixture=kind == "mixture")
    meshwise.shutdown()
    topo = meshwise.init({"dp": 2, "tp": 2}, timeout=30)
    for kind in ("mixture", "plain"):
        state = out[f"stream {kind} dp4"][1]
        out[f"stream {kind} dp2tp2"] = _pass(topo, state=state, mixture=kind == "mixture")
    meshwise.shutdown()


def check_the_mesh(res: list[dict]) -> None:
    """Every sample of the pass once, over the ranks at dp=4 then dp=2 x tp=2 (and at one process from dp=4)."""
    for kind, unbroken in (("mixture", ids(loader_of(mix(streams(), WEIGHTS, exhausted="stop")))), ("plain", None)):
        unbroken = unbroken if unbroken is not None else list(range(64))
        first = sorted(v for r in res for v in r[f"stream {kind} dp4"][0])
        assert first == sorted(unbroken[: STOP * 8]) and all(len(r[f"stream {kind} dp4"][0]) == 2 * STOP for r in res)
        data_ranks = [res[0], res[2]]  # dp=2 x tp=2: ranks 0 and 2 hold the two data ranks, 1 and 3 the same
        assert res[1][f"stream {kind} dp2tp2"][0] == data_ranks[0][f"stream {kind} dp2tp2"][0]
        rest = [v for r in data_ranks for v in r[f"stream {kind} dp2tp2"][0]]
        assert sorted(first + rest) == sorted(unbroken) and len(set(first + rest)) == len(unbroken)
        one, _ = _pass(layout_topology({"dp": 1}, 0), state=res[0][f"stream {kind} dp4"][1], mixture=kind == "mixture")
        assert one == unbroken[STOP * 8 :]  # at one process: the unbroken order itself
