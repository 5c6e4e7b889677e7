"""Offline SASS of the codec kernels for sm_90 (H100 / H200), no GPU needed: instructions per element.

``python -m miles_lp.formats.kernels.sass [--kernel NAME ...] [--dump DIR]`` compiles each kernel of
``_triton.py`` at the launch shape ``kernels`` uses for a [16384, 8192] bf16 input (``CONFIG``) through
Triton's own compiler and ``ptxas`` for ``GPUTarget("cuda", 90, 32)``, disassembles the cubin with the
``cuobjdump`` that Triton's wheel ships, and prints the static instruction count per program divided by the
elements one program handles, with the opcode histogram.

Why static counts are the measure here: every kernel below is straight-line code for one tile (no loop:
``K_ITERS == 1`` for the per-token kernel at K <= 16384), so the static count IS the dynamic count per
program (bar the few branches around the global-scale stores). With the H200's ~33 T thread-instructions
per second (132 SMs x 4 schedulers x 32 lanes x ~1.98 GHz) and its ~4.1 TB/s copy, a kernel that moves
B bytes per element at a fraction f of copy has about 33e12 / (4.1e12 * f / B) instructions per element to
spend: NVFP4 per-token (B = 2 + 0.5 + 1/16 = 2.56) at f = 0.80 -> ~26; MXFP8 row + col (B = 4.06) at
f = 0.85 -> ~38 (METHOD.md: operations over rate vs bytes over bandwidth). These are issue slots for
the whole thread, not a prediction of time: memory latency and occupancy decide how much of the two overlap.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile

SM90 = ("cuda", 90, 32)
_INSN = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?")


def _bin(tool: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{tool} not found in Triton's wheel ({path}); install a Triton wheel for CUDA")
    return path


def _module(name: str = ""):
    """``_triton.py`` compiled (not interpreted): the same loader the entry points use, forced to CUDA mode;
    ``name`` "fp8_block": ``_fp8_block_triton.py``."""
    from miles_lp.formats.kernels import runtime

    if name == "fp8_block":
        from miles_lp.formats.kernels import fp8_block

        return runtime.cached_jit_module(fp8_block._PATH, "miles_lp.formats.kernels._fp8_block_triton", False)
    return runtime.load(False)


def compile_kernel(name: str, signature: dict, constexprs: dict, num_warps: int, maxnreg: int = 0):
    """Triton's ``CompiledKernel`` of ``_triton.<name>`` for sm_90, specialized as a launch at the bench shape
    is: pointers 16-byte aligned (fresh allocations) and every int a multiple of 16 (``tt.divisibility``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod, _, name = name.rpartition(":")  # "fp8_block:act_slab_kernel": a kernel of _fp8_block_triton.py
    fn = getattr(_module(mod), name)
    params = fn.arg_names
    # constexprs left out take the kernel's defaults, as a launch does (ASTSource would otherwise compile them
    # as None: an ``if STQ:`` store then vanishes and the count is of an empty kernel)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.name not in constexprs
                     and p.default is not inspect.Parameter.empty}, **constexprs}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if signature.get(p, "constexpr") != "constexpr"}
    sig = {p: signature.get(p, "constexpr") for p in params}
    src = ASTSource(fn, sig, constexprs, attrs)
    opts = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget(*SM90), options=opts)


