"""The conformance sweep: every causal-LM family of the installed transformers, trained through meshwise's public
road (``parallelize``, ``context_parallel``, ``mesh_dataloader``, ``create_trainer``) at tp=2, dp=2 x tp=2, cp=2 and
pp=2, each against one process on the same global batches; every outcome is equal (float32 parts promoted to
float64 where their rounding alone would differ), refused with a MeshwiseError, n/a, or a failure, written as JSON."""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import families as fam
import promote
import torch

# mode -> (mesh, world size); the 2-rank modes share one launch, dp=2 x tp=2 has its own 4-rank launch
MODES: dict[str, tuple[dict[str, int], int]] = {
    "tp": ({"tp": 2}, 2),
    "cp": ({"cp": 2}, 2),
    "pp": ({"pp": 2}, 2),
    "dp_tp": ({"dp": 2, "tp": 2}, 4),
}
# the baseline of a cell above EQUAL: the same family at pure data parallelism, where meshwise only sums gradients
BASELINES: dict[str, tuple[dict[str, int], int]] = {"dp": ({"dp": 2}, 2)}
EQUAL = 1e-12  # float64: one process's parameters, up to summation order
# A family that computes parts in float32 inside its float64 model (Gemma's norms: `1.0 + weight.float()`, routers
# kept in float32) sums those parts in float32, and any split of such a sum over ranks rounds differently (Gemma3 at
# dp=4, no tp at all: 1.1e-8, docs/hf.md), by up to 3.6e-5 after AdamW's first steps (Gemma4-unified, the global
# batch in two halves in one process). Such a family, where that moves it past EQUAL, trains with those parts
# promoted to float64 (promote.py), one process and mesh alike, and is held to EQUAL there: a rounding difference
# vanishes, a logic error does not. Another family's cell above EQUAL is run again so.
# Some families amplify even float64 rounding past EQUAL: AdamW's first step divides a gradient by |g| + eps, which
# multiplies the rounding of a gradient near eps by up to LR / EPS = 1e4 (Gemma4-unified: 1.1e-11 off at dp=2,
# nothing split inside the model). A cell above EQUAL runs the family once more at pure data parallelism
# (BASELINES), and passes when both it and that baseline are within float64 rounding so amplified (ROUNDING_CAP: a
# gradient's 1e-14 times 1e4 per step); a logic error is orders above (1e-8 for a float32 part left unpromoted,
# 5e-2 without a gradient sum). Not a ratio of the two: which gradients land near eps depends on the CPU's
# float64 kernels, and Gemma4-unified's tp=2 cell was 0.8x its baseline on one machine and 24x on another.
ROUNDING_CAP = 1e-9
PG_TIMEOUT = 30.0  # a collective one rank never joins ends the launch after this; the sweep relaunches past it
SECONDS_PER_RUN = 30.0  # the launch timeout: this per (family, mode) left to run, plus a start-up allowance


