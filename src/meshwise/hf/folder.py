"""Export to a Hugging Face folder: ``config.json`` plus safetensors weights that ``from_pretrained`` reads.

``export_hf(checkpoint, out_dir, config=...)`` reads the model's whole tensors in one process (as
:func:`meshwise.checkpoint.export.export` does), checks their names against the model class the config names, and
writes ``model.safetensors`` (or numbered shards with ``model.safetensors.index.json`` past ``max_shard_size``);
``load_hf(folder, model)`` is the way back in: such a folder (or a ``save_pretrained`` one) into a sharded model.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from meshwise import compat
from meshwise.checkpoint.consolidated import read_model
from meshwise.checkpoint.safe import inside
from meshwise.errors import CheckpointError
from meshwise.hf.plans import is_hf_model

__all__ = ["CONFIG_IGNORED", "export_hf", "load_hf"]

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
    trust: bool = False,
) -> Path:
    """Write the model ``key`` of ``checkpoint`` as a Hugging Face folder: ``config.json`` and safetensors weights.

    ``config``: a transformers ``PretrainedConfig``, a config.json, or a folder holding one; its model class (through
    ``AutoModelForCausalLM``) names the keys expected, and any key missing or unexpected is a
    :class:`CheckpointError` naming them. Weights tied in that class (``lm_head.weight`` to the embeddings under
    ``tie_word_embeddings``) are written once, under the first name, as ``save_pretrained`` does; ``from_pretrained``
    ties them again. Past ``max_shard_size`` bytes the weights are split into numbered files with
    ``model.safetensors.index.json``. A folder that already holds a model (config.json, an index or any .safetensors)
    is refused with nothing written. The checkpoint is read as data (``trust``: see
    :func:`meshwise.checkpoint.consolidated.read_model`). Returns ``out_dir``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    _refuse_occupied(out)
    config = _config(config)
    cls, names, tied = _expected(config)
    state = read_model(checkpoint, key, trust=trust)
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


# config.json fields that do not change what the weights mean (bookkeeping, generation, training-only options):
# a fine-tuned folder may differ from the model in these. Fields starting with "_" are skipped too.
CONFIG_IGNORED = frozenset(
    {
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "initializer_range",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)


def _check_config(path: Path, model: torch.nn.Module) -> None:
    """A transformers model and the folder's config.json must agree on every field that shapes the weights' meaning."""
    if not is_hf_model(model) or not (path / "config.json").is_file():
        return
    try:
        saved = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path / 'config.json'} is not JSON ({exc}): pass a save_pretrained folder") from exc
    own = model.config.to_dict()
    differ = {
        k: (v, own[k])
        for k, v in saved.items()
        if k in own and not k.startswith("_") and k not in CONFIG_IGNORED and "dropout" not in k and own[k] != v
    }
    if differ:
        listed = ", ".join(f"{k}: folder {a!r}, model {b!r}" for k, (a, b) in sorted(differ.items()))
        raise CheckpointError(
            f"{path / 'config.json'} does not match {type(model).__name__}'s config ({listed}); nothing was read: "
            "build the model from that config (AutoConfig.from_pretrained(folder)) or pass the folder it belongs to"
        )


def _counting_reader(path: Path) -> Any:
    """DCP's ``HuggingFaceStorageReader`` that counts the bytes it takes from the files: every tensor slice it
    copies out and every safetensors header it parses (the files are memory-mapped, so /proc/self/io sees none)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    class CountingReader(HuggingFaceStorageReader):
        bytes_read = 0

        def read_metadata(self) -> Any:
            for f in Path(self.path).glob("*.safetensors"):  # the reader parses each file's header
                with open(f, "rb") as fh:
                    self.bytes_read += 8 + int.from_bytes(fh.read(8), "little")
            return super().read_metadata()

        def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
            itemsize = self.storage_data[req.storage_index].dtype.itemsize
            self.bytes_read += math.prod(req.lengths) * itemsize
            super()._process_read_request(f, req, planner)

    return CountingReader(str(path))


def _restore_buffers(model: torch.nn.Module) -> None:
    """Recompute non-persistent buffers (rotary ``inv_freq``), which no safetensors file holds and ``to_empty``
    leaves uninitialised, with the model's own ``_init_weights``, as ``from_pretrained`` does."""
    init = compat.hf_init_weights(model)
    if not is_hf_model(model) or init is None:
        return
    with torch.no_grad():
        for module in model.modules():
            own = {name for name, _ in module.named_buffers(recurse=False)}
            if own and own - set(module.state_dict(keep_vars=True)):  # a buffer no state dict (or file) holds
                init(module)  # may also touch the module's own parameters: the load below overwrites them