def _cuobjdump(ck, flag: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        return subprocess.run([_bin("cuobjdump"), flag, path], capture_output=True, text=True, check=True).stdout


def sass_lines(ck) -> list[str]:
    return [ln for ln in _cuobjdump(ck, "-sass").splitlines() if _INSN.match(ln)]


def resources(ck) -> dict:
    """Registers per thread, stack (spills land there), shared memory: ``cuobjdump -res-usage``."""
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", _cuobjdump(ck, "-res-usage"))
    return {"registers": int(m.group(1)), "stack": int(m.group(2)), "shared": int(m.group(3))} if m else {}


def ptxas_notes(ck, arch: str = "sm_90a") -> list[str]:
    """ptxas's numbered notes (``(C75xx) ...``) on the kernel's PTX, assembled again with ``-v``. Triton keeps
    them quiet; C7514 is the one that matters for a wgmma kernel: ptxas serialized its wgmmas because other
    instructions read an in-flight accumulator (the asynchrony the kernel was written for is gone)."""
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(ck.asm["ptx"])
        r = subprocess.run([_bin("ptxas"), f"-arch={arch}", "-v", ptx, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, check=True)
    return [ln.split("ptxas info    : ", 1)[-1] for ln in r.stderr.splitlines() if "(C75" in ln]


def main_body(lines: list[str]) -> list[str]:
    """The kernel's own code: up to its last EXIT. What follows are subroutines (the slow path of the exact
    fp32 division, ``div.rn.f32``, taken only for denormal / huge operands), counted by ``histogram`` but
    not executed on ordinary inputs."""
    last = max((i for i, ln in enumerate(lines) if re.search(r"\bEXIT\b", ln)), default=len(lines) - 1)
    return lines[:last + 1]


_ADDR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/")
_BRA = re.compile(r"\bBRA\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)")


def dynamic_count(lines: list[str], iters: list[int], classify=None) -> int:
    """Instructions one program executes when the kernel's backward branches (its loops, in program order) run
    ``iters`` times each: the static count plus each loop body's count times (iterations - 1). (A branch to itself,
    the trailing trap, is no loop.) ``classify(body lines) -> index into iters``: which loop a body is, for a
    kernel whose short loops ptxas may unroll (an unrolled loop is no loop: its static count is its executed one)."""
    addrs = [int(_ADDR.match(ln).group(1), 16) for ln in lines]
    total = sum(histogram(lines).values())
    loops = []
    for i, ln in enumerate(lines):
        m = _BRA.search(ln)
        if m and int(m.group(1), 16) < addrs[i]:
            loops.append((int(m.group(1), 16), addrs[i]))
    if classify is None and len(loops) != len(iters):
        raise ValueError(f"sass: {len(loops)} loops found, {len(iters)} iteration counts given")
    for k, (lo, hi) in enumerate(loops):
        body = [ln for ln, a in zip(lines, addrs, strict=True) if lo <= a <= hi]
        n = iters[classify(body) if classify else k]
        total += (n - 1) * sum(histogram(body).values())
    return total


def slab_loop(body: list[str]) -> int:
    """``act_slab_kernel``'s loops: 1 for the columnwise pass (it encodes and has no shuffle: the transpose goes
    through shared memory), 0 for the amax (+ rowwise) pass."""
    text = "\n".join(body)
    return 1 if "F2FP" in text and "SHFL" not in text else 0


def histogram(lines: list[str]) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for ln in lines:
        m = _INSN.match(ln)
        if m and m.group(2) not in ("NOP",):
            c[m.group(2)] += 1
    return c


# The launch shapes of a [16384, 8192] bf16 input (kernels.CONFIG / the entry points' choices).
def cases(k: int = 8192) -> dict[str, tuple]:
    from miles_lp.formats import kernels

    cfg = kernels.CONFIG
    reg = cfg["nvfp4_rows_reg"]
    nb = kernels.triton_next_pow2(k // 16)
    out = {}
    for tag, ok, ept in (("nvfp4_rows", 0, reg["el_per_thread"]), ("nvfp4_rows_qdq", 2, reg["el_per_thread_dq"])):
        warps = max(1, min(16, nb * 16 // (32 * ept)))
        out[tag] = ("nvfp4_quantize_rows_kernel",
                    {"x_ptr": "*i16", "M": "i32", "K": "i32", "amax_ptr": "*fp32", "q_ptr": "*u8", "s_ptr": "*u8",
                     "gs_ptr": "*fp32", "d_ptr": "*i16" if ok else "*u8"},
                    {"IN_KIND": 1, "OUT_KIND": ok, "ROWS": 1, "NB": nb, "K_ITERS": 1}, warps, nb * 16)
    pairs = cfg["nvfp4_pairs"]
    for tag, dq, ept, rs in (("nvfp4_pairs", 0, pairs["el_per_thread"], pairs["RS"]),
                             ("nvfp4_pairs_qdq", 1, pairs["el_per_thread_dq"], pairs["RS_dq"])):
        warps = max(1, min(16, nb * 16 // (32 * ept)))
        out[tag] = ("nvfp4_rows_pairs_kernel",
                    {"x_ptr": "*i32", "M": "i32", "K2": "i32", "amax_ptr": "*fp32", "q_ptr": "*u8", "s_ptr": "*u8",
                     "gs_ptr": "*fp32", "d_ptr": "*i32" if dq else "*u8"},
                    {"DQ": dq, "NB": nb, "RS": rs, "EVICT": pairs.get("EVICT", 0), "ENC": pairs.get("ENC_dq" if dq else "ENC", 0),
                     "FULL": int(rs == 1 and pairs.get("FULL", 1))}, warps,
                    nb * 16 * rs,
                    pairs.get("maxnreg_dq" if dq else "maxnreg", 0))
    # the persistent-grid form (a loop over rows: the static count is one iteration plus the loop's setup)
    per = cfg["nvfp4_persist"]
    ept = pairs["el_per_thread"]
    warps = max(1, min(16, nb * 16 // (32 * ept)))
    out["nvfp4_persist"] = ("nvfp4_rows_persist_kernel",
                            {"x_ptr": "*i32", "N": "i32", "K2": "i32", "P": "i32", "ITERS": "i32", "amax_ptr": "*fp32",
                             "q_ptr": "*u8", "s_ptr": "*u8", "gs_ptr": "*fp32", "d_ptr": "*u8"},
                            {"DQ": 0, "NB": nb, "STAGES": per["STAGES"], "PF": per["PF"], "EVICT": pairs.get("EVICT", 0),
                             "ITERS_C": 0}, warps, nb * 16, per.get("maxnreg", pairs.get("maxnreg", 0)))
    mx_sig = {"x_ptr": "*i16", "R": "i32", "K": "i32", "M": "i32", **{p: "*u8" for p in (
        "qr_ptr", "sr_ptr", "dr_ptr", "wr_ptr", "qc_ptr", "sc_ptr", "dc_ptr", "wc_ptr")}}
    for tag, row, col, key in (("mxfp8_row", 1, 0, "mxfp8"), ("mxfp8_both", 1, 1, "mxfp8_both")):
        c = cfg[key]
        out[tag] = ("mxfp8_quantize_kernel", mx_sig,
                    {"IN_KIND": 1, "ROW": row, "COL": col, "OUT_KIND": 0, "DQ_ROW": 0, "DQ_COL": 0, "SWZ": 0,
                     "BMB": c["BMB"], "NB": c["NB"], "EVICT": c.get("EVICT", 0), "STV": c.get("STV", 0),
                     "FULL": c.get("FULL", 1)}, c["num_warps"],
                    c["BMB"] * 32 * c["NB"] * 32, c.get("maxnreg", 0))
    c = cfg["nvfp4"]
    out["nvfp4_tensor"] = ("nvfp4_quantize_kernel",
                           {"x_ptr": "*i16", "M": "i32", "K": "i32", "amax_ptr": "*fp32", "q_ptr": "*u8",
                            "s_ptr": "*u8", "gs_ptr": "*fp32", "d_ptr": "*u8"},
                           {"IN_KIND": 1, "SCOPE": 0, "OUT_KIND": 0, "TA": c["TA"], "TB": 1, "NB": c["NB"]},
                           c["num_warps"], c["TA"] * c["NB"] * 16)
    out.update(fp8_block_cases())
    return out


def fp8_block_cases(m: int = 8192, k: int = 8192) -> dict[str, tuple]:
    """The FP8 blockwise activation kernels at an [m, k] bf16 launch (CUDA: bf16 read as bf16), per
    ``fp8_block.CONFIG`` / ``ACT_VARIANTS``: the tile kernel per grid and the slab kernel both / columnwise."""
    from miles_lp.formats.kernels import fp8_block

    sig = {"x_ptr": "*bf16", "row_q_ptr": "*u8", "row_s_ptr": "*fp32", "col_q_ptr": "*u8", "col_s_ptr": "*fp32",
           "M": "i32", "K": "i32", "MP": "i32"}
    common = {"VALUE_FOR_INF": 3.3895313892515355e38, "POW2": 0, "BLOCK": 128, "BF16_BITS": 0}
    w = fp8_block.CONFIG["act_warps"]
    out = {"fp8b_tile_rows": ("fp8_block:act_tile_kernel", sig, {**common, "ROWS": 1, "COLS": 0}, w, 128 * 128),
           "fp8b_tile_cols": ("fp8_block:act_tile_kernel", sig, {**common, "ROWS": 0, "COLS": 1}, w, 128 * 128),
           "fp8b_tile_both": ("fp8_block:act_tile_kernel", sig, {**common, "ROWS": 1, "COLS": 1}, w, 128 * 128)}
    for name, v in fp8_block.ACT_VARIANTS.items():
        c = {**common, **{n: v[n] for n in ("RSLAB", "CSLAB", "PREFETCH")}}
        for tag, rows in (("both", 1), ("cols", 0)):
            out[f"fp8b_{name}_{tag}"] = ("fp8_block:act_slab_kernel", sig, {**c, "ROWS": rows}, v["warps"], 128 * 128)
            LOOP_ITERS[f"fp8b_{name}_{tag}"] = [128 // v["RSLAB"], 128 // v["CSLAB"]]  # (slab_loop's order)
    return out


LOOP_ITERS: dict[str, list[int]] = {}  # case -> iterations of each of its loops (dynamic_count)


def report(names: list[str] | None = None, dump: str | None = None, out=sys.stdout) -> dict:
    res = {}
    for tag, (name, sig, consts, warps, elems, *cap) in cases().items():
        if names and tag not in names:
            continue
        ck = compile_kernel(name, sig, consts, warps, *cap)
        lines = sass_lines(ck)
        hist = histogram(lines)
        total = sum(hist.values())
        per_el = total / (elems / (32 * warps))
        rs = resources(ck)
        body = sum(histogram(main_body(lines)).values())
        if LOOP_ITERS.get(tag):  # executed, not static: the loops' bodies times their iterations
            total = dynamic_count(lines, LOOP_ITERS[tag], slab_loop)
            body = dynamic_count(main_body(lines), LOOP_ITERS[tag], slab_loop)
            per_el = total / (elems / (32 * warps))
        per_body = body / (elems / (32 * warps))
        res[tag] = {"instructions": total, "elements_per_thread": elems / (32 * warps), "per_element": per_el,
                    "body_instructions": body, "body_per_element": per_body,
                    "num_warps": warps, **rs, "histogram": dict(hist.most_common())}
        top = ", ".join(f"{op} {n}" for op, n in hist.most_common(14))
        print(f"{tag:16s} {name} warps={warps} elements/thread={elems // (32 * warps)} SASS={total} "
              f"-> {per_el:.1f} per element ({per_body:.1f} without the division slow-path subroutine); "
              f"regs {rs.get('registers')} stack {rs.get('stack')}; {top}", file=out)
        if dump:
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, f"{tag}.sass"), "w") as f:
                f.write("\n".join(lines) + "\n")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", action="append", help="one of " + ", ".join(cases()))
    p.add_argument("--dump", help="write each kernel's SASS to DIR/<kernel>.sass")
    a = p.parse_args(argv)
    report(a.kernel, a.dump)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
