"""Load a model from a GGUF file or a Hugging Face folder into its family's forward, with a cached conversion."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from waferscale import __version__, kernels
from waferscale.heap import trim_heap
from waferscale.models.base import CausalLM
from waferscale.models.config import ModelConfig
from waferscale.models.gguf_reader import read_gguf
from waferscale.models.layers.linear import LoadContext
from waferscale.models.layers.moe import GATE_UP_ROWS, stack_gate_up
from waferscale.models.quant import (
    QUANTIZATIONS,
    QuantLinear,
    QuantWeight,
    gather_quantized,
    quantize,
)
from waferscale.models.registry import family_for_hf
from waferscale.models.safetensors_stream import DTYPES as STREAM_DTYPES
from waferscale.models.safetensors_stream import SafetensorsWriter, empty_weight, read_header, read_tensors
from waferscale.models.source import ModelLoadError, cache_root, derive_name, model_source
from waferscale.models.tokenizer import ModelTokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CONVERSION_FORMAT = 10  # bump when the cached layout changes (3: quantized blocks, models/quant/; 4: scales as
# GGUF stores them; 5: int4 in two levels where K allows; 7: GGUF's quantized gate and up expert stacks as one;
# 8: its float expert stacks per expert; 9: Q5_0 and Q5_1 in their 5 bits; 10: Q6_K in its 6)


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: ModelTokenizer
    config: ModelConfig
    name: str
    path: str
    dtype: torch.dtype
    max_model_len: int
    fingerprint: str
    quantization: str = "none"  # what the weights are served from: none, gguf (the file's own blocks), int8, int4


def load_model(
    path: str | os.PathLike | None = None,
    dtype: str = "bfloat16",
    max_model_len: int | None = None,
    progress: bool = True,
    quantization: str = "auto",
) -> LoadedModel:
    """Load and return a ready model; every failure is a ModelLoadError with one clear line.

    quantization: auto (a GGUF's quantized tensors served from their own blocks, except with dtype float32, which
    dequantizes them as before; a Hugging Face folder as it is), none (dequantize everything to dtype), int8 or
    int4 (float projections quantized once at load, cached; a GGUF's quantized tensors kept as they are)."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r} (choose one of: {', '.join(DTYPES)})")
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"unsupported quantization {quantization!r} (choose one of: {', '.join(QUANTIZATIONS)})"
        )
    src = model_source(path)
    try:
        weights = None
        if src.is_dir():
            folder = src
            if quantization in ("int8", "int4"):
                weights = _quantized_weights(src, quantization, progress)
        else:
            method = "none" if quantization == "auto" and dtype == "float32" else quantization
            folder = _converted_gguf(src, dtype, progress, method)
        loaded = _load_folder(folder, src, DTYPES[dtype], max_model_len, progress, weights)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load {src}: {exc}") from exc
    return loaded


