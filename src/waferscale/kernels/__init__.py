"""Native CPU kernels (cpu_kernels.c), compiled with the machine's C compiler at first use and cached.

PyTorch has no fast CPU op for attention over a paged KV cache or for a GEMM with bfloat16 weights on CPUs without
native bfloat16, and its float32 GEMMs for a few rows are slow on AMD CPUs; these kernels fill that gap, and fold
the small ops around them (rope, SiLU, residual adds, the sampler's argmax and log-sum-exp) into the same passes.
Everything works without them: when no compiler is found, or `WAFERSCALE_NATIVE_KERNELS=0` is set, `load()`
returns None and callers use plain PyTorch ops.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch  # imported first: its libgomp.so.1 is then the OpenMP runtime our library binds to

log = logging.getLogger("waferscale.kernels")
SOURCE = Path(__file__).with_name("cpu_kernels.c")
QUANT_SOURCE = Path(__file__).with_name("quant_kernels.c")  # int8/int4 weight-only GEMMs (models/quant/)
MXFP4_SOURCE = Path(__file__).with_name("mxfp4_kernels.c")  # MXFP4 blocks (gpt-oss's experts)
# the compile units: quant_kernels.c, the largest source, in two halves (its WQ_PART) that compile side by side
UNITS = [(SOURCE, []), (QUANT_SOURCE, ["-DWQ_PART=1"]), (QUANT_SOURCE, ["-DWQ_PART=2"]), (MXFP4_SOURCE, [])]
# -ffast-math at compile time only (vectorised expf, reassociated sums): linking with it would add crtfastmath.o,
# whose constructor turns on flush-to-zero for the whole process
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp"]
# WAFERSCALE_NATIVE_KERNELS' builds beside the native one: portable, the plain-C paths (as on a CPU without AVX2);
# avx2, this CPU's features less AVX-512, AVX-VNNI and AMX (as on a Zen 2/3 EPYC), so any newer machine can run and
# time the AVX2 paths
VARIANT_FLAGS = {
    "native": [],
    "portable": ["-DWS_PORTABLE"],
    "avx2": ["-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"],
}

_lock = threading.Lock()


def _variant() -> str:
    """The build WAFERSCALE_NATIVE_KERNELS asks for: native (1, the default), portable or avx2 (0: none)."""
    setting = os.environ.get("WAFERSCALE_NATIVE_KERNELS", "1")
    return "native" if setting == "1" else setting


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX); elsewhere bf16 GEMMs are emulated.
    False under WAFERSCALE_NATIVE_KERNELS=avx2, which serves as an AVX2-only CPU would."""
    if _variant() == "avx2":
        return False
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True  # unknown platform: trust the library
    return "avx512_bf16" in flags or "amx_bf16" in flags

_loaded: dict[str, object] = {}


def _cache_dir() -> Path:
    return Path(os.environ.get("WAFERSCALE_CACHE_DIR") or Path.home() / ".cache" / "waferscale") / "kernels"


