"""The fixed-order CPU kernels of the true on-policy mode (``cpu_kernels.c``): a matmul and a
causal attention in which every output element is one fixed sequence of IEEE operations on its
own inputs, so its bits do not depend on the batch, the CPU's vendor or instruction set, or the
compiler's flags (the C file says how).

The C file is compiled with the system's C compiler (``$CC``, else ``cc``) on first use, into
``$XDG_CACHE_HOME/rlactors`` (default ``~/.cache/rlactors``), one library per source, flags,
compiler and CPU, and loaded with ctypes. The kernels run on one thread.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")


def compile_library(flags: tuple[str, ...] = FLAGS) -> Path:
    """The path of ``cpu_kernels.c`` compiled with ``flags``, compiling it unless cached."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"true_on_policy on CPU compiles {SOURCE.name} and needs a C compiler: "
                           f"{compiler!r} was not found (install gcc or clang, or set CC)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *flags, compiler, version, _cpu_flags()]).encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlactors"
    library = cache / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # then renamed: concurrent builds are safe
            built = Path(tmp) / library.name
            done = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"compiling {SOURCE} failed:\n{done.stderr[-2000:]}")
            os.replace(built, library)
    return library


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so that a cache shared by machines keeps one build per CPU."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def load_library(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.rl_matmul.argtypes = [ptr, ptr, ptr, i64, i64, i64]
    library.rl_silu.argtypes = [ptr, ptr, i64]
    library.rl_matmul.restype = None
    library.rl_attend.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float]
    library.rl_attend_scratch.argtypes = [i64, ptr, i64, i64]
    library.rl_attend_scratch.restype = i64
    library.rl_attend.restype = ctypes.c_int
    return library


@functools.cache
def _library() -> ctypes.CDLL:
    return load_library(compile_library())


def matmul(a: torch.Tensor, weight_t: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """fp32 ``a @ weight_t`` (``a [M, K]``, ``weight_t [K, N]``, a weight transposed), each
    element the fmaf chain over k in order: row ``m`` of the result depends only on row ``m`` of
    ``a``. ``library``: another build of the kernels (tests compare builds)."""
    if a.dim() != 2 or weight_t.dim() != 2 or a.shape[1] != weight_t.shape[0]:
        raise ValueError(f"matmul: a {tuple(a.shape)} and weight_t {tuple(weight_t.shape)} do not match")
    a = _fp32_contiguous(a)
    weight_t = _fp32_contiguous(weight_t)
    out = torch.empty(a.shape[0], weight_t.shape[1])
    if out.numel():
        (library or _library()).rl_matmul(a.data_ptr(), weight_t.data_ptr(), out.data_ptr(),
                                          a.shape[0], weight_t.shape[1], a.shape[1])
    return out


def silu(gate: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """fp32 ``silu(gate)`` as ``g / (1 + exp(-g))``, each element computed alone: its bits depend
    on its value only, on any x86-64 CPU. ``library``: another build of the kernels."""
    gate = _fp32_contiguous(gate)
    out = torch.empty_like(gate)
    if out.numel():
        (library or _library()).rl_silu(gate.data_ptr(), out.data_ptr(), gate.numel())
    return out


def attend(q: torch.Tensor, kv: torch.Tensor, key_slots: torch.Tensor, segments: torch.Tensor,
           positions: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """Causal attention in fp32 (scale ``1/sqrt(D)``), ``rl_attend`` of ``cpu_kernels.c``: query
    ``i`` (``q [N, Hq, D]``) attends to keys ``0 .. positions[i]`` of segment ``segments[i]``,
    whose key at position ``p`` is in slot ``key_slots[segment, p]`` of ``kv [2, Hkv, R, D]``
    (K, V). Returns ``[N, Hq, D]`` fp32; query ``i``'s output depends only on its own row and
    those keys and values. A segment, position or slot out of range raises IndexError."""
    n, heads, dim = q.shape
    _, kv_heads, num_slots, _ = kv.shape
    if kv.shape[0] != 2 or kv.shape[3] != dim or heads % kv_heads or key_slots.dim() != 2 \
            or segments.shape != (n,) or positions.shape != (n,):
        raise ValueError(f"attend: q {tuple(q.shape)}, kv {tuple(kv.shape)}, key_slots {tuple(key_slots.shape)}, "
                         f"segments {tuple(segments.shape)} and positions {tuple(positions.shape)} do not match")
    q, kv = _fp32_contiguous(q), _fp32_contiguous(kv)
    key_slots = key_slots.to(torch.int64).contiguous()
    segments, positions = segments.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    library = library or _library()
    out = torch.empty(n, heads, dim)
    scratch = torch.empty(library.rl_attend_scratch(n, positions.data_ptr(), heads // kv_heads, dim))
    failed = library.rl_attend(
        q.data_ptr(), kv.data_ptr(), key_slots.data_ptr(), segments.data_ptr(), positions.data_ptr(),
        out.data_ptr(), scratch.data_ptr(), n, heads, kv_heads, num_slots, dim, *key_slots.shape, dim**-0.5)
    if failed:
        raise IndexError(f"attend: a segment, position or key slot is out of range (segments < "
                         f"{key_slots.shape[0]}, positions < {key_slots.shape[1]}, slots < {num_slots})")
    return out


def _fp32_contiguous(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":
        raise ValueError(f"the CPU kernels got a tensor on {x.device}")
    return x.to(torch.float32).contiguous()
