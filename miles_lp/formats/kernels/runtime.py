"""The kernels' launch runtime: whether they can run here, loading the Triton source in the requested mode, and
the launch path that skips Triton's per-call dispatch after a specialization's first launch (host time per
call is what QuantLinear's small shapes pay).

Shared by the format modules (``kernels.mxfp8``, ``kernels.nvfp4``) and the bound launches (``kernels.bound``);
the names they use are public here. Tests and benchmarks replace ``launch`` / ``module_for`` on this module to
count or stub launches, so the format modules call them through it (``rt.launch(...)``).
"""

from __future__ import annotations

import importlib.util
import os
import threading

import torch

from miles_lp.config import switch
from miles_lp.errors import BackendUnavailable

OUT_KIND = {None: 0, torch.float32: 1, torch.bfloat16: 2}
# Launch path: after a kernel's first launch for a specialization (dtypes, 16-byte alignment of pointers,
# ints equal to 1 / multiples of 16: what Triton specializes on, plus every constexpr and num_warps), later
# launches call the compiled kernel's launcher directly and skip Triton's per-call binding, cache-key and
# option formatting (host time per launch: bench quantize "small shape"). runtime.kernels_fast_launch: false
# keeps Triton's JIT dispatch on every call (for A/B timing); so does a Triton launch hook (profilers).
LAUNCHERS: dict[tuple, object] = {}
_MODULES: dict[tuple[str, bool], object] = {}  # (module name, interpreted) -> the imported module
_LOCK = threading.Lock()
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_triton.py")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_TRITON: list[str | None] = []  # [reason or None], filled on first use


def _triton_missing() -> str | None:
    if not _TRITON:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return f"Triton is not importable ({exc}); install triton (pip install triton) or use the reference codecs"
        _TRITON.append(None)
    return _TRITON[0]


def unavailable_reason(x: torch.Tensor) -> str | None:
    """Why the kernels cannot run on ``x`` here (None: they can)."""
    missing = _triton_missing()
    if missing:
        return missing
    if x.is_cuda:
        return None
    if x.device.type == "cpu" and interpreting():
        return None
    return (f"the Triton kernels run on CUDA tensors; this one is on {x.device} (no CUDA device is used here). "
            "Use the reference codecs (miles_lp.formats.quantize_mxfp8 / quantize_nvfp4) on CPU, or set "
            "TRITON_INTERPRET=1 to run the kernels in Triton's (slow) interpreter")


def enabled(x: torch.Tensor) -> bool:
    """Whether the codecs should hand ``x`` to these kernels: a CUDA tensor, Triton importable, and
    ``runtime.kernels`` not ``reference``."""
    if not x.is_cuda or switch("kernels") == "reference":
        return False
    return _triton_missing() is None


def module_for(x: torch.Tensor):
    reason = unavailable_reason(x)
    if reason:
        raise BackendUnavailable(f"miles_lp.formats.kernels: {reason}")
    return cached_jit_module(PATH, "miles_lp.formats.kernels._triton", not x.is_cuda)


def load(interpret: bool):
    """Import ``_triton.py`` with @triton.jit in the requested mode (Triton decides at decoration time)."""
    return load_jit_module(PATH, "miles_lp.formats.kernels._triton", interpret)


def cached_jit_module(path, name: str, interpret: bool):
    """``load_jit_module`` once per module and mode in this process (threads racing to the first call import it
    once): what every kernel module's launches go through."""
    key = (name, interpret)
    mod = _MODULES.get(key)
    if mod is None:
        with _LOCK:
            mod = _MODULES.get(key)
            if mod is None:
                mod = _MODULES[key] = load_jit_module(path, name, interpret)
    return mod


def load_jit_module(path, name: str, interpret: bool):
    """Import the Triton source file ``path`` as module ``name`` (``_interpreted`` appended under the
    interpreter), its @triton.jit kernels compiled (``interpret=False``) or interpreted, whatever
    ``TRITON_INTERPRET`` says now: Triton reads that variable when a kernel is decorated, so each mode is its own
    module. Shared with ``miles_lp.multitensor.kernels``."""
    name = name + ("_interpreted" if interpret else "")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod


def spec_key(args: tuple) -> tuple:
    """What Triton specializes the runtime arguments on (so one cached launcher never serves another variant):
    a tensor's dtype and whether its pointer is 16-byte aligned; an int's being 1, a multiple of 16, 64-bit.
    One flat tuple, built without a per-argument function call (this is on every launch's path)."""
    return tuple((a.dtype, not a.data_ptr() & 15) if type(a) is torch.Tensor
                 else (a == 1, not a & 15, -2147483648 <= a < 2147483648) if type(a) is int
                 else (type(a).__name__, a) for a in args)


SITES: dict[tuple, tuple] = {}  # plan key -> (compiled kernel, constexpr values): skips spec_key on the hot path


def launch(mod, name: str, grid: tuple, args: tuple, num_warps: int, site: tuple | None = None,
            maxnreg: int = 0, **consts) -> None:
    """``mod.<name>[grid](*args, **consts, num_warps=num_warps)``, through the cached launcher when it can.

    ``args`` are the kernel's runtime parameters in signature order and ``consts`` its constexprs (which
    follow them in every kernel of ``_triton.py``). ``site``: a key the caller guarantees to determine the
    launch's whole specialization (a plan key: shapes, dtypes, pointer alignment of every argument not
    freshly allocated); then the launcher is looked up by it directly, without ``spec_key(args)``.
    ``maxnreg`` > 0: ptxas' register cap per thread (more programs resident per SM; CUDA only).
    """
    fast = switch("kernels_fast_launch")  # (one read per launch: about an environment lookup)
    if site is not None and fast:
        ent = SITES.get(site)
        if ent is not None and not launch_hooks_set():
            ck, const_vals = ent
            g = (*grid, 1, 1)
            ck.run(g[0], g[1], g[2], stream(args[0].device.index), ck.function, ck.packed_metadata, None, None,
                   None, *args, *const_vals)
            return
    fn = getattr(mod, name)
    opts = {"num_warps": num_warps}
    if maxnreg and args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
        opts["maxnreg"] = maxnreg
    if not fast or not args or not isinstance(args[0], torch.Tensor) or not args[0].is_cuda:
        fn[grid](*args, **consts, **opts)
        return
    if launch_hooks_set():
        fn[grid](*args, **consts, **opts)
        return
    dev = args[0].device.index
    key = (name, dev, num_warps, maxnreg, tuple(consts.items()), spec_key(args))
    ent = LAUNCHERS.get(key)
    if ent is not None and site is not None:
        SITES[site] = ent
    if ent is None:
        ck = fn[grid](*args, **consts, **opts)  # compiles (first time) and launches
        if hasattr(ck, "result"):
            ck = ck.result()
        rest = fn.arg_names[len(args):]
        if len(fn.arg_names) != len(args) + len(consts) or set(rest) != set(consts) or not hasattr(ck, "run"):
            return  # not the layout this path assumes: this key stays on the JIT path (no entry cached)
        LAUNCHERS[key] = (ck, tuple(consts[n] for n in rest))
        if site is not None:
            SITES[site] = LAUNCHERS[key]
        return
    ck, const_vals = ent
    g = (*grid, 1, 1)
    ck.run(g[0], g[1], g[2], stream(dev), ck.function, ck.packed_metadata, None, None, None, *args, *const_vals)


_KNOBS: list = []


def launch_hooks_set() -> bool:
    """Whether a Triton launch hook is installed (a profiler's): then every launch goes through the JIT,
    which calls it (and a ``Binding``'s holder takes the entry point instead). Triton 3.6 keeps the hooks as
    (possibly empty) ``HookChain``s, older ones None or a function."""
    if not _KNOBS:
        from triton import knobs

        _KNOBS.append(knobs.runtime)
    rt = _KNOBS[0]
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        calls = getattr(h, "calls", None)
        if (bool(calls) if calls is not None else h is not None):
            return True
    return False


def stream(dev: int) -> int:
    """The current CUDA stream's handle (what Triton's own launch passes; a graph capture's stream too)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(dev) if raw is not None else torch.cuda.current_stream(dev).cuda_stream


def input_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the tensor the kernel reads, IN_KIND): bf16 as its int16 bits, fp32 / fp16 as they are."""
    if not x.is_contiguous():  # (the check is cheaper than a contiguous() call on the hot path)
        x = x.contiguous()
    if x.dtype == torch.bfloat16:
        return (x.detach() if x.requires_grad else x).view(torch.int16), 1
    return x, 0  # the launch reads only its data pointer