def _load_folder(
    folder: Path,
    src: Path,
    dtype: torch.dtype,
    max_model_len: int | None,
    progress: bool,
    weights: list[Path] | None = None,
) -> LoadedModel:
    """The model in folder (config, tokenizer, safetensors; `weights` replaces its safetensors when given)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{src} has no config.json (a Hugging Face folder needs config.json, *.safetensors)"
        )
    raw = json.loads(config_path.read_text())
    name = derive_name(src)
    cfg = ModelConfig.from_dict(raw) if "architecture" in raw else ModelConfig.from_hf(raw, name)
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"{src} has no tokenizer.json")
    if (folder / "waferscale_tokenizer.json").is_file():
        tokenizer = ModelTokenizer.load_saved(folder)
    else:
        tokenizer = ModelTokenizer.from_hf_folder(folder, raw)
    shards = weights if weights is not None else sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{src} has no *.safetensors weights")
    context = cfg.max_position_embeddings
    if max_model_len is not None:
        if max_model_len < 1 or max_model_len > context:
            raise ModelLoadError(f"--max-model-len {max_model_len} is outside 1..{context} for this model")
        context = max_model_len
    _refuse_unless_fits(sum(s.stat().st_size for s in shards), src)
    tensors: dict[str, torch.Tensor] = {}
    for shard in tqdm(shards, desc=f"loading {name}", unit="shard", disable=not progress, file=sys.stderr):
        # read, not mapped: a mapped file's pages stay in RSS as long as any tensor of it lives, so a weight
        # copied at load (fused, packed) was resident twice (safetensors_stream.py)
        header = read_header(shard)[0]
        keep = [k for k in header if text_model_name(k) is not None]
        for key, value in read_tensors(shard, keep, into=_fused_destinations(header)):
            tensors[text_model_name(key)] = value
    model = family_for_hf(cfg.architecture).model_class()(cfg, context, dtype)
    state = gather_quantized(tensors)
    tensors.clear()  # the model's modules hold the only references: a weight they release is freed
    model.load_hf_state(state, dtype)
    del state
    trim_heap()  # what fusing and packing freed goes back now, before the KV pool is reserved
    model.eval()
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    kinds = {(p.bits, p.group) for m in quantized for p in m.parts}
    if weights is not None:
        quant_label = weights[0].parent.name  # the method: int8 or int4
    elif quantized:
        quant_label = "gguf" if src.suffix.lower() == ".gguf" else "quantized"
    else:
        quant_label = "none"
    native = kernels.load()
    hardware = kernels.cpu_has_native_bf16()
    # where bf16 is emulated and the native GEMM cannot read packed bf16 weights, float32 copies serve batched rows
    # when memory allows (not beside a quantized head: its model is mostly blocks)
    copies = (
        dtype != torch.float32
        and not (dtype == torch.bfloat16 and native is not None)
        and model.lm_head.quant is None
        and _f32_copy_bytes(cfg) < _available_memory() // 4
    )
    model.process_weights_after_loading(LoadContext(dtype, native, hardware, copies))
    trim_heap()  # the weights that packed copies replaced (every expert's, in a mixture of experts) go back now
    ident = [__version__, cfg.to_dict(), str(dtype), context] + ([quant_label, sorted(kinds)] if quantized else [])
    fingerprint = "fp_" + hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return LoadedModel(model, tokenizer, cfg, name, str(src), dtype, context, fingerprint, quant_label)


def _fused_destinations(header: dict) -> dict[str, torch.Tensor]:
    """For the tensors a fused projection is made of (q/k/v, gate/up: base.FUSED, an expert's included, and each
    of a quantized weight's parts), consecutive rows of one buffer to read them into, so that the projection takes
    them as a view (layouts.adjacent_rows) instead of a copy beside them: per-expert checkpoints' gate and up were
    copied expert by expert, and the freed halves left in the heap. The buffers take memory only as read."""
    from waferscale.models.base import FUSED

    out: dict[str, torch.Tensor] = {}
    for parts in FUSED.values():
        first = f".{parts[0]}."
        for name, info in header.items():
            if first not in name:
                continue
            names = [name.replace(first, f".{p}.", 1) for p in parts]
            infos = [header.get(n) for n in names]
            if any(i is None or i["dtype"] != info["dtype"] or len(i["shape"]) != len(info["shape"])
                   or i["shape"][1:] != info["shape"][1:] or not i["shape"] for i in infos):
                continue
            rows = [i["shape"][0] for i in infos]
            buf = empty_weight([sum(rows), *info["shape"][1:]], STREAM_DTYPES[info["dtype"]])
            for n, part in zip(names, buf.split(rows)):
                out[n] = part
    return out


_QUANTIZE_SUFFIXES = ("_proj.weight", "lm_head.weight", "embed_tokens.weight")


_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_OTHER_TOWERS = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.")


def text_model_name(name: str) -> str | None:
    """A multimodal checkpoint's (Gemma 3's) text-model tensor under its text-only name; None for the vision tower
    and projector, which the server does not load (a request with images gets a 400)."""
    if name.startswith(_OTHER_TOWERS):
        return None
    for prefix, plain in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return plain + name[len(prefix) :]
    return name


def _quantized_weights(src: Path, method: str, progress: bool) -> list[Path]:
    """A Hugging Face folder's weights with its projections and embeddings quantized (int8 or int4), made once
    and cached; returns the safetensors shards, one per source shard. Made shard by shard, each saved and freed
    before the next is read: holding them all (and save_file's byte copies) until one final write took an 8B
    model's first load to 19.5 GB of RSS, for 5.5 GB of int4 weights; now one tensor at a time is held."""
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{src} has no *.safetensors weights")
    stamp = "|".join(f"{s.name}:{s.stat().st_size}:{s.stat().st_mtime_ns}" for s in shards)
    key = hashlib.sha256(f"{src.resolve()}|{stamp}|{method}|{_CONVERSION_FORMAT}".encode()).hexdigest()[:24]
    target = cache_root() / "quantized" / f"{derive_name(src)}-{key}" / method
    if (target / "complete").is_file():
        return sorted(target.glob("*.safetensors"))
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for k, shard in enumerate(
        tqdm(shards, desc=f"quantizing to {method}", unit="shard", disable=not progress, file=sys.stderr)
    ):
        with SafetensorsWriter(tmp / f"{k + 1:05d}.safetensors") as out:  # a tensor at a time, read and written
            for name, t in read_tensors(shard):
                if name.endswith(_QUANTIZE_SUFFIXES) and t.dim() == 2 and t.shape[1] % 32 == 0:
                    for part, value in quantize(t, method).to_tensors(name).items():
                        out.add(part, value)
                else:
                    out.add(name, t)
                del t
    (tmp / "complete").write_text(str(src))
    if target.exists():  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return sorted(target.glob("*.safetensors"))


def _f32_copy_bytes(cfg: ModelConfig) -> int:
    attn = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    attn += cfg.num_heads * cfg.head_dim * cfg.hidden_size
    mlp = 0
    for i in range(cfg.num_layers):  # a sparse layer's experts (and router) instead of its dense MLP
        if cfg.is_moe(i):
            mlp += cfg.num_experts * (3 * cfg.hidden_size * cfg.moe_intermediate_size + cfg.hidden_size)
        else:
            mlp += 3 * cfg.hidden_size * cfg.intermediate_size
    return 4 * (cfg.num_layers * attn + mlp + cfg.vocab_size * cfg.hidden_size)


def _refuse_unless_fits(need: int, src: Path) -> None:
    """Refuse weights that cannot fit in the memory available, before reading them (a mixture of experts holds
    every expert: a model that reads 3B weights a token may need 30B in memory)."""
    available = _available_memory()
    if available and need > available:
        raise ModelLoadError(
            f"{src} needs {need / 2**30:.1f} GiB of memory for its weights and {available / 2**30:.1f} GiB is "
            "available: free memory, or serve it more quantized (a Q4_K_M GGUF, or --quantization int4)"
        )


def _refuse_unless_disk_holds(need: int, where: Path, src: Path) -> None:
    """Refuse a conversion that cannot fit on the disk of the cache, before writing any of it."""
    free = shutil.disk_usage(where).free
    if need > free:
        raise ModelLoadError(
            f"converting {src.name} for serving writes about {_size(need)} to {where}, which has {_size(free)} "
            "free: free disk space, or set WAFERSCALE_CACHE_DIR to a disk with room"
        )


def _size(n: int) -> str:
    """Bytes for a message: GB from 1 GB, MB below."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def _gguf_weight_bytes(src: Path, dtype: torch.dtype, quantization: str) -> int:
    """At least the bytes a GGUF's weights take once loaded: quantized tensors kept in their blocks (about their
    size in the file), the others at dtype."""
    from waferscale.models.gguf_file import read_gguf_file

    total = 0
    for t in read_gguf_file(src).tensors:
        quantized = t.tensor_type.name not in ("F32", "F16", "BF16")
        if quantized and quantization != "none" and len(t.shape) in (2, 3):
            total += t.data.nbytes
        else:
            total += int(np.prod([int(d) for d in t.shape])) * dtype.itemsize
    return total


def _available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 where unknown, which turns the float32 copies off)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------- GGUF (read by models/gguf_reader.py)


def _converted_gguf(src: Path, dtype: str, progress: bool, quantization: str = "none") -> Path:
    """A Hugging Face-style folder converted from the GGUF file, made once and reused on later starts.
    quantization: none (every tensor dequantized to dtype), auto (quantized tensors kept in our block layouts),
    int8/int4 (as auto, and float projections quantized)."""
    st = src.stat()
    key = hashlib.sha256(
        f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype}|{quantization}|{_CONVERSION_FORMAT}".encode()
    ).hexdigest()[:24]
    label = dtype if quantization == "none" else f"{dtype}-q{quantization}"
    folder = cache_root() / "converted" / f"{derive_name(src)}-{label}-{key}"
    if (folder / "complete").is_file():
        return folder
    try:
        need = _gguf_weight_bytes(src, DTYPES[dtype], quantization)
    except (ValueError, OSError):  # not a readable GGUF: read_gguf says why
        need = 0
    _refuse_unless_fits(need, src)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _refuse_unless_disk_holds(need * 6 // 5, folder.parent, src)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        cfg, tokenizer, tensors = read_gguf(src, DTYPES[dtype], progress, quantization)
        with SafetensorsWriter(tmp / "model.safetensors") as out:  # a tensor at a time: converted, written, freed
            _write_converted(out, tensors, cfg.num_experts)
    except BaseException:  # a full disk, an interrupt: no half-written conversion left to fill the disk
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    del tensors
    trim_heap()
    (tmp / "config.json").write_text(json.dumps(cfg.to_dict()))
    tokenizer.save(tmp)
    (tmp / "complete").write_text(str(src))
    if folder.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return folder
    tmp.rename(folder)
    return folder


def _write_converted(out: SafetensorsWriter, tensors, num_experts: int) -> None:
    """Write each converted tensor as it comes. GGUF's expert stacks: quantized gate and up stacks of a layer as
    one `experts.gate_up_rows` stack, so that each expert's fused gate/up is a view of it at load (no copy, and
    no second stack beside the first while a layer loads); float stacks as per-expert tensors, which packing
    replaces and frees an expert at a time (a stack stayed whole until its layer's last expert was packed: one
    layer's experts above the loaded size)."""

    def write(name: str, t) -> None:
        for key, value in (t.to_tensors(name) if isinstance(t, QuantWeight) else {name: t}).items():
            out.add(key, value)

    halves = (".mlp.experts.gate_proj.weight", ".mlp.experts.up_proj.weight")
    stacks = (*halves, ".mlp.experts.down_proj.weight")
    waiting: dict[str, object] = {}  # a layer's gate or up stack until its other half comes
    for name, t in tensors:
        if num_experts and name.endswith(stacks) and isinstance(t, torch.Tensor) and t.dim() == 3:
            owner, _, tail = name.rpartition(".mlp.experts.")
            for j in range(t.shape[0]):
                out.add(f"{owner}.mlp.experts.{j}.{tail}", t[j])
            continue
        if not num_experts or not name.endswith(halves):
            write(name, t)
            continue
        prefix = name.rsplit(".mlp.experts.", 1)[0] + ".mlp.experts."
        waiting[name] = t
        del t
        gate_name, up_name = prefix + "gate_proj.weight", prefix + "up_proj.weight"
        if gate_name in waiting and up_name in waiting:
            gate, up = waiting.pop(gate_name), waiting.pop(up_name)
            both = stack_gate_up(gate, up, num_experts)
            if both is None:  # quantized in different layouts: kept apart
                write(gate_name, gate)
                write(up_name, up)
            else:
                del gate, up
                write(prefix + GATE_UP_ROWS, both)
            del both
    for name, t in waiting.items():
        write(name, t)
