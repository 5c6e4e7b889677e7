"""``miles-lp bench quantize``: codec throughput next to torchao, and NVFP4 agreement.

On CPU (GB/s of input): our MXFP8 eager and ``torch.compile`` paths against torchao's
``to_mx(..., RCEIL)`` (the anchor: ratio = ours / torchao), NVFP4 / FP8 eager, and the rate of scale and
data bytes where torchao's NVFP4 (``nvfp4_quantize`` with a per-tensor scale) differs from TE's rule.

On CUDA (``miles_lp.bench.quantize_cuda``): every Triton kernel (``miles_lp.formats.kernels``) in GB/s
counting the bytes it must read plus write (each input once, each output once), side by side in the same
run with torchao's compiled ``to_mx(..., RCEIL)`` and NVFP4 and a device-to-device copy (the ceiling);
prints each kernel's fraction of copy bandwidth and its ratio to the torchao anchor of the same bytes.
Also runnable as ``python -m miles_lp.bench.quantize``.

  miles-lp bench quantize --rows 4096 --cols 4096 --no-compile
  miles-lp bench quantize --device cuda --rows 16384 --cols 8192 --json out.json
"""

from __future__ import annotations

import argparse
import time

from miles_lp import devices

HELP = "measure quantize throughput (MXFP8 eager / compiled vs torchao) and NVFP4 agreement with torchao"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--rows", type=int, default=8192, help="rows of the input tensor (default 8192)")
    p.add_argument("--cols", type=int, default=8192, help="columns (K, a multiple of 32; default 8192)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="input dtype")
    p.add_argument("--device", type=devices.torch_device, default="cpu", help="torch device: cpu (default), cuda, cuda:1, ...")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions; the best is reported")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile path (compiles once)")
    p.add_argument("--no-torchao", action="store_true", help="skip the torchao anchor")
    p.add_argument("--json", default=None, help="CUDA: also write the table as JSON to this path")
    p.add_argument("--sweep", action="store_true",
                   help="CUDA: first try a few launch shapes per kernel and keep the fastest")


def _best_seconds(fn, repeats: int, sync) -> float:
    fn()  # warm-up (and compile)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def run(args) -> int:
    import warnings

    import torch

    from miles_lp.formats import quantize_fp8_blockwise, quantize_mxfp8, quantize_nvfp4

    dtype = getattr(torch, args.dtype)
    if str(args.device).startswith("cuda"):
        from miles_lp.bench.quantize_cuda import run_cuda

        return run_cuda(args)
    x = torch.randn(args.rows, args.cols, dtype=torch.float32, device=args.device).to(dtype)
    gb = x.numel() * x.element_size() / 1e9
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    print(f"input [{args.rows}, {args.cols}] {args.dtype} on {args.device} ({gb:.3f} GB); "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; best of {args.repeats}")

    results: dict[str, float] = {}

    def bench(name, fn):
        s = _best_seconds(fn, args.repeats, sync)
        results[name] = gb / s
        print(f"  {name:34s} {gb / s:8.3f} GB/s  ({s * 1e3:8.1f} ms)")

    ao_to_mx = ao_nvfp4 = None
    if not args.no_torchao:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from torchao.prototype.mx_formats.config import ScaleCalculationMode
                from torchao.prototype.mx_formats.mx_tensor import to_mx
                from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

            def ao_to_mx():
                return to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)

            def ao_nvfp4(amax):
                return nvfp4_quantize(x, 16, per_tensor_amax_to_scale(amax))
        except ImportError as exc:
            print(f"  torchao not importable ({exc}); anchor skipped")

    bench("miles-lp mxfp8 rowwise eager", lambda: quantize_mxfp8(x))
    bench("miles-lp mxfp8 colwise eager", lambda: quantize_mxfp8(x, axis=-2))
    if not args.no_compile:
        t = time.perf_counter()
        quantize_mxfp8(x, compile=True)
        print(f"  (torch.compile of the MXFP8 core: {time.perf_counter() - t:.1f} s, once)")
        bench("miles-lp mxfp8 rowwise compiled", lambda: quantize_mxfp8(x, compile=True))
    if ao_to_mx is not None:
        bench("torchao to_mx RCEIL eager", ao_to_mx)
        anchor = results["torchao to_mx RCEIL eager"]
        for name in [n for n in results if n.startswith("miles-lp mxfp8")]:
            print(f"  ratio {name} / torchao: {results[name] / anchor:.2f}x")
        ours = quantize_mxfp8(x)
        s, d = ao_to_mx()
        same = torch.equal(ours.data.view(torch.uint8), d.view(torch.uint8).reshape(x.shape)) and torch.equal(
            ours.scale, s.view(torch.uint8).reshape(ours.scale.shape))
        print(f"  mxfp8 bytes identical to torchao RCEIL: {same}")
    if not args.no_compile:
        c, e = quantize_mxfp8(x, compile=True), quantize_mxfp8(x)
        same = torch.equal(c.data.view(torch.uint8), e.data.view(torch.uint8)) and torch.equal(c.scale, e.scale)
        print(f"  mxfp8 compiled bytes identical to eager: {same}")

    bench("miles-lp nvfp4 tensor-scope eager", lambda: quantize_nvfp4(x))
    bench("miles-lp fp8 blockwise 128x128 eager", lambda: quantize_fp8_blockwise(x))
    if ao_nvfp4 is not None:
        ours = quantize_nvfp4(x)
        s, d = ao_nvfp4(ours.amax)
        scale_rate = (s.view(torch.uint8).reshape(ours.scale.shape) != ours.scale.view(torch.uint8)).double().mean()
        data_rate = (d.view(torch.uint8).reshape(ours.data.shape) != ours.data).double().mean()
        print(f"  torchao nvfp4 vs TE rule: scale bytes differ {scale_rate.item():.4%}, "
              f"data bytes differ {data_rate.item():.4%}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m miles_lp.bench.quantize", description=DESCRIPTION)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