def dataset() -> dict[str, torch.Tensor]:
    """STEPS x BATCH token windows: ``input`` and the already shifted ``target`` (no -100)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randint(3, fam.VOCAB, (fam.STEPS * fam.BATCH, fam.T + 1), generator=g)
    return {"input": w[:, :-1].contiguous(), "target": w[:, 1:].contiguous()}


def global_batches() -> list[dict[str, torch.Tensor]]:
    """The global batches the mesh loaders hand out, in their order (``MeshSampler``, seed 0, epoch 0)."""
    from meshwise.data import MeshSampler

    data = dataset()
    sampler = MeshSampler(fam.STEPS * fam.BATCH, fam.BATCH, mode="train", seed=0)
    out = []
    for step in range(fam.STEPS):
        idx = torch.from_numpy(sampler.global_batch(step * fam.BATCH))
        out.append({k: v[idx] for k, v in data.items()})
    return out


def ref_path(ref_dir: str | os.PathLike, model_type: str, promoted: bool) -> Path:
    return Path(ref_dir) / f"{model_type}{'.float64' if promoted else ''}.pt"


def reference(model_type: str, promoted: bool = False, halves: bool = False) -> dict[str, Any]:
    """One process on the whole global batches (AdamW, STEPS steps): the trained parameters, the dtypes of the
    parts the model computes in float32 (seen in step 0; under ``promoted``, where they run in float64, what
    promotion did not reach: nothing), the calls promotion rewrote, and how far training moved the parameters.
    ``halves``: each global batch as two halves whose gradients add up (data parallelism's split, in one process),
    which moves the parameters by rounding alone."""
    model = fam.build(model_type)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=fam.LR, eps=fam.EPS)
    probe, mode = promote.Float32Parts(), promote.Float64()
    parts = 2 if halves else 1
    with promote.in_forwards(model) if promoted else contextlib.nullcontext(mode) as mode:
        for step, b in enumerate(global_batches()):
            with probe if step == 0 else contextlib.nullcontext():
                opt.zero_grad()
                for x, y in zip(b["input"].chunk(parts), b["target"].chunk(parts)):
                    loss = fam.loss_fn(fam.logits_of(model(input_ids=x)), y)
                    (loss / parts if halves else loss).backward()
            opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = max(((params[n] - start[n]).abs().max().item() for n in params), default=0.0)
    pp_plan = getattr(model.config, "base_model_pp_plan", None)
    return {
        "params": params,
        "float32": sorted(probe.seen),
        "promoted": sorted(mode.rewrote),
        "moved": moved,
        "pp_plan": bool(pp_plan),
        "class": type(model).__name__,
    }


# --------------------------------------------------------------------------- on the ranks


def _train(topo: Any, mode: str, model_type: str, promoted: bool) -> dict[str, torch.Tensor]:
    """The user's script for one family on this mesh (its float32 parts in float64 under ``promoted``); returns
    this rank's trained parameters, whole."""
    model = fam.build(model_type)
    with promote.in_forwards(model) if promoted else contextlib.nullcontext():
        return _script(topo, mode, model)


def _script(topo: Any, mode: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import meshwise
    from meshwise.data import ArrayDataset, Shard, mesh_dataloader
    from meshwise.parallel import context_parallel

    parts, forward, options = None, None, {}
    if mode == "cp":
        model = context_parallel(model, topo)
        part = Shard(0, balanced=True)
        parts = {"input": part, "target": part}

        def forward(m, b):
            return m(input_ids=b["input"], position_ids=b["positions"])
    elif mode == "pp":
        options = {"microbatches": 2}
    else:
        options = {"tp_plan": "auto"}

        def forward(m, b):
            return m(input_ids=b["input"])

    model = meshwise.parallelize(model, topo, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=fam.LR, eps=fam.EPS)
    kwargs = {"forward": forward} if forward is not None else {}
    trainer = meshwise.create_trainer(model, opt, fam.loss_fn, topo, loss_weight="labels", **kwargs)
    loader = mesh_dataloader(ArrayDataset(dataset()), topo, global_batch_size=fam.BATCH, parts=parts)
    trainer.run(loader, max_epochs=1)
    return _local_params(model)


def _local_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()) for n, p in model.named_parameters()}


class Abort(Exception):
    """Ends a launch after an outcome that may leave the ranks' collectives out of step; the sweep relaunches."""


def _outcome(topo: Any, mode: str, model_type: str, promoted: bool, ref_dir: str) -> dict[str, Any]:
    from meshwise.errors import CollectiveError, MeshwiseError

    t0 = time.monotonic()
    try:
        params = _train(topo, mode, model_type, promoted)
    except MeshwiseError as exc:
        kind = "collective" if isinstance(exc, CollectiveError) else "refused"
        return {"kind": kind, "error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
    except Exception as exc:  # noqa: BLE001 - any other error is the sweep's finding, recorded with its traceback
        return {
            "kind": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-4000:],
            "seconds": time.monotonic() - t0,
        }
    ref = torch.load(ref_path(ref_dir, model_type, promoted))["params"]
    unknown = sorted(set(params) - set(ref))
    diffs = {n: (p - ref[n]).abs().max().item() for n, p in params.items() if n in ref}
    worst = max(diffs, key=diffs.get) if diffs else None
    return {
        "kind": "ran",
        "diff": diffs[worst] if worst else 0.0,
        "worst": worst,
        "names": sorted(params),
        "unknown": unknown,
        "seconds": time.monotonic() - t0,
    }