PLANS: dict[tuple, object] = {}  # entry point + everything its launch depends on -> the validated plan


MAX_PLANS = 4096  # token counts vary per micro-batch: bound the per-shape caches (cleared when full)


def plan_key(x: torch.Tensor, *flags) -> tuple:
    """What an entry point's validation, output shapes and launch depend on: the input's shape, dtype,
    device, 16-byte alignment, contiguity and the call's flags (the launch shapes in CONFIG among them)."""
    if len(PLANS) > MAX_PLANS:
        PLANS.clear()
        SITES.clear()
    return (x.shape, x.dtype, x.device, x.data_ptr() & 15, x.is_contiguous(), *flags)


_EMPTY: dict[torch.device, torch.Tensor] = {}


def none_tensor(dev: torch.device) -> torch.Tensor:
    """The placeholder for an output a launch does not write (one 0-element tensor per device, reused)."""
    t = _EMPTY.get(dev)
    if t is None:
        t = _EMPTY[dev] = torch.empty(0, dtype=torch.uint8, device=dev)
    return t


def out_kind(dtype: torch.dtype | None, what: str) -> int:
    if dtype not in OUT_KIND:
        raise BackendUnavailable(f"miles_lp.formats.kernels: {what} in {dtype} is not a kernel output; the "
                                 "kernels write float32 or bfloat16 (use .dequantize(dtype) for others)")
    return OUT_KIND[dtype]


def out_tensor(shape, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.int16 if dtype == torch.bfloat16 else dtype, device=device)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype) if t.dtype != dtype else t


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tma_descriptor(t: torch.Tensor, block: tuple):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}[t.dtype]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block),
                            gl.NVMMASharedLayout.get_default_for(list(block), gdt))


class _HostDesc:
    """What Triton's launcher reads of a host tensor descriptor (base, shape, strides, padding): the layout and
    block shape are compiled into the kernel, so a cached launch needs only these (Gluon's ``TensorDescriptor``
    and its JIT dispatch cost 100-190 us of host time per launch on the H200's host)."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, t: torch.Tensor):
        self.base, self.shape, self.strides, self.padding = t, list(t.shape), list(t.stride()), "zero"


TMA_LAUNCHERS: dict[tuple, tuple] = {}


def launch_tma(fn, programs: int, descs: tuple, args: tuple, num_warps: int, maxnreg: int = 0, **consts) -> None:
    """``fn[(programs,)](*descriptors, *args, **consts, num_warps=num_warps)`` for a Gluon kernel whose leading
    parameters are TMA tensor descriptors, given as ``(tensor, block shape)`` pairs (the default NVMMA shared layout
    of the block); after the first launch of a specialization, through its compiled launcher directly, as
    ``launch``'s fast path does for Triton kernels. ``maxnreg`` > 0: ptxas' register cap per thread."""
    key = (fn, num_warps, maxnreg, tuple(consts.items()), tuple((t.dtype, tuple(b)) for t, b in descs),
           spec_key(args))
    ent = TMA_LAUNCHERS.get(key)
    if ent is not None and switch("kernels_fast_launch") and not launch_hooks_set():
        ck, const_vals = ent
        ck.run(programs, 1, 1, stream(descs[0][0].device.index), ck.function, ck.packed_metadata, None, None, None,
               *(_HostDesc(t) for t, _ in descs), *args, *const_vals)
        return
    opts = {"maxnreg": maxnreg} if maxnreg else {}
    ck = fn[(programs,)](*(_tma_descriptor(t, b) for t, b in descs), *args, **consts, num_warps=num_warps, **opts)
    if hasattr(ck, "result"):
        ck = ck.result()
    full = {**consts, "num_warps": num_warps}
    rest = fn.arg_names[len(descs) + len(args):]
    if hasattr(ck, "run") and set(rest) == set(full):
        TMA_LAUNCHERS[key] = (ck, tuple(full[n] for n in rest))