def _cpu_signature() -> str:
    """-march=native builds for this CPU: the cached library is keyed by the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    wanted = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted)


def _compile(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _build(compiler: str, variant: str = "native") -> Path:
    """Compile the kernels into the cache (once per source, compiler, CPU and variant: see VARIANT_FLAGS); returns
    the library's path."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = COMPILE_FLAGS + VARIANT_FLAGS[variant]
    sources = list(dict.fromkeys(source for source, _ in UNITS))
    units = repr([(source.name, defs) for source, defs in UNITS])  # names, not paths: any checkout shares a build
    key = hashlib.sha256(
        "\0".join([*(s.read_text() for s in sources), version, _cpu_signature(), " ".join(flags + LINK_FLAGS), units])
        .encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objs = [Path(tmp) / f"{source.stem}{i}.o" for i, (source, _) in enumerate(UNITS)]
        out = Path(tmp) / target.name
        compiles = [[compiler, *flags, *defs, "-c", str(s), "-o", str(o)] for (s, defs), o in zip(UNITS, objs)]
        # the units compile side by side (the first start waits for the slowest, not the sum), then link
        with concurrent.futures.ThreadPoolExecutor(len(compiles)) as pool:
            results = list(pool.map(_compile, compiles))
        results.append(_compile([compiler, *LINK_FLAGS, *map(str, objs), "-o", str(out), "-lm"]))
        for done in results:
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(out, target)  # atomic: concurrent servers never load a half-written file
    return target


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.paged_decode_attention.argtypes = [ptr, ptr, ptr, ctypes.c_int] + [ptr] * 5 + [i64] * 6 + [f32]
    lib.paged_decode_attention.restype = None
    lib.paged_decode_attention_ex.argtypes = [ptr, ptr, ptr, ctypes.c_int] + [ptr] * 7 + [i64] * 6 + [f32]
    lib.paged_decode_attention_ex.restype = None
    lib.gemm_bf16_packed.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int, i64, i64, i64]
    lib.gemm_bf16_packed.restype = None
    lib.rmsnorm_bf16.argtypes = [ptr, ptr, ptr, i64, i64, f32]
    lib.rmsnorm_bf16.restype = None
    lib.rmsnorm_gemma_bf16.argtypes = [ptr, ptr, ptr, i64, i64, f32]
    lib.rmsnorm_gemma_bf16.restype = None
    lib.gelu_mul_bf16.argtypes = [ptr, ptr, i64, i64]
    lib.gelu_mul_bf16.restype = None
    lib.silu_mul_bf16.argtypes = [ptr, ptr, i64, i64]
    lib.silu_mul_bf16.restype = None
    lib.swiglu_clamped_bf16.argtypes = [ptr, ptr, i64, i64, f32, f32]
    lib.swiglu_clamped_bf16.restype = None
    lib.decode_attention_bf16.argtypes = [ptr] * 5 + [ctypes.c_int] + [ptr] * 6 + [i64] * 6 + [f32]
    lib.decode_attention_bf16.restype = None
    lib.gemm_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.gemm_f32.restype = None
    lib.gemm_bf16_silu_mul.argtypes = [ptr, ctypes.c_int, ptr, ptr, i64, i64, i64]
    lib.gemm_bf16_silu_mul.restype = None
    lib.gemm_bf16_add.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.gemm_bf16_add.restype = None
    lib.argmax_logsumexp.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.argmax_logsumexp.restype = None
    lib.masked_argmax.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.masked_argmax.restype = None
    lib.qgemm.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, ctypes.c_int, ctypes.c_int, i64, ptr, ptr, ptr, ptr]
    lib.qgemm.argtypes += [ctypes.c_int, ptr, ptr]
    lib.qgemm.argtypes += [ptr, ctypes.c_int, i64, i64, ctypes.c_int]
    lib.qgemm.restype = None
    lib.qdequant.argtypes = [ptr, ctypes.c_int, ctypes.c_int, i64, ptr, ptr, ptr, ptr, ctypes.c_int, i64, i64, ptr]
    lib.qdequant.restype = None
    lib.qdequant_rows.argtypes = [ptr, ctypes.c_int, ctypes.c_int, i64, ptr, ptr, ptr, ptr, ctypes.c_int, i64, ptr]
    lib.qdequant_rows.argtypes += [i64, i64, ptr]
    lib.qdequant_rows.restype = i64
    lib.qgemm_set_amx.argtypes = [ctypes.c_int]
    lib.qgemm_set_amx.restype = ctypes.c_int
    lib.qgemm_set_int8_vectors.argtypes = [ctypes.c_int]
    lib.qgemm_set_int8_vectors.restype = ctypes.c_int
    lib.qgemm_int8_rows_k.argtypes = []
    lib.qgemm_int8_rows_k.restype = ctypes.c_int
    lib.qgemm_int8_rows_q8.argtypes = []
    lib.qgemm_int8_rows_q8.restype = ctypes.c_int
    lib.qgemm_int8_rows_4.argtypes = []
    lib.qgemm_int8_rows_4.restype = ctypes.c_int
    lib.qgemm_int8_vectors_4.argtypes = []
    lib.qgemm_int8_vectors_4.restype = ctypes.c_int
    lib.qgemm_set_rows_exact.argtypes = [ctypes.c_int]
    lib.qgemm_set_rows_exact.restype = ctypes.c_int
    lib.qgemm_int8_vectors_block_k.argtypes = []
    lib.qgemm_int8_vectors_block_k.restype = ctypes.c_int
    lib.gemm_bf16_tiles.argtypes = []
    lib.gemm_bf16_tiles.restype = ctypes.c_int
    lib.decode_layer.argtypes = [ptr, i64, i64] + [ptr] * 6 + [i64, ptr, f32] + [ptr] * 4
    lib.decode_layer.argtypes += [ctypes.c_int] + [ptr] * 5 + [i64] * 5 + [f32, ptr, ptr]
    lib.decode_layer.restype = None
    lib.decode_layers.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64]
    lib.decode_layers.restype = None
    lib.moe_experts_bf16.argtypes = [ptr] * 6 + [i64] * 3 + [ptr, ptr]
    lib.moe_experts_bf16.restype = None
    lib.moe_forward_bf16.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.moe_forward_bf16.restype = None
    lib.mxfp4_gemm.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, ptr, i64, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr]
    lib.mxfp4_gemm.argtypes += [ctypes.c_int, i64]
    lib.mxfp4_gemm.restype = None
    return lib


