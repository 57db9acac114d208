"""Finding and checking checkpoints before anything is loaded: the folder ``--load`` names, its
metadata, the model it is for and its shard files; the ``--save`` folder; the newest complete
checkpoint of a root (restarts). No process group is needed: ``ptdp train`` runs these checks
before any worker starts. Saving and loading are :mod:`ptdp.run.checkpoint.io`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ptdp.config.moe import MoEConfig
from ptdp.config.schema import Config
from ptdp.errors import ConfigError
from ptdp.run.paths import folder_problem

FORMAT = 1
META = "ptdp.json"
#: model fields that must match between a checkpoint and the model loading it
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "kv_channels",
    "qk_layernorm",
    "ffn",
    "seq_length",
    "vocab_size",
    "untie_embeddings_and_output_weights",
    "activation",
    "layernorm_epsilon",
    "normalization",
    "swiglu",
    "position_embedding_type",
    "rotary_base",
    "num_query_groups",
    "add_bias_linear",
)
_FLAGS = {
    "vocab_size": "--vocab-size",
    "activation": "--activation",
    "layernorm_epsilon": "--layernorm-epsilon",
    "seq_length": "--seq-length",
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "normalization": "--normalization",
    "swiglu": "--swiglu",
    "position_embedding_type": "--position-embedding-type",
    "rotary_base": "--rotary-base",
    "num_query_groups": "--num-query-groups",
    "add_bias_linear": "--disable-bias-linear",
    "ffn": "--ffn-hidden-size",
    "kv_channels": "--kv-channels",
    "qk_layernorm": "--qk-layernorm",
}
#: values of model fields that checkpoints written before the field existed had
MODEL_DEFAULTS = {
    "activation": "gelu",
    "layernorm_epsilon": 1e-5,
    "normalization": "LayerNorm",
    "swiglu": False,
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000.0,
    "num_query_groups": None,
    "add_bias_linear": True,
    "kv_channels": None,
    "qk_layernorm": False,
}


#: flags of the MoE shape compared by :func:`_check_model`
_MOE_FLAGS = {
    "num_experts": "--num-experts",
    "expert ffn": "--moe-ffn-hidden-size",
    "shared expert ffn": "--moe-shared-expert-intermediate-size",
    "MoE layers": "--moe-layer-freq",
}


class CheckpointError(ConfigError):
    """A checkpoint folder that is missing, incomplete, corrupted or for another model."""


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete iteration folders under ``root`` (renamed into place, with ``ptdp.json`` and
    DCP's index), oldest first; ``.iter_N.tmp`` folders of unfinished saves are not among them."""

    def number(p: Path) -> int:
        digits = p.name.removeprefix("iter_")
        return int(digits) if digits.isdigit() else -1

    folders = (
        p for p in Path(root).glob("iter_*") if p.is_dir() and (p / META).is_file() and (p / ".metadata").is_file()
    )
    return sorted(folders, key=number)


def newest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint of the highest iteration under ``root`` (None: there is none).
    Usually the one ``latest`` names; newer if a save was interrupted after its rename."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def resolve_checkpoint(path: str | Path) -> Path:
    """The iteration folder to load: ``path`` itself if it is one, else the one ``path/latest``
    names. Raises :class:`CheckpointError` for anything else."""
    path = Path(path)
    if (path / META).is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        folder = path / latest.read_text().strip()
        if not (folder / META).is_file() or not (folder / ".metadata").is_file():
            raise CheckpointError(f"{latest} names {folder.name}, which is not a complete ptdp checkpoint")
        return folder
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is a file, not a ptdp checkpoint folder (give the folder --save wrote, "
            f"or one of its iter_* folders)"
        )
    raise CheckpointError(f"{path} is not a ptdp checkpoint (no {META} and no 'latest' file)")


def read_meta(folder: Path) -> dict:
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {folder / META}: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{folder / META} has checkpoint format {found!r}, expected {FORMAT}")
    missing = [k for k in ("iteration", "consumed_samples", "model", "layout", "world_size") if k not in meta]
    if missing or not isinstance(meta["model"], dict):
        raise CheckpointError(f"{folder / META} is damaged: missing {missing or ['model']}")
    return meta


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__


def check_files(folder: Path) -> None:
    """Every file DCP's metadata refers to exists and is long enough (a missing or truncated
    shard is named here, before anything is loaded)."""
    from torch.distributed.checkpoint.api import CheckpointException  # here: DCP is slow to import

    from ptdp.run.checkpoint.safe_reader import SafeFileSystemReader

    try:
        md = SafeFileSystemReader(folder).read_metadata()
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"cannot read the tensor index {folder / '.metadata'}: {err}") from err
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(needed.items()):
        path = folder / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder} is incomplete: shard file {rel} is missing")
        if path.stat().st_size < size:
            raise CheckpointError(
                f"checkpoint {folder} is corrupted: shard file {rel} has "
                f"{path.stat().st_size} bytes, its index needs {size}"
            )


def precheck(config: Config) -> dict:
    """Everything about ``config.checkpoint.load`` that can be checked without processes: the
    folder, its metadata, the model shape (``config.model.vocab_size`` must be the real one) and
    the shard files. Returns the metadata; raises :class:`CheckpointError`."""
    if config.checkpoint.load is None:
        raise CheckpointError("no checkpoint to check: --load is not set")
    folder, meta = _open(config.checkpoint.load, config)
    if meta["iteration"] >= config.train.train_iters:
        raise CheckpointError(
            f"checkpoint {folder} is at iteration {meta['iteration']}: --train-iters "
            f"{config.train.train_iters} leaves nothing to train (raise --train-iters)"
        )
    return meta


