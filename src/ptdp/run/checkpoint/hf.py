"""Hugging Face interop: export a ptdp checkpoint to a Hugging Face folder (``config.json`` +
``model.safetensors``), and import such a folder as a ptdp checkpoint (iteration 0, no optimizer
state, loads at any layout). The architecture follows the model (:func:`export_hf`):
``GPT2LMHeadModel``; with the Llama-like options ``LlamaForCausalLM``, with query/key norms
``Qwen3ForCausalLM``; an MoE model ``MixtralForCausalLM``, with query/key norms
``Qwen3MoeForCausalLM``. An import reads the config's ``architectures`` (:data:`ARCHITECTURES`;
its ``model_type`` when it names none).

One process, no process group. GPT-2's ``Conv1D`` weights are ``[in, out]`` (``y = x W + b``),
ptdp's ``nn.Linear`` ``[out, in]``: they are transposed; its fused ``c_attn`` is ``[q | k | v]``
with heads contiguous inside each, as ptdp's. The Llama family's decoder:
:mod:`ptdp.run.checkpoint.hf_llama`; its MoE layers: :mod:`ptdp.run.checkpoint.hf_moe`; Qwen3's and
Mixtral's configs: :mod:`ptdp.run.checkpoint.hf_qwen3`, :mod:`ptdp.run.checkpoint.hf_mixtral`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException

from ptdp.config.model import Activation, ModelConfig
from ptdp.config.moe import MoEConfig
from ptdp.run.checkpoint.folders import (
    FORMAT,
    META,
    MODEL_DEFAULTS,
    CheckpointError,
    _first_line,
    check_files,
    read_meta,
    resolve_checkpoint,
    stored_moe,
)
from ptdp.run.checkpoint.hf_llama import from_llama, is_gpt2_like, llama_config, model_config_from_llama, to_llama
from ptdp.run.checkpoint.hf_mixtral import configs_from_mixtral, mixtral_config
from ptdp.run.checkpoint.hf_moe import MIXTRAL, QWEN3_MOE, ExpertNames
from ptdp.run.checkpoint.hf_qwen3 import configs_from_qwen3, qwen3_config
from ptdp.run.checkpoint.io import _write_json, _write_text_atomic
from ptdp.run.checkpoint.safe_reader import SafeFileSystemReader

_LAYER = {
    "ln_1": "ln1",
    "ln_2": "ln2",
    "attn.c_attn": "attention.qkv",
    "attn.c_proj": "attention.proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_CONV1D = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}

#: the ``architectures`` ptdp reads and writes -> their ``model_type``
ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
#: the Llama family's names (in errors) and expert names, by ``model_type``
_FAMILIES: dict[str, tuple[str, ExpertNames | None]] = {
    "llama": ("Llama", None),
    "qwen3": ("Qwen3", None),
    "mixtral": ("Mixtral", MIXTRAL),
    "qwen3_moe": ("Qwen3-MoE", QWEN3_MOE),
}


def _one_process(fn) -> dict:
    """``no_dist=True`` where ``fn`` (``dcp.save`` or ``dcp.load``) takes it; an older torch lacks
    the argument and runs in one process by itself when no process group exists (as in
    ``ptdp convert``)."""
    return {"no_dist": True} if "no_dist" in inspect.signature(fn).parameters else {}


def read_model_tensors(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The checkpoint's metadata and its global model tensors in stored form, by ptdp name."""
    folder = resolve_checkpoint(path)
    meta = read_meta(folder)
    check_files(folder)
    md = SafeFileSystemReader(folder).read_metadata()
    sd = {
        key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for key, item in md.state_dict_metadata.items()
        if key.startswith("model/") and hasattr(item, "size")
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
            dcp.load(sd, storage_reader=SafeFileSystemReader(folder), **_one_process(dcp.load))
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"reading checkpoint {folder} failed: {_first_line(err)}") from err
    return meta, {key[len("model/") :]: value for key, value in sd.items()}