def load() -> NativeKernels | None:
    """The compiled kernels, or None where they are turned off or cannot be built (the reason is logged once).
    WAFERSCALE_NATIVE_KERNELS=0 turns them off; =portable builds the plain-C paths only (no AVX2), =avx2 no
    AVX-512, AVX-VNNI or AMX, which is how tests run (and benchmarks time) those paths on any machine."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]  # type: ignore[return-value]
        kernels = None
        setting = os.environ.get("WAFERSCALE_NATIVE_KERNELS", "1")
        if setting == "0":
            log.info("native kernels off (WAFERSCALE_NATIVE_KERNELS=0): using PyTorch ops")
        elif _variant() not in VARIANT_FLAGS:
            log.warning(
                "WAFERSCALE_NATIVE_KERNELS=%s is not one of 1, 0, %s: using PyTorch ops",
                setting,
                ", ".join(v for v in VARIANT_FLAGS if v != "native"),
            )
        elif platform.system() != "Linux":
            log.info("native kernels are built on Linux only: using PyTorch ops")
        else:
            compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if compiler is None:
                log.warning("no C compiler found (set CC): using PyTorch ops, slower for decoding")
            else:
                try:
                    path = _build(compiler, _variant())
                    kernels = NativeKernels(_bind(ctypes.CDLL(str(path))))
                    log.info("native kernels: %s", path)
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    log.warning("native kernels unavailable (%s): using PyTorch ops", exc)
        _loaded["lib"] = kernels
        return kernels


# within each panel of 16 output columns, the order the kernel's unpacklo/unpackhi widening expects (an involution)
_PANEL_ORDER = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])


@contextlib.contextmanager
def rows_exact(on: bool = True) -> Iterator[None]:
    """NativeKernels.rows_exact where the native kernels load; nothing to do where they do not."""
    native = load() if on else None
    if native is None:
        yield
        return
    with native.rows_exact():
        yield


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] weight as the GEMM kernel reads it: bfloat16 panels [ceil(N / 16), K, 16], zero-padded."""
    n, k = weight.shape
    panels = -(-n // 16)
    padded = torch.zeros(panels * 16, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(panels, 16, k)[:, _PANEL_ORDER, :].transpose(1, 2).contiguous()


def pack_bf16_pairs(gate_up: torch.Tensor) -> torch.Tensor:
    """A fused gate/up weight [2 I, K] (gate rows first) packed for gemm_bf16_silu_mul: each 16 gate columns'
    panel followed by the same 16 up columns' panel. I must be a multiple of 16."""
    two_i, k = gate_up.shape
    inter = two_i // 2
    if two_i % 2 or inter % 16:
        raise ValueError(f"gate/up rows {two_i}: need twice a multiple of 16")
    paired = gate_up.reshape(2, inter // 16, 16, k).transpose(0, 1).reshape(two_i, k)
    return pack_bf16(paired)


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer, or NULL."""
    return None if t is None else t.data_ptr()


def _quant_args(w) -> tuple:
    """A QuantWeight as quant_kernels.c's functions take it: blocks, bits, signedness, group, scales, mins, the
    K-quants' per-256 scales of both (or NULL) and the scales' format."""
    return (w.qweight.data_ptr(), w.bits, int(w.signed), w.group, w.scales.data_ptr(), _ptr(w.mins), _ptr(w.sup),
            _ptr(w.supm), w.scale_format)


_KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # cpu_kernels.c's KV_F32, KV_BF16, KV_I8


def _kv_format(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> int:
    """cpu_kernels.c's fmt of a KV cache; an int8 cache needs its float32 scales [slots, kv_heads, scales]."""
    from waferscale.engine import kv_int8

    fmt = _KV_FORMATS.get(k_cache.dtype)
    if fmt is None:
        raise ValueError(f"native attention reads float32, bfloat16 or int8 KV caches, not {k_cache.dtype}")
    if (fmt == 2) != (k_scale is not None and v_scale is not None):
        raise ValueError("an int8 KV cache needs its key and value scales, and only an int8 cache takes them")
    if fmt == 2:
        want = (*k_cache.shape[:2], kv_int8.num_scales(k_cache.shape[2]))
        if any(s.dtype != torch.float32 or s.shape != want or not s.is_contiguous() for s in (k_scale, v_scale)):
            raise ValueError(f"int8 KV scales must be float32 {list(want)}, contiguous (see engine/kv_int8)")
    return fmt


class _QPart(ctypes.Structure):
    """cpu_kernels.c's qpart_t: one QuantWeight of a quantized projection (interleaved: MXFP4's nibble order)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("w", "scales", "mins", "sup", "supm")] + [
        (name, ctypes.c_int64) for name in ("bits", "sgn", "group", "rows", "sfmt", "interleaved")
    ]


class _Proj(ctypes.Structure):
    """cpu_kernels.c's proj_t: packed bf16 panels, or quantized parts stacked along the output; a float32 bias or
    NULL."""

    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("parts", ctypes.POINTER(_QPart)),
        ("nparts", ctypes.c_int64),
        ("act", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    ]


def _proj(weight, act: int, bias: torch.Tensor | None = None) -> _Proj:
    """The descriptor of a packed bf16 weight (a tensor) or of a QuantLinear's parts (a list of QuantWeight, MXFP4
    among them), with its float32 bias or None; it keeps its parts' array alive, and the
    caller the tensors."""
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError("a projection's bias is float32, contiguous")
    if isinstance(weight, torch.Tensor):
        return _Proj(weight.data_ptr(), None, 0, 0, _ptr(bias))
    parts = (_QPart * len(weight))(
        *[
            _QPart(
                p.qweight.data_ptr(),
                p.scales.data_ptr(),
                _ptr(p.mins),
                _ptr(p.sup),
                _ptr(p.supm),
                p.bits,
                int(p.signed),
                p.group,
                p.out_features,
                p.scale_format,
                int(getattr(p, "interleaved", False)),
            )
            for p in weight
        ]
    )
    return _Proj(None, parts, len(weight), act, _ptr(bias))


class _LayerExt(ctypes.Structure):
    """cpu_kernels.c's layer_ext_t: what a layer adds to Llama's for decode_layer."""

    _fields_ = [("norm_kind", ctypes.c_int64)] + [
        (name, ctypes.c_void_p) for name in ("q_norm", "k_norm", "post_attn", "post_ff")
    ] + [("act", ctypes.c_int64), ("moe", ctypes.c_void_p), ("sinks", ctypes.c_void_p), ("o_bias", ctypes.c_void_p)]


NORM_LLAMA, NORM_GEMMA = 0, 1  # cpu_kernels.c's norm kinds: bf16 weight, or float32 1 + weight
ACT_SILU, ACT_GELU_TANH = 0, 1


class _LayerCall(ctypes.Structure):
    """cpu_kernels.c's layer_call_t: decode_layer's arguments of one layer that hold from step to step."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "norm1", "qkv", "qkv_bias", "o", "norm2", "gate_up", "down", "ext", "k_cache", "v_cache", "k_scale",
            "v_scale",
        )
    ] + [(name, ctypes.c_int64) for name in ("inter", "heads", "kv_heads", "head_dim", "fmt")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
    ]  # fmt: skip


STEP_FIELDS = 7  # cpu_kernels.c's STEP_*: cos, sin, slots, tables, lengths, the tables' width, window starts