def _merge(mode: str, model_type: str, outs: list[dict[str, Any]], ref_names: list[str]) -> dict[str, Any]:
    """Every rank's outcome of one family on one mesh -> one record (``verdict`` and why)."""
    kinds = {o["kind"] for o in outs}
    record: dict[str, Any] = {"mode": mode, "family": model_type, "seconds": max(o["seconds"] for o in outs)}
    if kinds == {"refused"}:
        messages = {o["error"] for o in outs}
        return {**record, "verdict": "refused", "error": outs[0]["error"], "same_on_every_rank": len(messages) == 1}
    if kinds == {"ran"}:
        covered = set().union(*(o["names"] for o in outs))
        worst = max(outs, key=lambda o: o["diff"])
        record.update(diff=worst["diff"], worst=worst["worst"])
        missing = sorted(set(ref_names) - covered)
        unknown = sorted(set().union(*(o["unknown"] for o in outs)))
        if missing or unknown:
            return {**record, "verdict": "FAIL", "error": f"parameters missing {missing[:5]} unknown {unknown[:5]}"}
        return {**record, "verdict": "ran"}
    failed = [(r, o) for r, o in enumerate(outs) if o["kind"] != "ran"]
    rank, first = next(((r, o) for r, o in failed if o["kind"] == "error"), failed[0])
    return {
        **record,
        "verdict": "FAIL",
        "error": f"rank {rank}: {first['error']}",
        "traceback": first.get("traceback", ""),
        "ranks": {r: o["kind"] for r, o in enumerate(outs)},
    }


def launch(todo: list[tuple[str, str, bool]], ref_dir: str, out_file: str) -> None:
    """On every rank: each mode's mesh in turn, each of its (family, promoted) trained and compared; rank 0 appends
    one JSON line per item. An outcome that may leave collectives out of step ends the launch (``Abort``)."""
    import torch.distributed as dist

    import meshwise

    by_mode: dict[str, list[tuple[str, bool]]] = {}
    for mode, model_type, promoted in todo:
        by_mode.setdefault(mode, []).append((model_type, promoted))
    for mode, items in by_mode.items():
        topo = meshwise.init({**MODES, **BASELINES}[mode][0], timeout=PG_TIMEOUT)
        try:
            for model_type, promoted in items:
                out = _outcome(topo, mode, model_type, promoted, ref_dir)
                outs: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(outs, out)
                if dist.get_rank() == 0:
                    ref_names = sorted(torch.load(ref_path(ref_dir, model_type, promoted))["params"])
                    record = {**_merge(mode, model_type, outs, ref_names), "promoted": promoted}
                    with open(out_file, "a") as f:
                        f.write(json.dumps(record) + "\n")
                if any(o["kind"] in ("error", "collective") for o in outs) or len({o["kind"] for o in outs}) > 1:
                    raise Abort(f"{mode} {model_type}: {[o['kind'] for o in outs]}")
        finally:
            meshwise.shutdown()


# --------------------------------------------------------------------------- the driver


def verdict(
    record: dict[str, Any],
    ref: dict[str, Any],
    baseline: dict[str, Any] | None = None,
    as_is: float | None = None,
    halves: float | None = None,
) -> dict[str, Any]:
    """A ``ran`` record judged: ``equal`` (within EQUAL, or within ROUNDING_CAP where ``baseline``, the family's
    record at pure data parallelism, is too: float64 rounding amplified by AdamW), ``float32`` (the same, for a
    record run with the family's float32 parts in float64: ``as_is`` off without, or ``halves`` off in one process
    alone) or ``FAIL``. ``ref``: the record's reference."""
    if record["verdict"] != "ran":
        return record
    diff, promoted = record["diff"], record.get("promoted", False)
    kind = "float32" if promoted else "equal"
    if promoted:
        record = {**record, **({"as_is": as_is} if as_is is not None else {"halves": halves})}
    if promoted and ref["float32"]:
        return {**record, "verdict": "FAIL", "error": f"{ref['float32']} parts left after promotion to float64"}
    if diff <= EQUAL:
        return {**record, "verdict": kind}
    floor = baseline["diff"] if baseline and baseline["verdict"] == "ran" else None
    if floor is not None and floor <= ROUNDING_CAP and diff <= ROUNDING_CAP:
        return {**record, "verdict": kind, "baseline": floor}
    why = ", its float32 parts in float64" if promoted else ""
    why += f" ({as_is:.2e} as is)" if promoted and as_is is not None else ""
    why += f" (one process in halves {halves:.2e} as is)" if promoted and as_is is None and halves else ""
    dp = f"; at pure data parallelism {floor:.2e}" if floor is not None else ""
    return {
        **record,
        "verdict": "FAIL",
        "error": f"trains differently: {diff:.2e} off one process{why} in {record['worst']}{dp}",
    }