def export_hf(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write ``out_dir/config.json`` and ``out_dir/model.safetensors`` for ``GPT2LMHeadModel``; with
    a Llama-like option ``LlamaForCausalLM``, or ``Qwen3ForCausalLM`` with ``qk_layernorm``; for an
    MoE model ``MixtralForCausalLM``, or ``Qwen3MoeForCausalLM`` with ``qk_layernorm`` (``out_dir``
    must be new or empty: nothing is overwritten). Raises CheckpointError naming what the
    architecture cannot express, before anything is written."""
    target = Path(out_dir)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(f"{target} exists and is not an empty folder; export into a new one")
    meta, tensors = read_model_tensors(checkpoint)
    m, moe = meta["model"], stored_moe(meta)
    tokenizer = resolve_checkpoint(checkpoint) / "tokenizer.json"
    eos, tokens = _special_tokens(tokenizer)
    dtype = tensors["word_embeddings.weight"].dtype
    if m.get("qk_layernorm"):  # each raises for what its architecture lacks
        config = qwen3_config(m, moe, dtype) | tokens
        return _write_hf(target, to_llama(m, tensors, moe=moe, experts=QWEN3_MOE), config, tokenizer, eos)
    if moe.enabled:
        config = mixtral_config(m, moe, dtype) | tokens
        return _write_hf(target, to_llama(m, tensors, moe=moe, experts=MIXTRAL), config, tokenizer, eos)
    if not is_gpt2_like(m):
        config = llama_config(m, dtype) | tokens
        return _write_hf(target, to_llama(m, tensors), config, tokenizer, eos)
    gpt2 = _gpt2_config(m)  # raises for what GPT-2 lacks, before any tensor is mapped
    h = m["hidden_size"]
    hf: dict[str, torch.Tensor] = {
        "transformer.wte.weight": tensors["word_embeddings.weight"],
        "transformer.wpe.weight": tensors["position_embeddings"],
        "transformer.ln_f.weight": tensors["final_norm.weight"],
        "transformer.ln_f.bias": tensors["final_norm.bias"],
    }
    if m["untie_embeddings_and_output_weights"]:
        hf["lm_head.weight"] = tensors["output_layer.weight"]
    for i in range(m["num_layers"]):
        for theirs, mine in _LAYER.items():
            w, b = tensors[f"layers.{i}.{mine}.weight"], tensors[f"layers.{i}.{mine}.bias"]
            if mine == "attention.qkv":  # stored [3, h, h_in] / [3, h]
                w, b = w.reshape(3 * h, -1), b.reshape(-1)
            hf[f"transformer.h.{i}.{theirs}.weight"] = w.t() if theirs in _CONV1D else w
            hf[f"transformer.h.{i}.{theirs}.bias"] = b
    return _write_hf(target, hf, gpt2 | tokens | {"torch_dtype": str(dtype).removeprefix("torch.")}, tokenizer, eos)


def _special_tokens(tokenizer: Path) -> tuple[str | None, dict]:
    """The end-of-document token and ``(bos_token_id, eos_token_id)`` for ``config.json``, from the
    checkpoint's ``tokenizer.json``: ``<|endoftext|>`` (also BOS, GPT-2's convention) for ptdp's own
    tokenizer, else the kept ``tokenizer_config.json``'s tokens, else the first known
    :data:`~ptdp.data.tokenizer.KNOWN_EOS_TOKENS` (as ``--tokenizer-model`` picks it). No tokenizer or
    no such token: (None, both ids None), never GPT-2's 50256, which may lie outside the vocabulary.
    """
    none = {"bos_token_id": None, "eos_token_id": None}
    if not tokenizer.is_file():
        return None, none
    from tokenizers import Tokenizer

    from ptdp.data.tokenizer import EOS_TOKEN, end_of_document_token, named_special_token

    known = Tokenizer.from_file(str(tokenizer))
    eos = end_of_document_token(known, tokenizer)
    if eos is None:
        return None, none
    bos = eos if eos == EOS_TOKEN else named_special_token(tokenizer, "bos_token")
    return eos, {
        "bos_token_id": known.token_to_id(bos) if isinstance(bos, str) else None,
        "eos_token_id": known.token_to_id(eos),
    }


def _write_hf(out: Path, hf: dict[str, torch.Tensor], config: dict, tokenizer: Path, eos: str | None) -> Path:
    """``config.json`` and ``model.safetensors`` (and, when the checkpoint has one, the tokenizer as
    ``tokenizer.json`` with a ``tokenizer_config.json`` for transformers' ``AutoTokenizer``: the one
    the checkpoint kept from a ``--tokenizer-model``, else one naming the end-of-document token as
    ``eos_token``, and for ptdp's own tokenizer as ``bos_token`` and ``unk_token`` too; ``eos``:
    :func:`_special_tokens`'), with
    the permissions of an ordinary new file (``0666`` less the umask)."""
    from ptdp.data.tokenizer import EOS_TOKEN

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    written = [out / "model.safetensors", out / "config.json"]
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        kept = tokenizer.with_name("tokenizer_config.json")
        if kept.is_file():
            shutil.copyfile(kept, out / "tokenizer_config.json")
        else:
            special = {"eos_token": eos} | ({"bos_token": eos, "unk_token": eos} if eos == EOS_TOKEN else {})
            max_len = config.get("n_positions") or config.get("max_position_embeddings")
            (out / "tokenizer_config.json").write_text(
                json.dumps(
                    {"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": max_len}, indent=2
                )
            )
        written += [out / "tokenizer.json", out / "tokenizer_config.json"]
    umask = os.umask(0)
    os.umask(umask)
    for path in written:
        os.chmod(path, 0o666 & ~umask)
    return out


def _gpt2_config(m: dict) -> dict:
    if m.get("activation", "gelu") not in ("gelu", "gelu_tanh"):
        raise CheckpointError(f"activation {m.get('activation')!r} has no GPT-2 equivalent")
    options = {
        f: m.get(f, default) for f, default in MODEL_DEFAULTS.items() if f not in ("activation", "layernorm_epsilon")
    }
    other = [f"{f}={value!r}" for f, value in options.items() if value != MODEL_DEFAULTS[f]]
    if other:
        raise CheckpointError(
            f"the model has {', '.join(other)}: GPT-2 has LayerNorm, learned positions, a GELU MLP, "
            f"biases and multi-head attention"
        )
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m["vocab_size"],
        "n_positions": m["seq_length"],
        "n_embd": m["hidden_size"],
        "n_layer": m["num_layers"],
        "n_head": m["num_attention_heads"],
        "n_inner": m["ffn"],
        "activation_function": "gelu_new" if m.get("activation") == "gelu_tanh" else "gelu",
        "layer_norm_epsilon": m["layernorm_epsilon"],
        "initializer_range": m.get("init_method_std", 0.02),
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": not m["untie_embeddings_and_output_weights"],
    }


_GPT2_ACTIVATIONS: dict[str, Activation] = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
"""GPT-2's ``activation_function`` -> ptdp's ``activation``."""


def hf_model_type(config: dict) -> str:
    """The ``model_type`` ptdp reads a ``config.json`` as: its one ``architectures`` entry's (of
    :data:`ARCHITECTURES`), else its ``model_type`` if ptdp reads it. Raises CheckpointError
    naming the ones it reads."""
    architectures = config.get("architectures")
    if architectures:
        if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
            raise CheckpointError(f"architectures={architectures!r}: ptdp reads one of {', '.join(ARCHITECTURES)}")
        kind = ARCHITECTURES[architectures[0]]
        if config.get("model_type", kind) != kind:
            raise CheckpointError(f"architectures={architectures!r} with model_type {config['model_type']!r}")
        return kind
    named = config.get("model_type")
    if named not in ARCHITECTURES.values():
        raise CheckpointError(f"model_type {named!r} is not one of {', '.join(ARCHITECTURES.values())}")
    return str(named)


def configs_from_hf(config: dict) -> tuple[ModelConfig, MoEConfig]:
    """ptdp's model and MoE options for a ``config.json`` (:func:`hf_model_type`; raises
    CheckpointError for what ptdp lacks)."""
    kind = hf_model_type(config)
    if kind == "llama":
        return model_config_from_llama(config), MoEConfig()
    if kind in ("qwen3", "qwen3_moe"):
        return configs_from_qwen3(config)
    if kind == "mixtral":
        return configs_from_mixtral(config)
    return _model_config_from_gpt2(config), MoEConfig()


def _model_config_from_gpt2(config: dict) -> ModelConfig:
    """ptdp's model for a GPT-2 ``config.json``."""
    act = _GPT2_ACTIVATIONS.get(config.get("activation_function", ""))
    if act is None:
        raise CheckpointError(f"activation_function {config.get('activation_function')!r} is not supported")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if config.get(flag):
            raise CheckpointError(f"GPT-2 option {flag}=true is not supported")
    if config.get("scale_attn_weights") is False:
        raise CheckpointError("GPT-2 option scale_attn_weights=false is not supported")
    h = config["n_embd"]
    return ModelConfig(
        num_layers=config["n_layer"],
        hidden_size=h,
        num_attention_heads=config["n_head"],
        ffn_hidden_size=config.get("n_inner") or 4 * h,
        seq_length=config["n_positions"],
        vocab_size=config["vocab_size"],
        layernorm_epsilon=config.get("layer_norm_epsilon", 1e-5),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", True),
        activation=act,
        init_method_std=config.get("initializer_range", 0.02),
    )


