"""Checkpoint directories: validate the layout before allocating, load and save with safetensors.

Layout (docs/alpamayo2-model.md section 1.1): config.json, tokenizer.json, tokenizer_config.json,
preprocessor_config.json, one or more *.safetensors shards and model.safetensors.index.json
when there is more than one shard. No pickle anywhere: weights are safetensors shards, read
tensor by tensor with plain file reads (`copy_shard`).
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
from worker.model.fp8 import quantize_model_fp8
from worker.model.modelopt import Fp8Layer, fp8_layers, fp8_shell, quantised_names
from worker.model.modules import Alpamayo2

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
    start: int                     # file offset of the first data byte
    nbytes: int


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
            out[name] = TensorInfo(meta["dtype"], tuple(meta["shape"]), path.name, 8 + n + start, stop - start)
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


def validate_support_files(path: Path) -> AlpamayoConfig:
    """The files besides the weights (a config-only directory has just these). Raises CheckpointError."""
    label = f"checkpoint {path}"
    if not path.is_dir():
        raise CheckpointError(f"{label}: not a directory")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"{label}: missing {', '.join(missing)}")
    return AlpamayoConfig.from_dir(path)


def validate_layout(path: str | Path) -> tuple[AlpamayoConfig, dict[str, TensorInfo]]:
    """Check a checkpoint directory without allocating model memory. Raises CheckpointError."""
    path = Path(path)
    label = f"checkpoint {path}"
    cfg = validate_support_files(path)
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
    with torch.device("meta"):
        model = Alpamayo2(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_tensors(cfg: AlpamayoConfig, tensors: dict[str, TensorInfo], path: Path) -> dict[str, Fp8Layer]:
    """Every tensor the model needs, with its shape; the quantised layers of a ModelOpt FP8
    export (worker/model/modelopt.py) with their scales. Returns those layers ({} for bf16)."""
    want = expected_shapes(cfg)
    label = f"checkpoint {path}"
    layers = fp8_layers(path, cfg, tensors, want)
    missing = sorted(set(want) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{label}: missing tensors {', '.join(missing[:3])}{more}")
    extra = sorted(set(tensors) - set(want) - quantised_names(layers))
    if extra:
        raise CheckpointError(f"{label}: unexpected tensors {', '.join(extra[:3])}"
                              f"{' (and more)' if len(extra) > 3 else ''}")
    for name, shape in want.items():
        if tensors[name].shape != shape:
            raise CheckpointError(f"{label}: tensor {name} has shape {list(tensors[name].shape)}, "
                                  f"config.json implies {list(shape)}")
    return layers


def check_checkpoint(path: str | Path, precision: str = "bf16", load_format: str = "auto"):
    """Everything that can be checked before allocating: the layout, and (load_format auto) every
    tensor's name and shape, a ModelOpt FP8 export only on an fp8 profile.

    -> (cfg, tensors, quantised layers). Raises CheckpointError in one line."""
    path = Path(path)
    if load_format == "dummy":
        return validate_support_files(path), {}, {}
    cfg, tensors = validate_layout(path)
    layers = check_tensors(cfg, tensors, path)
    if layers and precision != "fp8":
        raise CheckpointError(f"checkpoint {path} is a ModelOpt FP8 export ({len(layers)} fp8 layers) but the profile "
                              f"is {precision}: set NIM_MODEL_PROFILE=fp8 or fp8-dflash2 to serve it, or point "
                              "NIM_FT_CHECKPOINT at the bf16 checkpoint")
    return cfg, tensors, layers


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _computed_buffers(cfg: AlpamayoConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The buffers modules compute at construction (rotary frequencies, Fourier features; none
    is in the checkpoint), taken from a one-layer model of the same config on the CPU: they
    depend on widths and rope settings, never on depth or vocabulary."""
    raw = json.loads(json.dumps(cfg.raw))
    for text in (raw["vlm_config"]["text_config"], raw["expert_config"]["llm_config"]):
        text.update(num_hidden_layers=1, vocab_size=8, intermediate_size=8)
    raw["vlm_config"]["vision_config"].update(depth=1, deepstack_visual_indexes=[0], intermediate_size=8)
    with default_dtype(dtype), torch.device("cpu"), no_init_weights():
        small = Alpamayo2(AlpamayoConfig.from_dict(raw))
    return dict(small.named_buffers())


def build_empty(cfg: AlpamayoConfig, device, dtype: torch.dtype, fp8: dict[str, Fp8Layer] | None = None):
    """The module tree on `device` with uninitialised weights: built on the meta device, the
    checkpoint's quantised layers swapped for fp8 shells, then materialised once (no random pass,
    no bf16 copy of an fp8 layer); computed buffers are filled in."""
    device = torch.device(device)
    with default_dtype(dtype), torch.device("meta"):
        model = Alpamayo2(cfg)
    for name in fp8 or {}:
        parent, child = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), child, torch.nn.Identity())   # no weight to materialise
    model.to_empty(device=device)
    for name, layer in (fp8 or {}).items():
        parent, child = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), child, fp8_shell(layer, device, dtype))
    computed = _computed_buffers(cfg, dtype)
    for name, buf in model.named_buffers():
        if name in computed:
            buf.copy_(computed[name])
    model.eval().requires_grad_(False)
    return model


