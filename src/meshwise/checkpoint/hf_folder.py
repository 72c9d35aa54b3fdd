"""Export to a Hugging Face folder: ``config.json`` plus safetensors weights that ``from_pretrained`` reads.

``export_hf(checkpoint, out_dir, config=...)`` reads the model's whole tensors in one process (as
:func:`meshwise.checkpoint.export.export` does), checks their names against the model class the config names, and
writes ``model.safetensors`` (or numbered shards with ``model.safetensors.index.json`` past ``max_shard_size``);
``load_hf(folder, model)`` is the way back in: such a folder (or a ``save_pretrained`` one) into a sharded model.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch

from meshwise.checkpoint.export import read_model
from meshwise.errors import CheckpointError

__all__ = ["export_hf", "load_hf"]

INDEX = "model.safetensors.index.json"


def _config(config: Any) -> Any:
    """A transformers ``PretrainedConfig``: the one given, or read from a config.json or a folder holding one."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return copy.deepcopy(config)  # architectures is filled in below: the caller's object stays as it was
    path = Path(config)
    if path.is_file():
        path = path.parent if path.name == "config.json" else path
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"no config.json at {config}: pass config= a transformers PretrainedConfig, a config.json, or its folder"
        )
    return AutoConfig.from_pretrained(str(path))


def _refuse_occupied(out: Path) -> None:
    """Another model's files in ``out`` would mix with ours (from_pretrained reads the index first): refuse."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file, not a folder: pass a new or empty folder to export into")
    if not out.is_dir():
        return
    found = sorted(p.name for p in out.iterdir() if p.name in ("config.json", INDEX) or p.suffix == ".safetensors")
    if found:
        raise CheckpointError(
            f"{out} already holds a model ({', '.join(found)}); nothing was written: "
            "export into a new or empty folder, or remove those files first"
        )


def _expected(config: Any) -> tuple[type, list[str], dict[str, str]]:
    """The model class for ``config``, its saved key names, and tied aliases (alias -> the key it shares)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # names and sharing only: no memory, no init
        model = AutoModelForCausalLM.from_config(config)
    names = list(model.state_dict(keep_vars=True))
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            tied[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return type(model), names, tied


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in key order, as save_pretrained does: a shard closes before it would pass ``max_bytes``."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def export_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    config: Any,
    key: str = "model",
    max_shard_size: int = 5 * 10**9,
) -> Path:
    """Write the model ``key`` of ``checkpoint`` as a Hugging Face folder: ``config.json`` and safetensors weights.

    ``config``: a transformers ``PretrainedConfig``, a config.json, or a folder holding one; its model class (through
    ``AutoModelForCausalLM``) names the keys expected, and any key missing or unexpected is a
    :class:`CheckpointError` naming them. Weights tied in that class (``lm_head.weight`` to the embeddings under
    ``tie_word_embeddings``) are written once, under the first name, as ``save_pretrained`` does; ``from_pretrained``
    ties them again. Past ``max_shard_size`` bytes the weights are split into numbered files with
    ``model.safetensors.index.json``. A folder that already holds a model (config.json, an index or any .safetensors)
    is refused with nothing written. Returns ``out_dir``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    _refuse_occupied(out)
    config = _config(config)
    cls, names, tied = _expected(config)
    state = read_model(checkpoint, key)
    extra = [k for k, v in state.items() if v is None]
    if extra:
        raise CheckpointError(f"{key!r} holds non-tensor values {extra}, which safetensors cannot store")
    missing = [n for n in names if n not in state and not (n in tied and tied[n] in state)]
    unexpected = sorted(set(state) - set(names))
    if missing or unexpected:
        raise CheckpointError(
            f"the checkpoint's {key!r} does not match {cls.__name__} for this config: missing {missing}, "
            f"unexpected {unexpected}; pass the config the model was built from (or key= the right object)"
        )
    # In the class's own order, aliases dropped, contiguous: safetensors refuses shared or strided storage.
    weights = {n: state[n].contiguous() for n in names if n not in tied}
    shards = _shards(weights, max_shard_size)
    if len(shards) == 1:
        files = {"model.safetensors": shards[0]}
    else:
        files = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s for i, s in enumerate(shards)}
    config.architectures = config.architectures or [cls.__name__]
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        # Each file is written beside its name and renamed: a killed export leaves only .partial files behind.
        for name, shard in files.items():
            save_file(shard, str(out / f".{name}.partial"), metadata={"format": "pt"})
            written.append(out / f".{name}.partial")
        if len(files) > 1:
            index = {
                "metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
                "weight_map": {n: f for f, shard in files.items() for n in shard},
            }
            (out / f".{INDEX}.partial").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            written.append(out / f".{INDEX}.partial")
        config.to_json_file(str(out / ".config.json.partial"))
        written.append(out / ".config.json.partial")
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        raise
    for p in written:  # config.json last: a folder with config.json is complete
        os.replace(p, out / p.name[1 : -len(".partial")])
    return out


def load_hf(folder: str | os.PathLike, model: torch.nn.Module) -> None:
    """Load a safetensors folder (``save_pretrained``'s or :func:`export_hf`'s) into ``model``, sharded or not.

    Call it on every rank after ``parallelize()``: DCP's ``HuggingFaceStorageReader`` reads, on each rank, only the
    slices of each tensor its shards hold. Keys are the model's own names; one missing from the folder (except a
    tied alias such as ``lm_head.weight``) or left over in it is a :class:`CheckpointError` naming them, raised
    before anything is read.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = Path(folder)
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise CheckpointError(f"no *.safetensors in {path}: pass a folder written by save_pretrained or export_hf")
    state = get_model_state_dict(model)
    saved = set(HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata)
    first: dict[int, str] = {}
    aliases = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases.add(name)  # shares a tensor with an earlier key: save_pretrained writes it once
        else:
            first[id(tensor)] = name
    missing = sorted(n for n in state if n not in saved and n not in aliases)
    unexpected = sorted(saved - set(state))
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match {type(model).__name__}: missing {missing}, unexpected {unexpected}; "
            "load it into the model class and config it was saved from"
        )
    try:
        dcp_load({n: t for n, t in state.items() if n in saved}, storage_reader=HuggingFaceStorageReader(str(path)))
    except Exception as exc:
        raise CheckpointError(f"reading {path} failed: {exc}") from exc
    # The DCP load filled the state's tensors; setting them back is what makes it hold for every wrapper.
    set_model_state_dict(model, state)