def _open(path: str | Path, config: Config) -> tuple[Path, dict]:
    """The checkpoint folder at ``path`` and its metadata, checked against ``config``'s model and
    its own index (every shard file present and long enough)."""
    folder = resolve_checkpoint(path)
    meta = read_meta(folder)
    _check_model(meta, config, folder)
    check_files(folder)
    return folder, meta


def check_save_dir(path: str | Path) -> None:
    """``--save`` must be (or become) a writable folder; checked before any worker starts."""
    problem = folder_problem(path)
    if problem:
        raise CheckpointError(f"cannot use {path} as checkpoint folder (--save): {problem}")


def check_model_shape(path: str | Path, config: Config) -> dict:
    """The checkpoint ``--load`` names must be for ``config``'s model in every shape field but the
    vocabulary (known only once the data are prepared: :func:`precheck` checks it then); run
    before the data are prepared so that a wrong model costs no tokenization. Returns the
    metadata; raises :class:`CheckpointError`."""
    folder = resolve_checkpoint(path)
    meta = read_meta(folder)
    _check_model(meta, config, folder, skip=("vocab_size",))
    return meta


def _stored_field(model: dict, name: str):
    """Field ``name`` of a checkpoint's model: its default where an older checkpoint lacks it;
    ``kv_channels`` made concrete (None: h / a)."""
    value = model.get(name, MODEL_DEFAULTS.get(name))
    if name == "kv_channels" and value is None:
        return model["hidden_size"] // model["num_attention_heads"]
    return value


def stored_moe(meta: dict) -> MoEConfig:
    """The MoE options of a checkpoint's model (``meta["moe"]``; a dense model where a checkpoint
    written before they were recorded has none)."""
    moe = dict(meta.get("moe") or {})
    if "moe_layer_freq" in moe:
        moe["moe_layer_freq"] = tuple(moe["moe_layer_freq"])
    names = {f.name for f in dataclasses.fields(MoEConfig)}
    return MoEConfig(**{k: v for k, v in moe.items() if k in names})


def _moe_shape(moe: MoEConfig, num_layers: int, ffn: int) -> dict[str, object]:
    """What the MoE options change in the tensors: experts, their widths, which layers are MoE."""
    if not moe.enabled:
        return dict.fromkeys(_MOE_FLAGS)
    layers = [i for i, on in enumerate(moe.moe_layers(num_layers)) if on]
    return {
        "num_experts": moe.num_experts,
        "expert ffn": moe.expert_ffn(ffn),
        "shared expert ffn": moe.shared_ffn,
        "MoE layers": layers,
    }


def _check_model(meta: dict, config: Config, folder: Path, skip: tuple[str, ...] = ()) -> None:
    m, saved_moe = config.model, stored_moe(meta)
    if all(moe.enabled and all(moe.moe_layers(m.num_layers)) for moe in (saved_moe, config.moe)):
        skip = (*skip, "ffn")  # every layer an MoE layer: the dense width is unused (the experts' compared)
    here = {f: m.head_dim if f == "kv_channels" else getattr(m, f) for f in SHAPE_FIELDS}
    diffs = [
        f"{f}={_stored_field(meta['model'], f)!r} in the checkpoint, {here[f]!r} here"
        + (f" (set {_FLAGS[f]})" if f in _FLAGS else "")
        for f in SHAPE_FIELDS
        if f not in skip and _stored_field(meta["model"], f) != here[f]
    ]
    if not diffs:  # the MoE shape, once the dense one agrees
        stored = _moe_shape(saved_moe, m.num_layers, _stored_field(meta["model"], "ffn"))
        now = _moe_shape(config.moe, m.num_layers, m.ffn)
        diffs = [
            f"{k} {stored[k]} in the checkpoint, {now[k]} here (set {flag})"
            for k, flag in _MOE_FLAGS.items()
            if stored[k] != now[k]
        ]
        if (stored["num_experts"] is None) != (now["num_experts"] is None):  # dense against MoE: say so once
            kinds = [f"{n} experts" if n else "a dense model" for n in (stored["num_experts"], now["num_experts"])]
            diffs = [f"{kinds[0]} in the checkpoint, {kinds[1]} here (set --num-experts and the MoE options)"]
        elif saved_moe.moe_router_enable_expert_bias and not config.moe.moe_router_enable_expert_bias:
            diffs.append(
                "the checkpoint's routers have trained expert biases, which this run would drop "
                "(set --moe-router-enable-expert-bias)"
            )
    if diffs:
        raise CheckpointError(f"checkpoint {folder} is for a different model: " + "; ".join(diffs))


def residual_note(meta: dict, layout: dict, world_size: int, codec: str) -> str | None:
    """Why a checkpoint's 1-bit error-feedback residual is not restored (a warning for the log),
    or None: it is per rank and per bucket, so only the same layout and bucket size can take it
    back; this run may also reduce its gradients another way."""
    if meta.get("grad_compression") != "1bit" or meta.get("restored", {}).get("residual"):
        return None
    if codec != "1bit":
        return (
            f"the checkpoint's 1-bit error-feedback residual is dropped: this run reduces gradients with "
            f"--grad-compression {codec}"
        )
    saved = dict(meta.get("layout", {}), world_size=meta.get("world_size"))
    now = dict(layout, world_size=world_size)
    keys = list(now) + [k for k in saved if k not in now]  # cp is in a layout only when > 1
    diff = ", ".join(
        f"{k} {saved.get(k, 1 if k == 'cp' else None)} -> {now.get(k, 1 if k == 'cp' else None)}"
        for k in keys
        if saved.get(k) != now.get(k)
    )
    return (
        f"the checkpoint's 1-bit error-feedback residual cannot be restored at another layout ({diff}): it "
        f"starts again from zero, so the first compressed steps differ from an uninterrupted run"
    )
