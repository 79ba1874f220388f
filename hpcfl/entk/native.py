"""The fused eNTK path's CPU kernel: kept per-sample gradient coordinates of a Linear or Conv2d weight
in one pass, compiled on first use.

A layer's per-sample weight gradient is an (O, K) matrix G_b = D_b U_b (a Linear: δ_b a_bᵀ; a Linear
on a sequence: Σ over positions; a Conv2d: δ_b over its L output positions times the unfolded input),
of which the fused path keeps a fixed subset of entries. The torch forms either gather both factors
of each kept product (index_select, one pass per factor, then a multiply: a Linear) or materialise
G_b for a tile of samples by a batched product and pick the kept entries (a conv). On an AVX-512 CPU,
:file:`native_kernels.c` does both in one pass: it forms G_b in registers, 4 rows × 64 columns at a
time, and compresses each register's kept lanes (``vcompressps``, lane masks precomputed per row by
:class:`KeptMasks`) straight into the output; nothing is gathered by index and G_b is never
written. Measured on the 2-core AVX-512 EPYC (issue 66; simplecnn, B = 256, p = 100,000, 1 thread,
``benchmarks/results/entk_layer_costs_cpu_p1e5.*``): fc1 7.2 ms against the gathers' 16.5, conv3
10.1 against 14.2 materialised, conv2 7.8 against 8.7; whole batches on 2 threads 0.77× plain
training's throughput against 0.60× with the torch forms (median of 7 rounds). Its cost grows with
the whole weight, not with the kept coordinates, so the cost model (:func:`hpcfl.entk.costs.native_cost`)
takes it only where a layer keeps enough of them (simplecnn's conv1, K = 9, stays materialised: 2.7
ms native, 1.1 materialised). The call releases the GIL (ctypes), so the tasks of
:func:`hpcfl.entk.tasks.run_tasks` run it on every core at once.

Built with the system C compiler (``$CC``, else ``cc``) at ``-O3 -march=native`` into
``~/.cache/hpcfl/native/`` (:func:`hpcfl.files.user_cache_dir`), keyed by the source, the compiler
and the CPU, so nodes of different CPUs sharing a home directory each get their own build; a build
is written under a temporary name and renamed, so ranks building at once never load half a file.
Where there is no compiler, the CPU lacks AVX-512, or ``entk.native`` / ``$HPCFL_ENTK_NATIVE`` is
off, :func:`usable` is False and the torch forms run (:func:`status` says which).

Each kernel has a pure-torch reference of the same signature (``*_reference``): the tests' ground
truth, and what the dispatchers run when the kernel is not usable or the tensors are not float32.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from hpcfl.cpuinfo import cpu_model, vector_extensions
from hpcfl.entk.settings import EntkSettings, active
from hpcfl.files import user_cache_dir

SOURCE = Path(__file__).with_name("native_kernels.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
_LOCK = threading.Lock()
_LOADED: tuple[ctypes.CDLL | None, str] | None = None


@dataclass(frozen=True)
class KeptMasks:
    """The kept entries of an (O, K) per-sample gradient, row by row, for the kernel.

    ``masks`` (O, ⌈K/16⌉) int16: bit t of ``masks[o, v]`` says whether column 16v + t of row o is
    kept; ``starts`` (O + 1,) int64: the output column of row o's first kept entry; ``index`` (n,)
    int64: the kept entries' flat positions o·K + k (the references pick with it). Host work, once
    per plan."""

    masks: Tensor
    starts: Tensor
    index: Tensor
    rows: int
    width: int

    @classmethod
    def of(cls, local: Tensor, rows: int, width: int) -> KeptMasks:
        """From the kept flat positions ``local`` (o·K + k) of an (rows, width) matrix, strictly
        increasing: the output's column order is the matrix's row-major order, as the compressed
        stores write it."""
        local = local.detach().to("cpu", torch.int64)  # deliberate host work: plan-time bookkeeping
        if local.numel() > 1 and not bool((local[1:] > local[:-1]).all()):
            raise ValueError("kept coordinates must be strictly increasing")
        if local.numel() and not 0 <= int(local[0]) <= int(local[-1]) < rows * width:
            raise ValueError(f"kept coordinates outside a {rows}x{width} matrix")
        lanes = -(-width // 16)
        row, col = local.div(width, rounding_mode="floor"), local.remainder(width)
        bits = torch.zeros(rows * lanes, dtype=torch.int32)  # host: the kernel's masks live on the CPU
        bits.index_add_(
            0, row * lanes + col // 16, torch.ones_like(col, dtype=torch.int32) << (col % 16).to(torch.int32)
        )
        bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)  # the same 16 bits, as int16
        starts = torch.zeros(rows + 1, dtype=torch.int64)  # host: as the masks
        starts[1:] = torch.bincount(row, minlength=rows).cumsum(0)
        return cls(bits.to(torch.int16).view(rows, lanes), starts, local, rows, width)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build_key(cc: str) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    parts = [SOURCE.read_text(), cc, version, " ".join(FLAGS), cpu_model(), " ".join(vector_extensions())]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _load() -> tuple[ctypes.CDLL | None, str]:
    """Build (once per source, compiler and CPU) and load the kernel: (library, where) or (None, why not)."""
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc) on PATH"
    target = user_cache_dir("native") / f"entk-{_build_key(cc)}.so"
    if not target.exists():
        why = _compile(cc, target)
        if why is not None:
            return None, why
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        return None, f"loading {target} failed: {err}"
    if lib.hpcfl_native_abi() != 1:
        return None, "this CPU has no AVX-512"
    _declare(lib)
    return lib, str(target)


def _compile(cc: str, target: Path) -> str | None:
    """Compile :data:`SOURCE` to ``target`` through a temporary file renamed into place (so a
    concurrent reader finds the whole library or none); None, or why it failed."""
    tmp: str | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        done = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or [f"{cc} exited with {done.returncode}"])[0]
            return f"compiling {SOURCE.name} failed: {first}"
        os.replace(tmp, target)
        tmp = None
        return None
    except (OSError, subprocess.SubprocessError) as err:
        return f"compiling {SOURCE.name} failed: {err}"
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _declare(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.hpcfl_masked_product.argtypes = [p, i, i, i, p, i, i, i, i, i, p, p, p, i, i]
    lib.hpcfl_masked_product.restype = None
    lib.hpcfl_conv_masked_product.argtypes = [p, *[i] * 17, p, i, i, i, i, p, p, p, i, i, p]
    lib.hpcfl_conv_masked_product.restype = None


def library() -> tuple[ctypes.CDLL | None, str]:
    """The loaded kernel and its file, or None and why not (built or looked up once per process)."""
    global _LOADED
    with _LOCK:
        if _LOADED is None:
            _LOADED = _load()
        return _LOADED


def usable(device: torch.device, settings: EntkSettings | None = None) -> bool:
    """Whether the fused path on ``device`` uses the kernel: a CPU, the setting on, the kernel built."""
    settings = settings if settings is not None else active()
    return device.type == "cpu" and settings.native and library()[0] is not None


def status(settings: EntkSettings | None = None) -> str:
    """For a run's record: ``"on: FILE"``, or ``"off: WHY"``."""
    settings = settings if settings is not None else active()
    if not settings.native:
        return f"off: switched off ({settings.native_from})"
    lib, where = library()
    return f"on: {where}" if lib is not None else f"off: {where}"


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def _native_fits(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _check_out(out: Tensor, batch: int, kept: KeptMasks) -> None:
    n = kept.index.numel()
    if out.shape != (batch, n):
        raise ValueError(f"out must be ({batch}, {n}), got {tuple(out.shape)}")


def masked_product_reference(d: Tensor, u: Tensor, kept: KeptMasks, out: Tensor) -> Tensor:
    """``out[b, j] = (d_b u_b)[o_j, k_j]`` for the kept entries (pure torch): ``d`` (B, O, L), ``u``
    (B, L, K), ``out`` (B, n), any strides. Products in the inputs' dtype, cast on store."""
    _check_out(out, d.shape[0], kept)
    full = torch.bmm(d, u).reshape(d.shape[0], -1)  # (B, O·K)
    out.copy_(full.index_select(1, kept.index.to(full.device)))
    return out


def masked_product(d: Tensor, u: Tensor, kept: KeptMasks, out: Tensor) -> Tensor:
    """:func:`masked_product_reference` by the kernel where it is usable and the tensors suit it
    (float32 on the CPU, rows of ``u`` and ``out`` contiguous); else the reference."""
    batch, rows, length = d.shape
    width = u.shape[2]
    lib = library()[0] if usable(d.device) else None
    if (
        lib is None
        or not _native_fits(d, u, out)
        or u.stride(2) != 1
        or out.stride(1) != 1
        or (rows, width) != (kept.rows, kept.width)
    ):
        return masked_product_reference(d, u, kept, out)
    _check_out(out, batch, kept)
    lib.hpcfl_masked_product(
        _ptr(d), d.stride(0), d.stride(1), d.stride(2),
        _ptr(u), u.stride(0), u.stride(1),
        rows, length, width,
        _ptr(kept.masks), _ptr(kept.starts),
        _ptr(out), out.stride(0), batch,
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class ConvGeometry:
    """A Conv2d's kernel, stride, padding (explicit, symmetric) and dilation, each (h, w)."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]


def conv_masked_product_reference(
    x: Tensor, delta: Tensor, geometry: ConvGeometry, kept: KeptMasks, out: Tensor
) -> Tensor:
    """A Conv2d's (groups 1) kept per-sample weight gradient entries, k = (c, ky, kx), in pure torch:
    ``x`` (B, C, H, W) the layer's input, ``delta`` (B, O, Ho, Wo) its output gradient, ``out`` (B, n)."""
    batch, out_c = delta.shape[:2]
    cols = F.unfold(x, geometry.kernel, geometry.dilation, geometry.padding, geometry.stride)  # (B, K, L)
    return masked_product_reference(delta.reshape(batch, out_c, -1), cols.transpose(1, 2), kept, out)


def conv_masked_product(
    x: Tensor,
    delta: Tensor,
    geometry: ConvGeometry,
    kept: KeptMasks,
    out: Tensor,
    scratch: Tensor | None = None,
) -> Tensor:
    """:func:`conv_masked_product_reference` by the kernel where it is usable and the tensors suit it
    (float32 on the CPU, δ's output positions at one stride: NCHW or channels-last); ``scratch``
    holds at least L·K float32 (one sample's unfolded input; allocated when None)."""
    batch, channels, height, width = x.shape
    out_c, h_out, w_out = delta.shape[1:]
    k = channels * geometry.kernel[0] * geometry.kernel[1]
    lib = library()[0] if usable(x.device) else None
    # δ_b[o, l] at o·stride(1) + l·step: one step per output position, as in NCHW and channels-last
    step = delta.stride(3) if w_out > 1 else delta.stride(2)
    uniform = h_out == 1 or w_out == 1 or delta.stride(2) == w_out * delta.stride(3)
    if (
        lib is None
        or not _native_fits(x, delta, out)
        or not uniform
        or out.stride(1) != 1
        or (out_c, k) != (kept.rows, kept.width)
    ):
        return conv_masked_product_reference(x, delta, geometry, kept, out)
    _check_out(out, batch, kept)
    need = h_out * w_out * k
    if scratch is None or scratch.numel() < need or scratch.dtype != torch.float32:
        scratch = torch.empty(need, dtype=torch.float32, device=x.device)
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (
        geometry.kernel, geometry.stride, geometry.padding, geometry.dilation
    )  # fmt: skip
    lib.hpcfl_conv_masked_product(
        _ptr(x), *x.stride(), channels, height, width,
        kh, kw, sh, sw, ph, pw, dh, dw, h_out, w_out,
        _ptr(delta), delta.stride(0), delta.stride(1), step,
        out_c, _ptr(kept.masks), _ptr(kept.starts),
        _ptr(out), out.stride(0), batch, _ptr(scratch),
    )  # fmt: skip
    return out