def _refuse_broken_tie(model: torch.nn.Module, missing: list[str]) -> None:
    """A config that ties the output embeddings to the input ones, on a model whose two are separate tensors: a
    meta-built model that ``to_empty`` materialised without tying (the folder holds the tied weight once)."""
    if not is_hf_model(model) or not getattr(model.config, "tie_word_embeddings", False):
        return
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None or getattr(inputs, "weight", None) is getattr(outputs, "weight", None):
        return
    raise CheckpointError(
        f"{type(model).__name__}'s config has tie_word_embeddings=True, but its input and output embeddings are "
        f"two tensors, so {missing} (stored once, as the tied weight) is not in the folder: model.to_empty() "
        "unties a model built on the meta device. Call model.tie_weights() right after model.to_empty(...), "
        "before load_hf() and before building the optimizer"
    )


def load_hf(folder: str | os.PathLike, model: torch.nn.Module) -> int:
    """Load a safetensors folder (``save_pretrained``'s or :func:`export_hf`'s) into ``model``, sharded or not.

    Call it on every rank after ``parallelize()``; the model may have been built on the meta device and
    materialised with ``to_empty``. DCP's ``HuggingFaceStorageReader`` reads, on each rank, only the slices of
    each tensor its shards hold, so no rank holds the whole model. Checked before anything is read, each a
    :class:`CheckpointError` naming the fields or keys: the folder's config.json against a transformers model's
    config (fields in :data:`CONFIG_IGNORED` and dropouts aside), keys missing from the folder (a tied alias such
    as ``lm_head.weight`` excepted) or left over in it, and shapes that differ. A transformers model's
    non-persistent buffers (rotary ``inv_freq``) are recomputed by its ``_init_weights``. Returns the bytes this
    rank read from the files (tensor slices plus safetensors headers). safetensors files and config.json hold no
    code; a file that is a symlink leading out of the folder is refused.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = Path(folder)
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise CheckpointError(f"no *.safetensors in {path}: pass a folder written by save_pretrained or export_hf")
    for file in [*path.glob("*.safetensors"), path / "config.json"]:
        inside(path, file)  # safetensors and JSON hold no code; a symlink out of the folder is still refused
    _check_config(path, model)
    state = get_model_state_dict(model)
    saved = _counting_reader(path).read_metadata().state_dict_metadata
    first: dict[int, str] = {}
    aliases = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases.add(name)  # shares a tensor with an earlier key: save_pretrained writes it once
        else:
            first[id(tensor)] = name
    missing = sorted(n for n in state if n not in saved and n not in aliases)
    unexpected = sorted(set(saved) - set(state))
    if missing:
        _refuse_broken_tie(model, missing)
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match {type(model).__name__}: missing {missing}, unexpected {unexpected}; "
            "load it into the model class and config it was saved from"
        )
    shapes = {
        n: (tuple(saved[n].size), tuple(t.shape))  # a DTensor's shape is the global one
        for n, t in state.items()
        if n in saved and tuple(saved[n].size) != tuple(t.shape)
    }
    if shapes:
        listed = ", ".join(f"{n}: folder {a}, model {b}" for n, (a, b) in sorted(shapes.items()))
        raise CheckpointError(
            f"{path} holds other shapes than {type(model).__name__} ({listed}); nothing was read: "
            "build the model from the folder's config"
        )
    _restore_buffers(model)
    reader = _counting_reader(path)
    try:
        dcp_load({n: t for n, t in state.items() if n in saved}, storage_reader=reader)
    except Exception as exc:
        raise CheckpointError(f"reading {path} failed: {exc}") from exc
    # The DCP load filled the state's tensors; setting them back is what makes it hold for every wrapper.
    set_model_state_dict(model, state)
    return reader.bytes_read