def dummy_model(cfg: AlpamayoConfig, device, dtype: torch.dtype, seed: int = 0):
    """ALPAMAYO_LOAD_FORMAT=dummy: random weights of the right shapes and dtype, initialised on
    `device` by the modules' own initialisation (vLLM's --load-format dummy)."""
    torch.manual_seed(seed)
    with default_dtype(dtype), torch.device(device):
        model = Alpamayo2(cfg)
    return model.eval().requires_grad_(False)


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
               precision: str = "bf16", load_format: str = "auto"):
    """Check, then build the model on `device` in `dtype` (`build_empty`) and read the shards
    into it one at a time (`copy_shard`): each byte of the checkpoint is read once, and host
    memory holds two 64 MiB staging buffers besides the weights on a CPU (the next shard is read
    ahead by the kernel meanwhile).
    A ModelOpt FP8 export loads into fp8 layers directly; on the fp8 profile every decoder
    linear the checkpoint holds in bf16 is quantised at load (worker/model/fp8.py).

    Returns (model, cfg). Loading never unpickles: safetensors only.
    """
    path = Path(path)
    cfg, tensors, fp8 = check_checkpoint(path, precision, load_format)
    if load_format == "dummy":
        model = dummy_model(cfg, device, dtype)
    else:
        model = build_empty(cfg, device, dtype, fp8)
        params = model.state_dict()
        shards = sorted({t.shard for t in tensors.values()})
        total = sum((path / s).stat().st_size for s in shards)
        done, t0 = 0, time.perf_counter()
        staging = Staging(torch.device(device))
        for i, shard in enumerate(shards):
            if i + 1 < len(shards):
                _read_ahead(path / shards[i + 1])    # the kernel reads the next shard while this one is copied
            copy_shard(path / shard, {k: t for k, t in tensors.items() if t.shard == shard}, params, staging)
            done += (path / shard).stat().st_size
            _progress(path, i, len(shards), shard, done, total, time.perf_counter() - t0)
    if precision == "fp8":
        quantize_model_fp8(model)               # the decoder linears the checkpoint holds in bf16
    return model, cfg


STAGING_BYTES = 64 << 20


class Staging:
    """Two host buffers that carry a shard's bytes to the device in turn (pinned for a GPU, so a
    copy runs while the next chunk is read); a buffer is reused once its last copy is done."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.buffers = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]
        self.events = [None, None]
        self.turn = 0

    def next(self, nbytes: int) -> torch.Tensor:
        i = self.turn = 1 - self.turn
        if self.events[i] is not None:
            self.events[i].synchronize()
        if self.buffers[i].numel() < nbytes:
            self.buffers[i] = torch.empty(max(nbytes, STAGING_BYTES), dtype=torch.uint8, pin_memory=self.cuda)
        return self.buffers[i][:nbytes]

    def sent(self) -> None:
        """The copy out of the buffer last returned by `next` has been queued."""
        if self.cuda:
            self.events[self.turn] = torch.cuda.Event()
            self.events[self.turn].record()

    def drain(self) -> None:
        for e in self.events:
            if e is not None:
                e.synchronize()


def _read_exactly(f, out: torch.Tensor, file: Path) -> None:
    """Fill the uint8 CPU tensor `out` from the file's current position."""
    view = memoryview(out.numpy()).cast("B")
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError(f"checkpoint shard {file} ended early (truncated while loading?)")
        got += n


def copy_shard(file: Path, tensors: dict[str, TensorInfo], params: dict[str, torch.Tensor],
               staging: Staging) -> None:
    """Read the tensors of one safetensors shard (`tensors`: name -> its checked header entry)
    into their parameters `params[name]` (any device and float dtype; the conversion runs where
    the parameter is). Plain file reads, no memory map: a CPU parameter of the file's dtype is
    read into directly, anything else goes through `staging` in chunks, so the process never
    holds a shard (safetensors' `load_file` maps the whole shard and materialises every tensor
    on the host first)."""
    with open(file, "rb", buffering=0) as f:
        for name, info in sorted(tensors.items(), key=lambda e: e[1].start):
            src = _DTYPES[info.dtype]
            target = params[name]
            f.seek(info.start)
            if not target.is_contiguous() or target.numel() * src.itemsize != info.nbytes:
                # a per-tensor scale broadcast over its channels, or a view: read whole, then copy
                tmp = torch.empty(info.nbytes, dtype=torch.uint8)
                _read_exactly(f, tmp, file)
                value = tmp.view(src)
                target.copy_(value.reshape(()) if value.numel() == 1 else value.reshape(target.shape))
                continue
            dst = target.view(-1)
            if dst.device.type == "cpu" and dst.dtype == src:
                _read_exactly(f, dst.view(torch.uint8), file)
                continue
            per = max(1, STAGING_BYTES // src.itemsize)
            for e0 in range(0, dst.numel(), per):
                e1 = min(dst.numel(), e0 + per)
                buf = staging.next((e1 - e0) * src.itemsize)
                _read_exactly(f, buf, file)
                dst[e0:e1].copy_(buf.view(src), non_blocking=True)
                staging.sent()
    staging.drain()


def _read_ahead(file: Path) -> None:
    """Start an asynchronous read of `file` into the page cache (posix_fadvise WILLNEED): disk
    reads overlap the copy of the shard before it; no process memory is used."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def _progress(path: Path, i: int, n: int, shard: str, done: int, total: int, seconds: float) -> None:
    """A progress bar on a terminal, a log line per shard otherwise."""
    rate = done / max(seconds, 1e-9) / 1e9
    if sys.stderr.isatty():
        bar = "#" * int(30 * done / total)
        print(f"\rloading {path.name}: [{bar:30s}] {i + 1}/{n} shards, {done / 1e9:.1f}/"
              f"{total / 1e9:.1f} GB, {rate:.2f} GB/s", end="" if i + 1 < n else "\n", file=sys.stderr, flush=True)
    else:
        log.info("loaded shard %d/%d %s (%.2f of %.2f GB, %.2f GB/s)", i + 1, n, shard, done / 1e9, total / 1e9, rate)


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