def import_hf(hf_dir: str | Path, save_dir: str | Path) -> Path:
    """Make ``save_dir/iter_0000000`` (and ``save_dir/latest``) from a folder of one of the
    :data:`ARCHITECTURES` (``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``); tensors as float32, float64 ones as float64."""
    hf_dir, root = Path(hf_dir), Path(save_dir)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise CheckpointError(f"{root} exists and is not an empty folder; import into a new one")
    index = hf_dir / "model.safetensors.index.json"
    if not (hf_dir / "config.json").is_file() or not ((hf_dir / "model.safetensors").is_file() or index.is_file()):
        raise CheckpointError(
            f"{hf_dir} is not a Hugging Face model folder (config.json + model.safetensors or its index)"
        )
    config = json.loads((hf_dir / "config.json").read_text())
    m, moe = configs_from_hf(config)
    files = ["model.safetensors"]
    if index.is_file():  # a sharded folder
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    loaded = {
        k: v if v.dtype == torch.float64 else v.float() for f in files for k, v in load_file(str(hf_dir / f)).items()
    }
    kind = hf_model_type(config)
    if kind == "gpt2":
        sd = _from_gpt2(m, {k.removeprefix("transformer."): v for k, v in loaded.items()})
    else:
        family, experts = _FAMILIES[kind]
        tensors = from_llama(m, loaded, family=family, moe=moe if moe.enabled else None, experts=experts)
        sd = {f"model/{k}": v for k, v in tensors.items()}
    return _write_imported(root, m, moe, sd, hf_dir)


