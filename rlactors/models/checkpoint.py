"""Hugging Face checkpoint directories: ``config.json`` plus safetensors, single or sharded.

What ``save_pretrained`` writes loads in HF transformers and vLLM; what they write loads here.
Tied embeddings keep one tensor: ``lm_head.weight`` is neither saved nor expected on load.

On disk a mixture of experts has the hub's layout, one tensor per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``); in memory each layer's experts are two fused
parameters (``rlactors.models.moe.Experts``). ``fuse_experts`` and ``split_experts`` convert;
every other tensor has the same name and shape in both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from rlactors.models.args import DTYPES, ModelArgs
from rlactors.models.decoder import DecoderForCausalLM
from rlactors.models.tokenizer import VOCABULARY_FILES
from rlactors.storage.manifest import MANIFEST_FILE, verify

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TIED_KEY = "lm_head.weight"
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Everything a tokenizer (and generation defaults) may need; copy_tokenizer_files copies those present.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def check_checkpoint_dir(ckpt_dir: str | Path) -> ModelArgs:
    """Checks, without loading a weight, that ``ckpt_dir`` holds what a run loads: a ``config.json``
    of a supported family, weight files whose tensors match it (and their manifest, where the dir
    has one: an rlactors checkpoint's hf/ export), and a tokenizer vocabulary.
    Returns its ModelArgs; raises ValueError (one line, naming what is missing or wrong)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise ValueError(f"checkpoint directory not found: {ckpt_dir}")
    if not (ckpt_dir / CONFIG_FILE).is_file():
        raise ValueError(f"{ckpt_dir} is not a HF checkpoint directory (no {CONFIG_FILE})")
    try:
        config = json.loads((ckpt_dir / CONFIG_FILE).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{ckpt_dir / CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{ckpt_dir / CONFIG_FILE} is not a JSON object")
    try:
        args = ModelArgs.from_hf_config(config)
    except ValueError as e:
        raise ValueError(f"{ckpt_dir}: {e}") from None
    if (ckpt_dir / MANIFEST_FILE).is_file() and (damage := verify(ckpt_dir)):  # a checkpoint's hf/ export
        raise ValueError(f"{ckpt_dir} is damaged: {damage}")
    index = ckpt_dir / INDEX_FILE
    if not index.is_file() and not (ckpt_dir / SINGLE_FILE).is_file():
        raise ValueError(f"{ckpt_dir} holds no weights (neither {SINGLE_FILE} nor {INDEX_FILE})")
    if index.is_file():
        absent = [name for name in _weight_files(ckpt_dir) if not (ckpt_dir / name).is_file()]
        if absent:
            raise ValueError(f"{ckpt_dir}: {INDEX_FILE} names weight files that are missing: {', '.join(absent)}")
    try:
        with open_tensors(ckpt_dir):  # reads the files' headers: names and shapes against config.json
            pass
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{ckpt_dir}: cannot read the weights: {' '.join(str(e).split())}") from None
    if not any((ckpt_dir / name).is_file() for name in VOCABULARY_FILES):
        raise ValueError(f"{ckpt_dir} has no tokenizer files (none of {', '.join(VOCABULARY_FILES)}); "
                         "copy them from the model the weights come from")
    return args


def load_args(ckpt_dir: str | Path) -> ModelArgs:
    path = Path(ckpt_dir) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{ckpt_dir} is not a checkpoint directory: {CONFIG_FILE} not found")
    return ModelArgs.from_hf_config(json.loads(path.read_text()))


def model_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """The model's parameter names and shapes in memory, in module order (no tied head).

    Built on the meta device, so it allocates nothing even for the largest shapes.
    """
    with torch.device("meta"):
        model = DecoderForCausalLM(args)
    return {k: v.shape for k, v in model.state_dict().items()
            if not (args.tie_word_embeddings and k == TIED_KEY)}


def checkpoint_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """Tensor names and shapes a checkpoint of ``args`` holds on disk (experts one by one)."""
    with torch.device("meta"):
        fused = {name: torch.empty(shape) for name, shape in model_shapes(args).items()}
    return {name: t.shape for name, t in split_experts(fused, args).items()}


def expert_tensor_names(args: ModelArgs) -> dict[str, list[list[str]]]:
    """Each fused expert parameter's name -> for each expert, the checkpoint tensors whose rows,
    concatenated in this order, are that expert's slice (gate then up for ``gate_up_proj``)."""
    names = {}
    for layer in range(args.num_hidden_layers):
        if args.is_sparse_layer(layer):
            prefix = f"model.layers.{layer}.mlp.experts"
            experts = range(args.moe.num_experts)
            names[f"{prefix}.gate_up_proj"] = [[f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight"]
                                               for e in experts]
            names[f"{prefix}.down_proj"] = [[f"{prefix}.{e}.down_proj.weight"] for e in experts]
    return names


def fuse_experts(tensors: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Checkpoint layout -> model layout: each layer's per-expert tensors stacked into its fused
    parameters; the other tensors as they are."""
    fused = expert_tensor_names(args)
    per_expert = {name for experts in fused.values() for parts in experts for name in parts}
    out = {name: t for name, t in tensors.items() if name not in per_expert}
    for name, experts in fused.items():
        out[name] = torch.stack([torch.cat([tensors[part] for part in parts]) for parts in experts])
    return out


def split_experts(tensors: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Model layout -> checkpoint layout: each fused expert parameter as one view per expert and
    projection; the other tensors as they are."""
    fused = expert_tensor_names(args)
    out = {}
    for name, tensor in tensors.items():
        if name not in fused:
            out[name] = tensor
            continue
        for e, parts in enumerate(fused[name]):
            out.update(zip(parts, tensor[e].chunk(len(parts))))
    return out


class _FusedExpertsHandle:
    """A fused expert parameter read lazily from the per-expert tensors of a checkpoint, like a
    safetensors slice: ``handle[a:b]`` reads experts ``a .. b-1`` and nothing else."""

    def __init__(self, experts: list[list[Any]], shape: torch.Size):
        self.experts, self.shape = experts, shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: slice) -> torch.Tensor:
        chosen = self.experts[index]
        if not chosen:
            return self.experts[0][0][0:0].reshape(0, *self.shape[1:])
        return torch.stack([torch.cat([part[:] for part in parts]) for parts in chosen])


def _weight_files(ckpt_dir: Path) -> list[str]:
    index_path = ckpt_dir / INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    if (ckpt_dir / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    raise ValueError(f"{ckpt_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def load_state_dict(ckpt_dir: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor in the checkpoint's safetensors files (as stored, no dtype change)."""
    ckpt_dir = Path(ckpt_dir)
    state_dict = {}
    for name in _weight_files(ckpt_dir):
        with safe_open(ckpt_dir / name, framework="pt", device=str(device)) as f:
            for key in f.keys():
                state_dict[key] = f.get_tensor(key)
    return state_dict


@contextlib.contextmanager
def open_tensors(ckpt_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Lazy handles of the checkpoint's tensors, checked against its config, by the model's
    parameter names: name -> a safetensors slice, of which ``handle[a:b]`` reads rows
    ``a .. b-1`` from disk and nothing else (as stored, no dtype change); a fused expert
    parameter's handle reads experts ``a .. b-1`` from their per-expert tensors. Tied
    embeddings: no ``lm_head.weight``. The files stay open inside the ``with`` block.
    """
    ckpt_dir = Path(ckpt_dir)
    args = load_args(ckpt_dir)
    with contextlib.ExitStack() as files:
        handles = {}
        for name in _weight_files(ckpt_dir):
            f = files.enter_context(safe_open(ckpt_dir / name, framework="pt"))
            handles.update({key: f.get_slice(key) for key in f.keys()})
        if args.tie_word_embeddings:
            handles.pop(TIED_KEY, None)  # some exporters also write the tied head
        _check_keys_and_shapes({k: torch.Size(h.get_shape()) for k, h in handles.items()}, args, str(ckpt_dir))
        shapes = model_shapes(args)
        for name, experts in expert_tensor_names(args).items():
            handles[name] = _FusedExpertsHandle([[handles.pop(part) for part in parts] for parts in experts],
                                                shapes[name])
        yield handles


def from_pretrained(ckpt_dir: str | Path, dtype: torch.dtype | str | None = None,
                    device: str | torch.device = "cpu") -> DecoderForCausalLM:
    """Loads a HF checkpoint dir of any supported family (``ModelArgs``); ``dtype=None`` keeps
    the config's ``torch_dtype``.

    Tensors are read straight onto ``device`` and the module is built on the meta device, so
    nothing is allocated twice.
    """
    args = load_args(ckpt_dir)
    dtype = _resolve_dtype(dtype, args)
    # model.args describes the loaded model, so its torch_dtype is the dtype it was loaded in.
    args = dataclasses.replace(args, torch_dtype=_DTYPE_NAMES[dtype])
    state_dict = load_state_dict(ckpt_dir, device)
    if args.tie_word_embeddings:
        # Some exporters also write the tied head; it is the embedding by definition.
        state_dict.pop(TIED_KEY, None)
    _check_keys_and_shapes({k: v.shape for k, v in state_dict.items()}, args, where=str(ckpt_dir))
    state_dict = {k: v.to(dtype) for k, v in fuse_experts(state_dict, args).items()}
    if args.tie_word_embeddings:
        state_dict[TIED_KEY] = state_dict["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = DecoderForCausalLM(args)
    model.load_state_dict(state_dict, assign=True)
    model.tie_weights()
    return model


def save_pretrained(model_or_state_dict: nn.Module | dict[str, torch.Tensor], args: ModelArgs,
                    ckpt_dir: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Writes ``config.json`` and the weights into ``ckpt_dir`` (created if needed).

    Weights go to ``model.safetensors``, or, when they exceed ``max_shard_bytes``, to
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``. Weight
    files left by an earlier save in the same dir are removed first so no stale shard is read.
    ``config.json``'s ``torch_dtype`` is the dtype of the tensors written. Tensors must be full
    (gather sharded DTensors before calling), under the model's names (fused experts): they are
    written in the checkpoint layout (one tensor per expert).
    """
    if isinstance(model_or_state_dict, nn.Module):
        state_dict = model_or_state_dict.state_dict()
    else:
        state_dict = dict(model_or_state_dict)
    if args.tie_word_embeddings:
        state_dict.pop(TIED_KEY, None)
    _check_keys_and_shapes({k: v.shape for k, v in state_dict.items()}, args, where="the state dict to save",
                           expected=model_shapes(args))
    state_dict = split_experts({k: state_dict[k] for k in model_shapes(args)}, args)
    tensors = _saveable_tensors({k: state_dict[k] for k in checkpoint_shapes(args)})
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES.values():
        raise ValueError(f"weights must share one floating dtype of {sorted(DTYPES)}, got {dtypes}")
    saved_dtype = _DTYPE_NAMES[dtypes.pop()]
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for stale in [ckpt_dir / SINGLE_FILE, ckpt_dir / INDEX_FILE, *ckpt_dir.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)

    config = dataclasses.replace(args, torch_dtype=saved_dtype).to_hf_config()
    (ckpt_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    # safetensors writes its files 0600 (a private temp file renamed into place): give them the
    # mode config.json got from the umask, like every other file of the dir.
    mode = (ckpt_dir / CONFIG_FILE).stat().st_mode & 0o777

    def save(shard: dict[str, torch.Tensor], name: str) -> None:
        save_file(shard, ckpt_dir / name, metadata={"format": "pt"})
        os.chmod(ckpt_dir / name, mode)

    shards = _split_into_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save(shards[0], SINGLE_FILE)
        return ckpt_dir
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save(shard, name)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (ckpt_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return ckpt_dir


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copies the tokenizer and generation-config files present in ``src_dir``; returns their names."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    names = [name for name in TOKENIZER_FILES if (src_dir / name).is_file()]
    if not any(name in names for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ValueError(f"{src_dir} holds no tokenizer files")
    dst_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(src_dir / name, dst_dir / name)
    return names


def _resolve_dtype(dtype: torch.dtype | str | None, args: ModelArgs) -> torch.dtype:
    if dtype is None:
        return args.dtype
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {list(DTYPES.values())}, got {dtype}")
    return dtype


def _check_keys_and_shapes(shapes: dict[str, torch.Size], args: ModelArgs, where: str,
                           expected: dict[str, torch.Size] | None = None) -> None:
    """Raises naming the missing, unexpected and misshapen tensors; ``expected`` defaults to the
    checkpoint layout."""
    expected = checkpoint_shapes(args) if expected is None else expected
    missing, unexpected = sorted(expected.keys() - shapes.keys()), sorted(shapes.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{where} does not match the config: missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
    for key, shape in expected.items():
        if shapes[key] != shape:
            raise ValueError(f"{where}: {key} has shape {tuple(shapes[key])}, the config needs {tuple(shape)}")


def _saveable_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors that each own their storage, as safetensors requires (a tied
    embedding saved untied, or a view of a larger buffer, gets copied)."""
    tensors, seen_storages = {}, set()
    for key, tensor in state_dict.items():
        if hasattr(tensor, "full_tensor"):
            raise ValueError(f"{key} is a sharded DTensor: gather full tensors before save_pretrained")
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen_storages or storage.nbytes() != tensor.nbytes:
            tensor = tensor.clone()
        seen_storages.add(tensor.untyped_storage().data_ptr())
        tensors[key] = tensor
    return tensors


def _split_into_shards(tensors: dict[str, torch.Tensor],
                       max_shard_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    """Greedy in key order; a tensor larger than the limit gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        if max_shard_bytes is not None and shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += tensor.nbytes
    return shards