@dataclass(frozen=True)
class DecodeLayerWeights:
    """One decoder layer's weights as decode_layer reads them: norms (bf16 weights for NORM_LLAMA, float32 1 + weight
    for NORM_GEMMA, every norm of the layer alike); each projection packed bf16 (gate/up in pairs for SiLU, plain
    panels for GELU) or a QuantLinear's parts (a list of waferscale.models.quant.QuantWeight; gate/up: gate rows
    first); the qkv bias in float32 (or None); act: how quantized projections take activations (as QuantLinear:
    quant.ACT_MODE). Qwen3 and Gemma 3 add per-head q/k norms, Gemma its norms of each branch's output before the
    residual add (post_attn, post_ff) and tanh-GELU (mlp_act)."""

    norm1: torch.Tensor
    qkv: torch.Tensor | list
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | list
    norm2: torch.Tensor
    gate_up: torch.Tensor | list
    inter: int
    down: torch.Tensor | list
    eps: float
    act: int = 0
    norm_kind: int = NORM_LLAMA
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None
    post_ff: torch.Tensor | None = None
    mlp_act: int = ACT_SILU
    moe: MoEWeights | None = None  # a mixture of experts in place of the MLP (gate_up and down None)
    sinks: torch.Tensor | None = None  # gpt-oss: a float32 sink logit per query head
    o_bias: torch.Tensor | None = None  # the output projection's float32 bias

    @functools.cached_property
    def descriptors(self) -> tuple[_Proj, _Proj, _Proj, _Proj]:
        """The four projections' proj_t, built once (an empty one where the layer has experts instead)."""
        return tuple(_Proj() if w is None else _proj(w, self.act) for w in (self.qkv, self.o, self.gate_up, self.down))

    @functools.cached_property
    def ext(self) -> _LayerExt | None:
        """The layer_ext_t, or None for a plain Llama layer."""
        parts = (self.q_norm, self.k_norm, self.post_attn, self.post_ff)
        plain = self.norm_kind == NORM_LLAMA and self.mlp_act == ACT_SILU and self.moe is None
        if plain and all(p is None for p in (*parts, self.sinks, self.o_bias)):
            return None
        moe = None if self.moe is None else ctypes.addressof(self.moe.descriptor)
        return _LayerExt(self.norm_kind, *map(_ptr, parts), self.mlp_act, moe, _ptr(self.sinks), _ptr(self.o_bias))


MOE_ACT_SILU, MOE_ACT_SWIGLU_CLAMPED = 0, 1  # cpu_kernels.c's experts' activations


class _MoEAct(ctypes.Structure):
    """cpu_kernels.c's moe_act_t: the experts' gated activation (SiLU, or gpt-oss's clamped SwiGLU: alpha, limit)."""

    _fields_ = [("kind", ctypes.c_int64), ("alpha", ctypes.c_float), ("limit", ctypes.c_float)]


class ExpertWeights:
    """A mixture-of-experts layer's experts as moe_experts_bf16 reads them: per expert, gate/up (packed: in pairs
    for MOE_ACT_SILU, which takes no gate/up bias then, plain panels for MOE_ACT_SWIGLU_CLAMPED; or a QuantLinear's
    parts, gate rows first) and down (packed, or parts), each with its float32 bias or None; `activation` with its
    alpha and limit; descriptors built once, in expert order. The caller keeps the tensors alive."""

    def __init__(self, gate_up: list, down: list, inter: int, act: int = 0, gate_up_bias: list | None = None,
                 down_bias: list | None = None, activation: int = MOE_ACT_SILU, alpha: float = 1.702,
                 limit: float = 7.0):
        self.inter, self.count = inter, len(gate_up)
        gb, db = gate_up_bias or [None] * self.count, down_bias or [None] * self.count
        if activation == MOE_ACT_SILU and any(isinstance(w, torch.Tensor) and b is not None
                                              for w, b in zip(gate_up, gb)):
            raise ValueError("packed bf16 gate/up pairs (SiLU) take no bias")
        # their parts' arrays
        self._projs = [_proj(w, act, b) for w, b in zip(gate_up, gb)], [_proj(w, act, b) for w, b in zip(down, db)]
        self.gate_up = (_Proj * self.count)(*self._projs[0])
        self.down = (_Proj * self.count)(*self._projs[1])
        self.activation = _MoEAct(activation, alpha, limit)


MOE_SOFTMAX_TOPK, MOE_TOPK_SOFTMAX = 0, 1  # cpu_kernels.c's routing orders


class _MoE(ctypes.Structure):
    """cpu_kernels.c's moe_t: a mixture-of-experts feed-forward."""

    _fields_ = [
        ("router", ctypes.POINTER(_Proj)),
        ("router_bias", ctypes.c_void_p),
        ("gate_up", ctypes.POINTER(_Proj)),
        ("down", ctypes.POINTER(_Proj)),
    ] + [(name, ctypes.c_int64) for name in ("num_experts", "top_k", "order", "renormalize", "inter")] + [
        ("load", ctypes.c_void_p),
        ("act", _MoEAct),
    ]


class MoEWeights:
    """A mixture-of-experts feed-forward as moe_forward_bf16 (and decode_layer) reads it: the router (packed bf16 or
    quantized parts, its float32 bias or None), the experts (ExpertWeights), the routing (MOE_SOFTMAX_TOPK or
    MOE_TOPK_SOFTMAX, k, renormalisation) and `load`, the int64 [experts] counts the kernel adds each routed row to.
    `packed`: some of them are packed bf16. The caller keeps the tensors alive."""

    def __init__(self, router, router_bias, experts: ExpertWeights, top_k: int, order: int, renormalize: bool,
                 load: torch.Tensor, act: int = 0, packed: bool = False):
        if load.dtype != torch.int64 or load.shape != (experts.count,) or not load.is_contiguous():
            raise ValueError(f"the expert load must be int64 [{experts.count}], contiguous")
        self.experts, self.load, self.router_bias = experts, load, router_bias
        self.packed = packed  # some of its weights are packed bf16 (the bf16 paths' row limit applies)
        self.router = _proj(router, act)
        self.descriptor = _MoE(
            ctypes.pointer(self.router),
            _ptr(router_bias),
            experts.gate_up,
            experts.down,
            experts.count,
            top_k,
            order,
            int(renormalize),
            experts.inter,
            load.data_ptr(),
            experts.activation,
        )