def _from_gpt2(m: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = {
        "model/word_embeddings.weight": hf["wte.weight"],
        "model/position_embeddings": hf["wpe.weight"],
        "model/final_norm.weight": hf["ln_f.weight"],
        "model/final_norm.bias": hf["ln_f.bias"],
    }
    if m.untie_embeddings_and_output_weights:
        sd["model/output_layer.weight"] = hf["lm_head.weight"]
    for i in range(m.num_layers):
        for theirs, mine in _LAYER.items():
            w, b = hf[f"h.{i}.{theirs}.weight"], hf[f"h.{i}.{theirs}.bias"]
            w = w.t() if theirs in _CONV1D else w
            if mine == "attention.qkv":
                w, b = w.reshape(3, m.hidden_size, -1), b.reshape(3, -1)
            sd[f"model/layers.{i}.{mine}.weight"], sd[f"model/layers.{i}.{mine}.bias"] = w.contiguous(), b
    return sd


def _write_imported(root: Path, m: ModelConfig, moe: MoEConfig, sd: dict[str, torch.Tensor], hf_dir: Path) -> Path:
    """ptdp's layout-independent checkpoint of the model tensors ``sd`` (iteration 0, no optimizer state)."""
    sd["optim/step"] = torch.tensor(0, dtype=torch.int64)
    name = "iter_0000000"
    tmp = root / f".{name}.tmp"
    tmp.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp), **_one_process(dcp.save))
    _write_json(
        tmp / META,
        {
            "format": FORMAT,
            "iteration": 0,
            "consumed_samples": 0,
            "model": dataclasses.asdict(m) | {"ffn": m.ffn},
            "moe": dataclasses.asdict(moe),
            "layout": {"imported_from": str(hf_dir)},
            "world_size": 1,
            "optimizer_state": [],
            "loss_scaler": None,
            "grad_compression": "none",
        },
    )
    os.replace(tmp, root / name)
    _write_text_atomic(root / "latest", name)
    return root / name