def _over(record: dict[str, Any]) -> bool:
    return record["verdict"] == "ran" and record["diff"] > EQUAL


def run(
    out_path: str | os.PathLike,
    types: list[str] | None = None,
    modes: list[str] | None = None,
    work: str | os.PathLike | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """The whole sweep: references in this process (for a family with float32 parts also its global batches in
    halves, and where those move it past EQUAL a reference with the parts in float64, which its cells train with),
    then few launches (the 2-rank modes in one, dp=2 x tp=2 in another), relaunched past any outcome that ends one;
    then the other cells above EQUAL of families with float32 parts again in float64, and the families still above
    EQUAL at pure data parallelism (their baselines). Writes and returns the results."""
    import tempfile

    t_start = time.monotonic()
    names = fam.causal_lm_types()
    types = sorted(names) if types is None else types
    modes = list(MODES) if modes is None else modes
    work = Path(work or tempfile.mkdtemp(prefix="meshwise-sweep-"))
    ref_dir = work / "refs"
    ref_dir.mkdir(parents=True, exist_ok=True)
    families: dict[str, dict[str, Any]] = {}
    for model_type in types:
        entry: dict[str, Any] = {"class": names[model_type]}
        try:
            ref = reference(model_type)
        except Exception as exc:  # noqa: BLE001 - a family that cannot be built tiny is recorded, not hidden
            entry["not_built"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
        else:
            torch.save(ref, ref_path(ref_dir, model_type, False))
            entry.update(float32=ref["float32"], moved=ref["moved"], pp_plan=ref["pp_plan"], modes={})
            if ref["float32"]:  # how far its float32 rounding alone moves it: beyond EQUAL, its meshes run promoted
                entry["halves"] = _largest(reference(model_type, halves=True)["params"], ref["params"])
        families[model_type] = entry
    built = [t for t in types if "not_built" not in families[t]]
    log(f"sweep: {len(built)} of {len(types)} families built ({time.monotonic() - t_start:.0f} s)")
    for model_type in built:
        if "pp" in modes and not families[model_type]["pp_plan"]:
            families[model_type]["modes"]["pp"] = {"verdict": "n/a", "error": "no base_model_pp_plan"}
    promoted = {t for t in built if families[t].get("halves", 0.0) > EQUAL}
    for model_type in sorted(promoted):
        _promoted_reference(model_type, families[model_type], ref_dir)
    todo = [(m, t, t in promoted) for m in modes for t in built if m not in families[t]["modes"]]
    records = _launch_groups(todo, ref_dir, work, log)
    # an as-is cell above EQUAL of a family with float32 parts that rounding in one process did not move: again
    again = [(m, t, True) for (m, t, p), r in records.items() if not p and _over(r) and families[t]["float32"]]
    for model_type in sorted({t for _, t, _ in again} - promoted):
        _promoted_reference(model_type, families[model_type], ref_dir)
    records.update(_launch_groups(again, ref_dir, work, log))
    final = {(m, t): r for (m, t, p), r in records.items() if p or (m, t, True) not in records}
    over = sorted({(t, r.get("promoted", False)) for (_, t), r in final.items() if _over(r)})
    baselines = _launch_groups([("dp", t, p) for t, p in over], ref_dir, work, log)
    for (_, model_type, _), r in baselines.items():
        families[model_type]["baseline"] = {
            k: r[k] for k in ("promoted", "verdict", "diff", "worst", "error") if k in r
        }
    for (mode, model_type), r in final.items():
        ref = torch.load(ref_path(ref_dir, model_type, r.get("promoted", False)))
        as_is = records.get((mode, model_type, False), {}).get("diff")
        base = baselines.get(("dp", model_type, r.get("promoted", False)))
        families[model_type]["modes"][mode] = verdict(r, ref, base, as_is, families[model_type].get("halves"))
    results = {
        "transformers": _version("transformers"),
        "torch": torch.__version__,
        "modes": {m: MODES[m][0] for m in modes},
        "seconds": round(time.monotonic() - t_start, 1),
        "families": families,
    }
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return results


def _largest(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(((params[n] - ref[n]).abs().max().item() for n in ref), default=0.0)


def _promoted_reference(model_type: str, entry: dict[str, Any], ref_dir: Path) -> None:
    ref = reference(model_type, promoted=True)
    torch.save(ref, ref_path(ref_dir, model_type, True))
    entry["promoted"] = ref["promoted"]


def _launch_groups(
    todo: list[tuple[str, str, bool]], ref_dir: Path, work: Path, log: Any
) -> dict[tuple[str, str, bool], dict[str, Any]]:
    """``(mode, family, promoted)`` -> its record (not yet judged): the 2-rank items in launches of their own, the
    4-rank ones in theirs."""
    out: dict[tuple[str, str, bool], dict[str, Any]] = {}
    for nprocs in (2, 4):
        out.update(
            _launches(nprocs, [i for i in todo if {**MODES, **BASELINES}[i[0]][1] == nprocs], ref_dir, work, log)
        )
    return out


def _launches(
    nprocs: int, todo: list[tuple[str, str, bool]], ref_dir: Path, work: Path, log: Any
) -> dict[tuple[str, str, bool], dict[str, Any]]:
    """The records of ``todo`` from as many launches of ``nprocs`` ranks as it takes: one past each outcome that
    ends a launch; an item in flight when a launch died is a FAIL."""
    from meshwise.testing import DistributedFailure, run_distributed

    out: dict[tuple[str, str, bool], dict[str, Any]] = {}
    while todo:
        out_file = work / f"launch-{len(list(work.glob('launch-*.jsonl')))}.jsonl"
        t0 = time.monotonic()
        failure = None
        try:
            run_distributed(
                launch,
                nprocs,
                todo,
                str(ref_dir),
                str(out_file),
                timeout=60 + SECONDS_PER_RUN * len(todo),
                pg_timeout=PG_TIMEOUT,
            )
        except DistributedFailure as exc:
            failure = str(exc)
        records = [json.loads(line) for line in out_file.read_text().splitlines()] if out_file.exists() else []
        out.update(((r["mode"], r["family"], r["promoted"]), r) for r in records)
        done = len(records)
        if failure is not None and done < len(todo) and "Abort: " not in failure:
            mode, model_type, promoted = todo[done]  # in flight when the launch died: no record of its own
            error = "the launch died: " + failure[:3000]
            out[todo[done]] = {
                "mode": mode,
                "family": model_type,
                "promoted": promoted,
                "verdict": "FAIL",
                "error": error,
            }
            done += 1
        what = f", {sum(i[2] for i in todo)} with float32 parts in float64" if any(i[2] for i in todo) else ""
        log(f"sweep: a launch of {nprocs} ranks{what} recorded {done} of {len(todo)} in {time.monotonic() - t0:.0f} s")
        if done == 0:
            raise RuntimeError(f"the sweep's launch recorded nothing: {failure}")
        todo = todo[done:]
    return out


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def failures(results: dict[str, Any]) -> list[str]:
    """One line per (family, mode) that trained differently or failed with anything but a MeshwiseError."""
    return [
        f"{t} {m}: {r['error']}"
        for t, e in sorted(results["families"].items())
        for m, r in sorted(e.get("modes", {}).items())
        if r["verdict"] == "FAIL"
    ]
