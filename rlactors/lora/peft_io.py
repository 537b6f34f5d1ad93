"""PEFT LoRA adapter directories in and out: ``adapter_config.json`` and
``adapter_model.safetensors``, with PEFT's key names
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), so that
``peft.PeftModel.from_pretrained(base, dir)`` loads what a run trained, and a PEFT adapter can
start a run (``model.lora.init_from``).

Only what ``model.lora`` computes is read: a plain LoRA adapter (no DoRA, rsLoRA, bias, or
extra trained modules) whose rank, alpha and targets are the config's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from rlactors.config import LoraConfig
from rlactors.lora.adapters import targeted

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's, before the base model's own parameter names


def save_peft_adapter(adapters: dict[str, torch.Tensor], config: LoraConfig, base_model: str,
                      out_dir: str | Path) -> Path:
    """Writes ``adapters`` (our names, as ``adapter_parameters`` holds them) as a PEFT LoRA adapter
    of the model at ``base_model`` into ``out_dir``; returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
        "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout,
        "target_modules": sorted(config.target_modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
    }
    (out_dir / CONFIG_FILE).write_text(json.dumps(peft_config, indent=2) + "\n")
    save_file({PREFIX + name: t.detach().contiguous().cpu() for name, t in adapters.items()},
              str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir


def load_peft_adapter(adapter_dir: str | Path, model: nn.Module, config: LoraConfig) -> dict[str, torch.Tensor]:
    """The adapters of the PEFT LoRA adapter in ``adapter_dir`` for ``model`` (the plain decoder;
    ``config.target_modules`` its targets), fp32, by our names. Raises ValueError naming what does
    not match ``config`` or the model."""
    adapter_dir = Path(adapter_dir)
    where = f"model.lora.init_from: {adapter_dir}"
    if not (adapter_dir / CONFIG_FILE).is_file() or not (adapter_dir / WEIGHTS_FILE).is_file():
        raise ValueError(f"{where} is not a PEFT adapter dir ({CONFIG_FILE} and {WEIGHTS_FILE} expected)")
    saved = json.loads((adapter_dir / CONFIG_FILE).read_text())
    unsupported = {"peft_type": saved.get("peft_type") != "LORA", "use_dora": bool(saved.get("use_dora")),
                   "use_rslora": bool(saved.get("use_rslora")), "bias": saved.get("bias", "none") != "none",
                   "modules_to_save": bool(saved.get("modules_to_save"))}
    if any(unsupported.values()):
        raise ValueError(f"{where}: not a plain LoRA adapter ({[k for k, bad in unsupported.items() if bad]})")
    targets = saved.get("target_modules")
    targets = sorted([targets] if isinstance(targets, str) else targets or [])
    mismatch = {key: (saved.get(peft_key), ours) for key, peft_key, ours in
                [("rank", "r", config.rank), ("alpha", "lora_alpha", config.alpha)]
                if saved.get(peft_key) != ours}
    if targets != sorted(config.target_modules):
        mismatch["target_modules"] = (targets, sorted(config.target_modules))
    if mismatch:
        differ = ", ".join(f"{k} {a!r} != model.lora.{k} {b!r}" for k, (a, b) in mismatch.items())
        raise ValueError(f"{where}: the adapter's {differ}")
    tensors = {name.removeprefix(PREFIX).replace(".default.", "."): t for name, t in
               load_file(str(adapter_dir / WEIGHTS_FILE)).items()}
    expected = {}
    for name, linear in targeted(model, config):
        expected[f"{name}.lora_A.weight"] = (config.rank, linear.in_features)
        expected[f"{name}.lora_B.weight"] = (linear.out_features, config.rank)
    missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = [f"{n}: {tuple(tensors[n].shape)} != {shape}" for n, shape in expected.items()
             if n in tensors and tuple(tensors[n].shape) != shape]
    if missing or unknown or wrong:
        raise ValueError(f"{where}: tensors do not match the model: missing {missing[:3]}, unknown "
                         f"{unknown[:3]}, wrong shapes {wrong[:3]}")
    return {name: tensors[name].float() for name in expected}
