"""Checkpoint directories: validate the layout before allocating, load and save with safetensors.

Layout (docs/alpamayo2-model.md section 1.1): config.json, tokenizer.json, tokenizer_config.json,
preprocessor_config.json, one or more *.safetensors shards and model.safetensors.index.json
when there is more than one shard. No pickle anywhere: weights are read with safetensors only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.initialization import no_init_weights

from worker.model.config import AlpamayoConfig, CheckpointError

log = logging.getLogger("alpamayo.model")
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    shard: str


def read_safetensors_header(path: Path, label: str) -> dict[str, TensorInfo]:
    """Parse a shard's header and check the file holds every byte the header promises.

    `label` prefixes messages (e.g. "checkpoint /x" or "NIM_ALPAMAYO_SPECULATIVE_MODEL=/x").
    """
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{label} has a truncated shard {path.name}: expected at least 8 bytes, found {size}")
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000 or 8 + n > size:
            raise CheckpointError(
                f"{label} has a truncated shard {path.name}: expected more than {8 + n} bytes, found {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{label} has a damaged shard {path.name}: unreadable header") from None
    end = 0
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = meta["data_offsets"]
            out[name] = TensorInfo(meta["dtype"], tuple(meta["shape"]), path.name)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{label} has a damaged shard {path.name}: bad entry for {name}") from None
        end = max(end, stop)
    expected = 8 + n + end
    if size != expected:
        raise CheckpointError(f"{label} has a truncated shard {path.name}: expected {expected} bytes, found {size}")
    return out


def scan_shards(directory: Path, label: str) -> dict[str, TensorInfo]:
    """Every tensor of every *.safetensors file in `directory`, each shard checked against its header."""
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{label}: no *.safetensors weight shard")
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        for name, info in read_safetensors_header(shard, label).items():
            if name in tensors:
                raise CheckpointError(f"{label}: tensor {name} appears in {tensors[name].shard} and {shard.name}")
            tensors[name] = info
    return tensors


def validate_layout(path: str | Path) -> tuple[AlpamayoConfig, dict[str, TensorInfo]]:
    """Check a checkpoint directory without allocating model memory. Raises CheckpointError."""
    path = Path(path)
    label = f"checkpoint {path}"
    if not path.is_dir():
        raise CheckpointError(f"{label}: not a directory")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"{label}: missing {', '.join(missing)}")
    cfg = AlpamayoConfig.from_dir(path)
    tensors = scan_shards(path, label)
    index = path / INDEX_FILE
    shard_names = {t.shard for t in tensors.values()}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{label}: {INDEX_FILE} has no readable weight_map") from None
        for name, shard in weight_map.items():
            if name not in tensors:
                raise CheckpointError(f"{label}: {INDEX_FILE} lists {name} in {shard}, which does not hold it")
            if tensors[name].shard != shard:
                raise CheckpointError(f"{label}: {INDEX_FILE} puts {name} in {shard}, found in {tensors[name].shard}")
        unlisted = sorted(set(tensors) - set(weight_map))
        if unlisted:
            raise CheckpointError(f"{label}: {tensors[unlisted[0]].shard} holds {unlisted[0]}, which {INDEX_FILE} "
                                  f"does not list ({len(unlisted)} such tensor(s)): regenerate the index")
    elif len(shard_names) > 1:
        raise CheckpointError(f"{label}: {len(shard_names)} shards but no {INDEX_FILE}")
    return cfg, tensors


def expected_shapes(cfg: AlpamayoConfig) -> dict[str, tuple[int, ...]]:
    """State-dict shapes of the model the config describes (built on the meta device)."""
    from worker.model.modules import Alpamayo2

    with torch.device("meta"):
        model = Alpamayo2(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_tensors(cfg: AlpamayoConfig, tensors: dict[str, TensorInfo], path: Path) -> None:
    want = expected_shapes(cfg)
    label = f"checkpoint {path}"
    missing = sorted(set(want) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{label}: missing tensors {', '.join(missing[:3])}{more}")
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise CheckpointError(f"{label}: unexpected tensors {', '.join(extra[:3])}"
                              f"{' (and more)' if len(extra) > 3 else ''}")
    for name, shape in want.items():
        if tensors[name].shape != shape:
            raise CheckpointError(f"{label}: tensor {name} has shape {list(tensors[name].shape)}, "
                                  f"config.json implies {list(shape)}")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16):
    """Validate, then build the model on `device` in `dtype` without initialising its weights
    (transformers' `no_init_weights`: no random pass over the parameters) and copy the shards in
    one at a time, so each byte of the checkpoint is read once and host memory holds one shard.

    Returns (model, cfg). Loading never unpickles: safetensors only.
    """
    from safetensors.torch import load_file

    from worker.model.modules import Alpamayo2

    path = Path(path)
    cfg, tensors = validate_layout(path)
    check_tensors(cfg, tensors, path)
    with default_dtype(dtype), torch.device(device), no_init_weights():
        model = Alpamayo2(cfg)
    model.eval().requires_grad_(False)
    params = model.state_dict()
    shards = sorted({t.shard for t in tensors.values()})
    total = sum((path / s).stat().st_size for s in shards)
    done, t0 = 0, time.perf_counter()
    for i, shard in enumerate(shards):
        part = load_file(str(path / shard), device=str(device))
        for name, value in part.items():
            params[name].copy_(value)
        del part
        done += (path / shard).stat().st_size
        rate = done / max(time.perf_counter() - t0, 1e-9) / 1e9
        if sys.stderr.isatty():           # a progress bar on a terminal, a log line per shard otherwise
            bar = "#" * int(30 * done / total)
            print(f"\rloading {path.name}: [{bar:30s}] {i + 1}/{len(shards)} shards, {done / 1e9:.1f}/"
                  f"{total / 1e9:.1f} GB, {rate:.2f} GB/s", end="" if i + 1 < len(shards) else "\n",
                  file=sys.stderr, flush=True)
        else:
            log.info("loaded shard %d/%d %s (%.2f of %.2f GB, %.2f GB/s)", i + 1, len(shards), shard,
                     done / 1e9, total / 1e9, rate)
    return model, cfg


def save_checkpoint(model: torch.nn.Module, config: dict, directory: str | Path,
                    max_shard_bytes: int = 2 << 30, dtype: torch.dtype | None = None) -> list[str]:
    """Write model weights as safetensors shards + index, and config.json. Returns shard names.

    Tokenizer and preprocessor files are written by the caller (they are not weights).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
             for k, v in model.state_dict().items()}
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = state[name]
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for shard_name, group in zip(names, groups):
        tmp = directory / (shard_name + ".tmp")
        save_file(group, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, 0o644)            # readable by every user of a shared cache
        os.replace(tmp, directory / shard_name)
        weight_map.update({k: shard_name for k in group})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                    "weight_map": weight_map}, indent=1))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return names