class NativeKernels:
    """Typed entry points over the compiled library; tensors must be contiguous and of the documented dtypes."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
        block_size: int,
        starts: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: float32 [B, H, D]; caches: [slots, KVH, D] float32, bfloat16, or int8 with float32 scales k_scale,
        v_scale [slots, KVH, scales] (one per 64 channels: engine/kv_int8); tables: int64 [B, W]; lengths: int64
        [B]; starts: int64 [B], the first position each row sees (a sliding window; None: 0); sinks: float32 [H], a
        logit per head joining the softmax's denominator (None: none). Returns float32 [B, H, D]."""
        b, h, d = q.shape
        kvh = k_cache.shape[1]
        out = torch.empty_like(q)
        self.lib.paged_decode_attention_ex(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            _kv_format(k_cache, k_scale, v_scale),
            _ptr(k_scale),
            _ptr(v_scale),
            tables.data_ptr(),
            _ptr(starts),
            lengths.data_ptr(),
            _ptr(sinks),
            out.data_ptr(),
            b,
            h,
            kvh,
            d,
            tables.shape[1],
            block_size,
            scale,
        )
        return out

    def linear_bf16(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """y = x W^T (+ bias) for W packed by pack_bf16. x: float32 or bfloat16 [M, K]; bias: float32 [N] or None.
        Returns [M, N] in out_dtype (float32, or bfloat16 rounded to nearest even), accumulated in float32."""
        x = x.contiguous()
        m, k = x.shape
        if packed.shape[1] != k:
            raise ValueError(f"x has {k} features, the packed weight {packed.shape[1]}")
        y = torch.empty(m, out_features, dtype=out_dtype)
        self.lib.gemm_bf16_packed(
            x.data_ptr(),
            int(x.dtype == torch.bfloat16),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            int(out_dtype == torch.bfloat16),
            m,
            k,
            out_features,
        )
        return y

    def linear_f32(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T (+ bias) for float32 x [M, K] and W [N, K] as they are (no packed copy), float32 [M, N]."""
        x = x.contiguous()
        m, k = x.shape
        if weight.shape[1] != k or not weight.is_contiguous():
            raise ValueError(f"x has {k} features; the weight needs {weight.shape[1]}, contiguous")
        y = torch.empty(m, weight.shape[0], dtype=torch.float32)
        self.lib.gemm_f32(x.data_ptr(), weight.data_ptr(), _ptr(bias), y.data_ptr(), m, k, weight.shape[0])
        return y

    def linear_silu_mul_bf16(self, x: torch.Tensor, pairs: torch.Tensor, inter: int) -> torch.Tensor:
        """silu(x G^T) * (x U^T), bf16 [M, inter], for gate/up packed by pack_bf16_pairs; x float32 or bf16."""
        x = x.contiguous()
        m, k = x.shape
        if pairs.shape[1] != k:
            raise ValueError(f"x has {k} features, the packed weight {pairs.shape[1]}")
        y = torch.empty(m, inter, dtype=torch.bfloat16)
        self.lib.gemm_bf16_silu_mul(
            x.data_ptr(), int(x.dtype == torch.bfloat16), pairs.data_ptr(), y.data_ptr(), m, k, 2 * inter
        )
        return y

    def linear_add_bf16(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        residual: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """residual + (x W^T (+ bias)), bf16 [M, N], each rounded to bf16 as torch's two ops would round it.
        residual: bf16 [M, N]."""
        x, residual = x.contiguous(), residual.contiguous()
        m, k = x.shape
        if packed.shape[1] != k or residual.shape != (m, out_features) or residual.dtype != torch.bfloat16:
            raise ValueError("linear_add_bf16: x, the packed weight and the bf16 residual do not match")
        y = torch.empty(m, out_features, dtype=torch.bfloat16)
        self.lib.gemm_bf16_add(
            x.data_ptr(),
            int(x.dtype == torch.bfloat16),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            residual.data_ptr(),
            y.data_ptr(),
            m,
            k,
            out_features,
        )
        return y

    def rmsnorm_bf16(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Hugging Face's LlamaRMSNorm for bfloat16 x [M, D] (contiguous) and bfloat16 weight [D]."""
        y = torch.empty_like(x)
        self.lib.rmsnorm_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
        return y

    def rmsnorm_gemma_bf16(self, x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
        """Hugging Face's Gemma3RMSNorm for bfloat16 x [M, D] (contiguous); weight_plus_one: float32 [D], 1 + weight."""
        y = torch.empty_like(x)
        self.lib.rmsnorm_gemma_bf16(x.data_ptr(), weight_plus_one.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
        return y

    def gelu_mul_bf16(self, gate_up: torch.Tensor) -> torch.Tensor:
        """bf16(bf16(gelu_tanh(gate)) * up) for bfloat16 gate_up [M, 2 I] (contiguous, gate columns first)."""
        m, two_i = gate_up.shape
        y = torch.empty(m, two_i // 2, dtype=torch.bfloat16)
        self.lib.gelu_mul_bf16(gate_up.data_ptr(), y.data_ptr(), m, two_i // 2)
        return y

    def silu_mul_bf16(self, gate_up: torch.Tensor) -> torch.Tensor:
        """bf16(bf16(silu(gate)) * up) for bfloat16 gate_up [M, 2 I] (contiguous, gate columns first)."""
        m, two_i = gate_up.shape
        y = torch.empty(m, two_i // 2, dtype=torch.bfloat16)
        self.lib.silu_mul_bf16(gate_up.data_ptr(), y.data_ptr(), m, two_i // 2)
        return y

    def swiglu_clamped_bf16(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) with g = min(gate, limit),
        in float32 and rounded once to bf16, for bfloat16 gate_up [M, 2 I] (contiguous, gate columns first)."""
        m, two_i = gate_up.shape
        y = torch.empty(m, two_i // 2, dtype=torch.bfloat16)
        self.lib.swiglu_clamped_bf16(gate_up.data_ptr(), y.data_ptr(), m, two_i // 2, alpha, limit)
        return y

    def decode_attention_bf16(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        num_heads: int,
        scale: float,
        block_size: int,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A layer's whole decode attention: rope, KV write, attention. qkv: bf16 [B, (H + 2 KVH) D]; cos, sin: bf16
        [B, D]; caches [slots, KVH, D] float32, bf16, or int8 with scales (as paged_decode_attention; the new keys
        and values quantized as kv_int8.quantize does); slots: int64 [B]. Returns bf16 [B, H D]."""
        b = qkv.shape[0]
        kvh, d = k_cache.shape[1], k_cache.shape[2]
        out = torch.empty(b, num_heads * d, dtype=torch.bfloat16)
        self.lib.decode_attention_bf16(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            _kv_format(k_cache, k_scale, v_scale),
            _ptr(k_scale),
            _ptr(v_scale),
            slots.data_ptr(),
            tables.data_ptr(),
            lengths.data_ptr(),
            out.data_ptr(),
            b,
            num_heads,
            kvh,
            d,
            tables.shape[1],
            block_size,
            scale,
        )
        return out

    def decode_layer_bf16(
        self,
        h: torch.Tensor,
        weights: DecodeLayerWeights,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        num_heads: int,
        scale: float,
        block_size: int,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        starts: torch.Tensor | None = None,
    ) -> None:
        """A whole decoder layer for decode rows, in place on h (bf16 [B, E], contiguous): the kernels its modules
        would call one by one (norm, qkv, decode_attention_bf16, o_proj + residual, norm, gate/up + SiLU, down +
        residual; and the q/k norms, branch norms and GELU its weights carry), in one call, for bf16 or quantized
        projections. starts: int64 [B], each row's first visible position (a sliding window; None: 0). Other
        arguments as decode_attention_bf16."""
        b, e = h.shape
        kvh, d = k_cache.shape[1], k_cache.shape[2]
        w = weights
        qkv, o, gate_up, down = (ctypes.addressof(proj) for proj in w.descriptors)
        self.lib.decode_layer(
            h.data_ptr(),
            b,
            e,
            w.norm1.data_ptr(),
            qkv,
            None if w.qkv_bias is None else w.qkv_bias.data_ptr(),
            o,
            w.norm2.data_ptr(),
            gate_up,
            w.inter,
            down,
            w.eps,
            cos.data_ptr(),
            sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            _kv_format(k_cache, k_scale, v_scale),
            _ptr(k_scale),
            _ptr(v_scale),
            slots.data_ptr(),
            tables.data_ptr(),
            lengths.data_ptr(),
            num_heads,
            kvh,
            d,
            tables.shape[1],
            block_size,
            scale,
            None if w.ext is None else ctypes.addressof(w.ext),
            _ptr(starts),
        )

    def layer_calls(self, layers: list[tuple]) -> ctypes.Array:
        """decode_layers' arguments of each layer that hold from step to step, from (weights: DecodeLayerWeights,
        k_cache, v_cache, k_scale, v_scale, num_heads, scale) a layer, the caches as decode_layer_bf16 takes them.
        The caller keeps the weights and caches alive while the array is used."""
        calls = (_LayerCall * len(layers))()
        for c, (w, k_cache, v_cache, k_scale, v_scale, num_heads, scale) in zip(calls, layers):
            qkv, o, gate_up, down = (ctypes.addressof(proj) for proj in w.descriptors)
            c.norm1, c.qkv, c.qkv_bias, c.o = w.norm1.data_ptr(), qkv, _ptr(w.qkv_bias), o
            c.norm2, c.gate_up, c.down = w.norm2.data_ptr(), gate_up, down
            c.ext = None if w.ext is None else ctypes.addressof(w.ext)
            c.k_cache, c.v_cache, c.k_scale, c.v_scale = k_cache.data_ptr(), v_cache.data_ptr(), *map(
                _ptr, (k_scale, v_scale)
            )
            c.inter, c.heads, c.kv_heads, c.head_dim = w.inter, num_heads, k_cache.shape[1], k_cache.shape[2]
            c.fmt, c.eps, c.scale = _kv_format(k_cache, k_scale, v_scale), w.eps, scale
        return calls

    def decode_layers_bf16(self, h: torch.Tensor, calls: ctypes.Array, step: torch.Tensor, block_size: int) -> None:
        """Every layer of a decode step in one call, in place on h (bf16 [B, E], contiguous): decode_layer_bf16 for
        each of `calls` (layer_calls) in order, with its row of `step` (int64 [layers, STEP_FIELDS]: the data
        pointers of its cos and sin rows, slots, block tables and lengths, the tables' width, and its window's
        starts or 0)."""
        b, e = h.shape
        self.lib.decode_layers(h.data_ptr(), b, e, len(calls), ctypes.addressof(calls), step.data_ptr(), block_size)

    def moe_forward_bf16(self, x: torch.Tensor, moe: MoEWeights, residual: torch.Tensor) -> None:
        """residual += the mixture of experts' output for bf16 rows x [T, E] (the layer's normed input), in place
        (bf16 [T, E], contiguous): router, routing, every expert of the step in one call; adds each expert's routed
        rows to moe.load."""
        t, e = x.shape
        if not (x.dtype == residual.dtype == torch.bfloat16 and residual.shape == x.shape):
            raise ValueError("moe_forward_bf16: bf16 rows and a bf16 residual of the same shape")
        if not (x.is_contiguous() and residual.is_contiguous()):
            raise ValueError("moe_forward_bf16: contiguous rows and residual")
        self.lib.moe_forward_bf16(x.data_ptr(), t, e, ctypes.addressof(moe.descriptor), residual.data_ptr())

    def moe_experts_bf16(
        self,
        xs: torch.Tensor,
        tokens: torch.Tensor,
        weights: torch.Tensor,
        counts: torch.Tensor,
        experts: ExpertWeights,
        out: torch.Tensor,
    ) -> None:
        """out[tokens[s]] += bf16(expert(xs[s]) * weights[s]) for the rows s of each expert in turn (counts[e] rows
        each, in expert order): xs bf16 [S, E] grouped by expert, tokens int64 [S], weights bf16 [S], counts int64
        [experts], out float32 [T, E] contiguous."""
        s, e = xs.shape
        if not (xs.dtype == weights.dtype == torch.bfloat16 and out.dtype == torch.float32 and out.shape[1] == e):
            raise ValueError("moe_experts_bf16: bf16 rows and weights, a float32 output as wide as the rows")
        if counts.shape != (experts.count,) or tokens.shape != (s,) or weights.shape != (s,):
            raise ValueError("moe_experts_bf16: one count per expert, one token and weight per row")
        self.lib.moe_experts_bf16(
            xs.data_ptr(),
            tokens.data_ptr(),
            weights.data_ptr(),
            counts.data_ptr(),
            ctypes.addressof(experts.gate_up),
            ctypes.addressof(experts.down),
            experts.count,
            e,
            experts.inter,
            ctypes.addressof(experts.activation),
            out.data_ptr(),
        )

    def argmax_logsumexp(self, logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Per row of float32 logits [B, V]: the first index of the maximum (as torch.argmax) and logsumexp
        (float32 [B, 1], as torch.logsumexp), in one pass over the rows each."""
        logits = logits.contiguous()
        b, v = logits.shape
        idx = torch.empty(b, dtype=torch.int64)
        lse = torch.empty(b, 1, dtype=torch.float32)
        self.lib.argmax_logsumexp(logits.data_ptr(), b, v, idx.data_ptr(), lse.data_ptr())
        return idx.tolist(), lse

    def masked_argmax(self, logits: torch.Tensor, bitmask: torch.Tensor) -> list[int]:
        """Per row of float32 logits [B, V]: the first index of the largest value among the tokens its row of the
        int32 bitmask [B, ceil(V / 32)] allows (llguidance's layout), as torch.argmax with the rest at -inf; -1 where
        it allows no token above -inf."""
        logits, bitmask = logits.contiguous(), bitmask.contiguous()
        b, v = logits.shape
        if bitmask.dtype != torch.int32 or bitmask.shape != (b, (v + 31) // 32):
            raise ValueError(f"masked_argmax: bitmask {tuple(bitmask.shape)} {bitmask.dtype} for logits {(b, v)}")
        idx = torch.empty(b, dtype=torch.int64)
        self.lib.masked_argmax(logits.data_ptr(), b, v, bitmask.data_ptr(), bitmask.shape[1], idx.data_ptr())
        return idx.tolist()

    def set_amx(self, on: bool) -> bool:
        """Let qgemm and the packed bf16 GEMM use AMX tiles where the CPU and the OS allow (on, the default) or not
        (tests of the other paths); returns whether it is in use."""
        return bool(self.lib.qgemm_set_amx(int(on)))

    def set_int8_vectors(self, on: bool) -> bool:
        """Let qgemm multiply batches by int8 vector kernels (AVX-512 VNNI, else AVX2) where AMX does not take them
        (on, the default) or not (tests and benchmarks compare the paths); returns whether they are on (False where
        the build has neither)."""
        return bool(self.lib.qgemm_set_int8_vectors(int(on)))

    def int8_rows_k(self) -> int:
        """The batch size from which qgemm's auto mode stops multiplying the two-level layouts (K-quants) row by row
        with activations per 256 where AMX does not take them: 16 with AVX2 (32 while rows_exact), 28 where AVX-512
        VNNI takes the batches, 0 in the portable build."""
        return self.lib.qgemm_int8_rows_k()

    def int8_rows_q8(self) -> int:
        """The batch size from which qgemm's auto mode stops multiplying 8-bit blocks (Q8_0, Q5_0, int8) row by row
        where AMX does not take them: 12 with AVX2 (and while rows_exact), 5 where AVX-512 VNNI takes the batches, 0
        in the portable build."""
        return self.lib.qgemm_int8_rows_q8()

    def int8_rows_4(self) -> int:
        """The batch size from which qgemm's auto mode stops multiplying one-level 4-bit blocks (Q4_0, Q4_1, int4 where
        not two-level) row by row with int8 activations per 32: 8 (12 while rows_exact), 0 in the portable build."""
        return self.lib.qgemm_int8_rows_4()

    def int8_vectors_4(self) -> bool:
        """Whether qgemm's auto mode multiplies one-level 4-bit blocks' larger batches by int8 vectors (AVX-512 VNNI,
        while on) rather than with int16 activations (gemm_i16b)."""
        return bool(self.lib.qgemm_int8_vectors_4())

    @contextlib.contextmanager
    def rows_exact(self, on: bool = True) -> Iterator[None]:
        """While on, this thread's quantized products give each row of a batch the bits it gets alone wherever a row
        path can take the batch (8-bit and one-level 4-bit blocks up to 11 rows, the K-quants up to 31 with AVX2),
        and so do the native mixture-of-experts call's other threads: a step verifying speculative drafts must give
        each draft's row what decoding it alone would, or speculation could change a greedy answer."""
        was = self.lib.qgemm_set_rows_exact(int(on))
        try:
            yield
        finally:
            self.lib.qgemm_set_rows_exact(was)

    def int8_vectors_block_k(self) -> int:
        """How many values share an int8 scale when the int8 vector kernels take a K-quant batch: 256 (as the row
        path, llama.cpp's Q8_K), 0 where the build has no vector batches."""
        return self.lib.qgemm_int8_vectors_block_k()

    def bf16_tiles(self) -> bool:
        """Whether batches of bf16 rows (from 17) multiply packed bf16 weights on AMX tiles: then packed panels
        serve every batch size, with no row-major copy of the weights kept for oneDNN."""
        return bool(self.lib.gemm_bf16_tiles())

    def qgemm(
        self,
        x: torch.Tensor,
        w,
        out: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        act: int = 0,
    ) -> None:
        """out = x W^T (+ bias) (+ residual) for W a waferscale.models.quant.QuantWeight [n, K]: x float32 or bf16
        [M, K] contiguous; out a float32 or bf16 [M, n] view with unit column stride (columns of a wider output);
        bias float32 [n]; residual bf16, laid out as out (bf16 out only: rounded as torch's ops would round).
        act: 0 float32 (weights widened to float32, x as it is), 1 int8 (x rounded to int8 per 32, integer products),
        2 auto (int8 per 256 for two-level layouts below 16 rows, per 32 for 8-bit blocks below 12, else float32;
        see quant.ACT_MODE)."""
        m, k = x.shape
        if k != w.in_features or out.shape != (m, w.out_features) or out.stride(1) != 1:
            raise ValueError(f"qgemm: x {tuple(x.shape)}, weight {w.shape}, out {tuple(out.shape)} do not match")
        if residual is not None and (out.dtype != torch.bfloat16 or residual.stride() != out.stride()):
            raise ValueError("qgemm: a residual needs a bf16 output of the same layout")
        self.lib.qgemm(
            x.data_ptr(),
            int(x.dtype == torch.bfloat16),
            m,
            k,
            *_quant_args(w),
            None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(),
            out.data_ptr(),
            int(out.dtype == torch.bfloat16),
            out.stride(0),
            w.out_features,
            int(act),
        )

    def mxfp4_gemm(
        self,
        x: torch.Tensor,
        w,
        out: torch.Tensor,
        bias: torch.Tensor | None = None,
        act: int = 0,
        residual: torch.Tensor | None = None,
    ) -> None:
        """out = x W^T (+ bias) (+ residual) for W a waferscale.models.quant.mxfp4.Mxfp4Weight [n, K], read from its
        blocks: x float32 or bf16 [M, K]; out float32 or bf16 [M, n] with unit column stride (bf16: each sum plus
        its bias rounded once); bias float32 [n]; residual bf16, laid out as out (bf16 out only). act: 0 float32 (x
        as it is), 1 int8 (x rounded to int8 per 32, integer products), 2 auto: int8, as llama.cpp multiplies MXFP4
        (widening the nibbles to float32 bounds the float path)."""
        x = x.contiguous()
        m, k = x.shape
        if x.dtype not in (torch.float32, torch.bfloat16) or out.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("mxfp4_gemm: float32 or bf16 rows in and out")
        if k != w.in_features or out.shape != (m, w.out_features) or out.stride(1) != 1:
            raise ValueError(f"mxfp4_gemm: x {tuple(x.shape)}, weight {w.shape}, out {tuple(out.shape)} do not match")
        if residual is not None and (out.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16
                                     or residual.stride() != out.stride() or residual.shape != out.shape):
            raise ValueError("mxfp4_gemm: a residual is bf16, laid out as a bf16 out")
        bias = None if bias is None else bias.float().contiguous()
        self.lib.mxfp4_gemm(
            x.data_ptr(),
            int(x.dtype == torch.bfloat16),
            m,
            k,
            w.qweight.data_ptr(),
            w.scales.data_ptr(),
            w.out_features,
            int(w.interleaved),
            int(act != 0),
            _ptr(bias),
            _ptr(residual),
            out.data_ptr(),
            int(out.dtype == torch.bfloat16),
            out.stride(0),
        )

    def qdequant_rows(self, w, ids: torch.Tensor) -> torch.Tensor:
        """The rows of a QuantWeight at ids as float32 [len(ids), K], the values qdequant gives; IndexError for an id
        outside 0 .. N - 1 (negative ones included: a token id is never one)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], w.in_features, dtype=torch.float32)
        bad = self.lib.qdequant_rows(
            *_quant_args(w),
            w.out_features,
            ids.data_ptr(),
            ids.shape[0],
            w.in_features,
            out.data_ptr(),
        )
        if bad != -1:
            raise IndexError(f"row {int(ids[bad])} is out of range for a weight of {w.out_features} rows")
        return out

    def qdequant(self, w, rows: slice = slice(None)) -> torch.Tensor:
        """Rows of a QuantWeight as float32 [n, K] (scale * q + min, exactly)."""
        part = w.take_rows(rows)
        q = part.qweight
        out = torch.empty(q.shape[0], w.in_features, dtype=torch.float32)
        self.lib.qdequant(
            *_quant_args(part),
            q.shape[0],
            w.in_features,
            out.data_ptr(),
        )
        return out
