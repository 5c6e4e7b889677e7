"""`miles-lp bench convert`: conversion throughput vs a plain copy of the same files, and peak memory.

Builds a synthetic Qwen3-MoE-shaped bf16 checkpoint (real HF tensor names, so the policy applies; several
shards of ``--shard-mb``; kept and reused with ``--workdir``), then in the same run: copies it
(``shutil.copytree``) and converts it (``--target``, default SGLang; ``--format``, default both mxfp8 and
mxfp8+nvfp4-experts, each against the same copy) in a child process that reports its peak RSS (VmHWM).
Both read the input from the page cache (it was just written or read) and both are timed until their
output is on disk (``os.sync``), so the ratio compares like with like. ``--repeat N`` alternates copy and
conversions N times and prints every round and the spread (the machine may be shared: read the spread).

Targets: MXFP8 >= 0.7x the copy (stretch 0.9x), MXFP8 + NVFP4-experts >= 0.6x, peak RSS < 3x
the largest shard. Each conversion prints its split: the CPU seconds of each pipeline stage (read, hash,
quantize, write: ``checkpoint.pipeline``; summed over threads, they overlap), the sync, and the rest
(validation, plan, configs, index, metadata), so a regression shows where it is.

``--process`` also times whole processes in the same run: ``cp -r`` + sync, ``miles-lp convert`` + sync
(interpreter start and imports included) and, with ``--llmcompressor-python PY`` (an interpreter whose
environment has llm-compressor, e.g. a separate venv), llm-compressor's ``model_free_ptq`` (MXFP8 for
mxfp8; NVFP4A16 on every linear layer for the other formats: not the same tensor set, said so) on the
same checkpoint. ``--plot PNG`` draws throughput and peak RSS (``plot_convert``).
"""

from __future__ import annotations

FORMATS = ("mxfp8", "nvfp4-experts", "mxfp8+nvfp4-experts")
DEFAULT_FORMATS = ("mxfp8", "mxfp8+nvfp4-experts")
TARGETS = {"mxfp8": (0.7, 0.9), "nvfp4-experts": (0.6, None), "mxfp8+nvfp4-experts": (0.6, None)}  # (target, stretch)
STAGES = ("read", "hash", "quantize", "write")
HELP = "time `convert` on a synthetic ~2 GB Qwen3-MoE checkpoint against a plain copy; peak RSS vs shard"
DESCRIPTION = __doc__

_HWM = """
def _hwm():  # peak RSS of this process (VmHWM). ru_maxrss would include the parent's RSS at fork
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1
"""
_CHILD = _HWM + """
import json, os, sys, time
from miles_lp.policy.presets import policy_for_format
from miles_lp.checkpoint import pipeline
from miles_lp.checkpoint.convert import convert_checkpoint
src, out, fmt, target, shard = sys.argv[1:6]
t0 = time.perf_counter()
s = convert_checkpoint(src, out, policy_for_format(fmt), target=target, progress=False,
                       max_shard_bytes=int(shard) or None, log=lambda m: None)
t1 = time.perf_counter()
os.sync()
s.seconds = time.perf_counter() - t0  # with the output on disk, as the copy's time
clock = pipeline.last_clock()
print(json.dumps({"seconds": s.seconds, "sync": s.seconds - (t1 - t0), "bytes_in": s.bytes_in,
                  "bytes_out": s.bytes_out, "weights": s.weights_by_format, "hwm": _hwm(),
                  "pipeline": clock.as_dict() if clock is not None else None}))
"""
_LLMC = """
import json, os, sys, time, warnings
warnings.simplefilter("ignore")
src, out, scheme, workers = sys.argv[1:5]
t0 = time.perf_counter()
from llmcompressor import model_free_ptq
model_free_ptq(src, out, scheme=scheme, ignore=["lm_head", "re:.*mlp[.]gate$"], max_workers=int(workers),
               device="cpu")
os.sync()
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""
_BASELINE = _HWM + """
import json, torch, safetensors.torch, miles_lp.checkpoint.convert, miles_lp.policy, miles_lp.formats, tqdm
print(json.dumps({"hwm": _hwm()}))
"""


def add_arguments(p) -> None:
    p.add_argument("--size-gb", type=float, default=2.0, help="synthetic checkpoint size (default 2.0)")
    p.add_argument("--shard-mb", type=float, default=500, help="input shard size in MB (default 500)")
    p.add_argument("--format", default=None, choices=FORMATS,
                   help="convert to this format only (default: mxfp8 and mxfp8+nvfp4-experts, side by side)")
    p.add_argument("--target", default="sglang", choices=("sglang", "vllm", "compressed-tensors"))
    p.add_argument("--workdir", default=None, help="where to build the checkpoint (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON too")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw GB/s of the copy and each conversion, and peak RSS vs the largest shard (matplotlib)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="alternate the copy and the conversions N times; print each round and the spread")
    p.add_argument("--process", action="store_true",
                   help="also time whole processes: cp -r, miles-lp convert (and llm-compressor, see below)")
    p.add_argument("--llmcompressor-python", default=None, metavar="PY",
                   help="with --process: an interpreter that imports llmcompressor (e.g. a separate venv)")
    p.add_argument("--llmcompressor-workers", type=int, default=2, metavar="N",
                   help="model_free_ptq max_workers (default 2, the cores here)")


def synth_config(size_bytes: float) -> dict:
    """A Qwen3-MoE config (hidden 2048, 16 experts of 768) with as many layers as fill ``size_bytes``."""
    hidden, inter, experts, vocab, heads, kv, hd = 2048, 768, 16, 32000, 32, 4, 128
    per_layer = 2 * (2 * heads * hd * hidden + 2 * kv * hd * hidden + experts * (3 * inter * hidden + hidden))
    layers = max(1, round((size_bytes - 4 * vocab * hidden) / per_layer))
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
            "intermediate_size": 6144, "moe_intermediate_size": inter, "num_experts": experts,
            "num_experts_per_tok": 4, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "norm_topk_prob": True, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rope_theta": 1e6}


def synth_tensors(c: dict):
    """(name, shape) in the order HF checkpoints store them."""
    h, hd = c["hidden_size"], c["head_dim"]
    yield "model.embed_tokens.weight", (c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (c["num_attention_heads"] * hd, h)
        yield p + "self_attn.k_proj.weight", (c["num_key_value_heads"] * hd, h)
        yield p + "self_attn.v_proj.weight", (c["num_key_value_heads"] * hd, h)
        yield p + "self_attn.o_proj.weight", (h, c["num_attention_heads"] * hd)
        yield p + "self_attn.q_norm.weight", (hd,)
        yield p + "self_attn.k_norm.weight", (hd,)
        yield p + "mlp.gate.weight", (c["num_experts"], h)
        for e in range(c["num_experts"]):
            q = f"{p}mlp.experts.{e}."
            yield q + "gate_proj.weight", (c["moe_intermediate_size"], h)
            yield q + "up_proj.weight", (c["moe_intermediate_size"], h)
            yield q + "down_proj.weight", (h, c["moe_intermediate_size"])
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (c["vocab_size"], h)


def build(root, size_gb: float, shard_mb: float):
    """Write the synthetic checkpoint into ``root`` (seeded: the same bytes every time). A folder built
    earlier with the same arguments (its ``bench-build.json`` stamp) is reused as it is."""
    import json

    import torch

    from miles_lp.io.safetensors_io import ShardWriter

    cfg = synth_config(size_gb * 1e9)
    stamp = {"size_gb": size_gb, "shard_mb": shard_mb, "config": cfg, "seed": 0}
    if (root / "bench-build.json").exists() and json.loads((root / "bench-build.json").read_text()) == stamp:
        return cfg
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(0)
    w = ShardWriter(root, int(shard_mb * 1e6))
    for name, shape in synth_tensors(cfg):
        w.add(name, (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16))
    w.finish()
    (root / "bench-build.json").write_text(json.dumps(stamp))
    return cfg


def _run_child(code: str, *argv: str, python: str | None = None) -> dict:
    """``python -c code argv...`` in a child; its last stdout line as JSON."""
    import json
    import subprocess
    import sys

    res = subprocess.run([python or sys.executable, "-c", code, *argv], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"child failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _timed_process(argv: list[str]) -> float:
    """Wall seconds of a whole process, then ``sync`` (its output on disk)."""
    import os
    import subprocess
    import time

    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{argv[0]} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    os.sync()
    return time.perf_counter() - t0


def _copy_seconds(src, dst) -> tuple[float, float]:
    """(copytree + sync seconds, of which sync)."""
    import os
    import shutil
    import time

    t0 = time.perf_counter()
    shutil.copytree(src, dst)
    t1 = time.perf_counter()
    os.sync()
    t2 = time.perf_counter()
    shutil.rmtree(dst)
    return t2 - t0, t2 - t1


def _spread(values: list[float]) -> str:
    import statistics

    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def _process_round(src, work, formats, args) -> dict:
    """Whole processes, one after the other on the same checkpoint: cp -r, miles-lp convert, llm-compressor."""
    import shutil
    import sys

    out = {"cp -r": _timed_process(["cp", "-r", str(src), str(work / "cp")])}
    shutil.rmtree(work / "cp")
    for fmt in formats:
        dst = work / "proc-out"
        shutil.rmtree(dst, ignore_errors=True)
        exe = [shutil.which("miles-lp")] if shutil.which("miles-lp") else [sys.executable, "-m", "miles_lp.cli"]
        out[f"miles-lp convert {fmt}"] = _timed_process(
            [*exe, "convert", "--hf-checkpoint", str(src), "--output", str(dst),
             "--format", fmt, "--target", args.target, "--no-progress"])
        shutil.rmtree(dst, ignore_errors=True)
        if args.llmcompressor_python:
            scheme = "MXFP8" if fmt == "mxfp8" else "NVFP4A16"
            res = _run_child(_LLMC, str(src), str(dst), scheme, str(args.llmcompressor_workers),
                             python=args.llmcompressor_python)
            out[f"llm-compressor model_free_ptq {scheme}"] = res["seconds"]
            shutil.rmtree(dst, ignore_errors=True)
    return out


def _split_row(res: dict) -> str:
    p = res.get("pipeline")
    if not p:
        return f"sync {res['sync']:.2f} s; no pipeline split (this convert does not run checkpoint.pipeline)"
    cpu = "  ".join(f"{k} {p['cpu'][k]:.2f}" for k in STAGES)
    rest = res["seconds"] - res["sync"] - p["wall"]
    return (f"CPU s: {cpu} | pipeline wall {p['wall']:.2f} s ({p['workers']} workers) | sync {res['sync']:.2f} s"
            f" | other {rest:.2f} s")


def run(args) -> int:
    import json
    import shutil
    import statistics
    import tempfile
    from pathlib import Path

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="miles-lp-bench-convert-"))
    src, cp, out = work / "src", work / "copy", work / "out"
    formats = [args.format] if args.format else list(DEFAULT_FORMATS)
    rounds: list[dict] = []
    processes: list[dict] = []
    try:
        import os
        import time

        t0 = time.perf_counter()
        cfg = build(src, args.size_gb, args.shard_mb)
        build_s = time.perf_counter() - t0
        files = [p for p in src.iterdir() if p.is_file()]
        total = sum(p.stat().st_size for p in files)
        shards = [p.stat().st_size for p in src.glob("*.safetensors")]
        largest = max(shards)
        os.sync()  # flush the build's dirty pages so that neither timing pays for them
        for p in files:  # the input in the page cache for both (a reused build may have been evicted)
            with open(p, "rb", buffering=0) as f:
                while f.read(1 << 24):
                    pass
        base_rss = _run_child(_BASELINE)["hwm"]
        for _ in range(max(1, args.repeat)):
            shutil.rmtree(cp, ignore_errors=True)
            copy_s, copy_sync = _copy_seconds(src, cp)
            r = {"copy_s": copy_s, "copy_sync": copy_sync, "formats": {}}
            for fmt in formats:
                shutil.rmtree(out, ignore_errors=True)
                r["formats"][fmt] = _run_child(_CHILD, str(src), str(out), fmt, args.target, "0")
            shutil.rmtree(out, ignore_errors=True)
            rounds.append(r)
            if args.process:
                processes.append(_process_round(src, work, formats, args))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for d in (cp, out, work / "cp", work / "proc-out"):
                shutil.rmtree(d, ignore_errors=True)
    last = rounds[-1]
    copy_gbs = total / 1e9 / last["copy_s"]
    rows = [
        ("checkpoint", f"{total / 1e9:.2f} GB, {len(shards)} shards, {cfg['num_hidden_layers']} layers (built or "
                       f"found in {build_s:.1f} s)"),
        ("copy (shutil.copytree)", f"{last['copy_s']:.2f} s  {copy_gbs:.3f} GB/s (sync {last['copy_sync']:.2f} s)"),
        ("largest input shard", f"{largest / 1e9:.2f} GB; import-only baseline RSS {base_rss / 1e9:.2f} GB"),
    ]
    figures = {}
    for fmt in formats:
        res = last["formats"][fmt]
        conv_gbs = res["bytes_in"] / 1e9 / res["seconds"]
        ratios = [r["copy_s"] / r["formats"][fmt]["seconds"] for r in rounds]  # same bytes: GB/s ratio
        ratio, rss = statistics.median(ratios), max(r["formats"][fmt]["hwm"] for r in rounds)
        target, stretch = TARGETS[fmt]
        verdict = "PASS" if ratio >= target else "MISS"
        if stretch is not None:
            verdict += f"; stretch >= {stretch}: {'PASS' if ratio >= stretch else 'MISS'}"
        figures[fmt] = {"convert_s": res["seconds"], "convert_gbs": conv_gbs, "ratio": ratio, "ratios": ratios,
                        "peak_rss": rss, "rss_ratio": rss / largest, "bytes_out": res["bytes_out"],
                        "weights": res["weights"], "split": res.get("pipeline"), "sync_s": res["sync"]}
        rows += [
            (f"convert {fmt} ({args.target})", f"{res['seconds']:.2f} s  {conv_gbs:.3f} GB/s of input; "
                                                f"out {res['bytes_out'] / 1e9:.2f} GB; {res['weights']}"),
            ("  split", _split_row(res)),
            ("  ratio convert/copy", f"{_spread(ratios)}  (target >= {target}: {verdict})"),
            ("  peak RSS", f"{rss / 1e9:.2f} GB = {rss / largest:.2f}x the largest shard "
                            f"(target < 3: {'PASS' if rss / largest < 3 else 'MISS'}); above the baseline "
                            f"{(rss - base_rss) / largest:.2f}x"),
        ]
    if len(rounds) > 1:
        rows.append(("rounds (copy s | convert s)", "; ".join(
            f"{r['copy_s']:.2f} | " + " ".join(f"{r['formats'][f]['seconds']:.2f}" for f in formats) for r in rounds)))
    proc_summary = {}
    if processes:
        for key in processes[0]:
            vals = [p[key] for p in processes]
            proc_summary[key] = vals
            anchor = [p["cp -r"] / p[key] for p in processes]
            ratio = "" if key == "cp -r" else f"; ratio to cp -r {_spread(anchor)}"
            rows.append((f"process: {key}", f"{_spread(vals)} s{ratio}"))
        for fmt in formats:
            for key in processes[0]:
                if key.startswith("llm-compressor") and (key.endswith("MXFP8") == (fmt == "mxfp8")):
                    ours = f"miles-lp convert {fmt}"
                    speedup = [p[key] / p[ours] for p in processes]
                    note = "" if fmt == "mxfp8" else " (NVFP4A16 on every linear layer: more tensors in FP4)"
                    rows.append((f"  llm-compressor / miles-lp ({fmt})", f"{_spread(speedup)}x the time{note}"))
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows))
    summary = {"bytes": total, "copy_s": last["copy_s"], "copy_gbs": copy_gbs, "baseline_rss": base_rss,
               "largest_shard": largest, "target": args.target, "formats": figures,
               "rounds": rounds, "processes": proc_summary}
    if args.json:
        print(json.dumps(summary))
    if args.plot:
        plot_convert(summary, args.plot)
        print(f"plot: {args.plot}")
    return 0


def plot_convert(summary: dict, path) -> None:
    """Two panels from the ``--json`` figures. Left: each conversion's throughput as a fraction of the copy's
    (the median over ``--repeat`` rounds as the bar, every round as a dot), with its target over its
    bar (MXFP8 0.7x, dotted stretch 0.9x; with NVFP4 0.6x). Right: peak RSS of each conversion next to the
    largest input shard (with the 3x target). Matplotlib Agg, imported here."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = list(summary["formats"])
    copy_gbs = summary["copy_gbs"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    per_round = [summary["formats"][f].get("ratios") or [summary["formats"][f]["convert_gbs"] / copy_gbs]
                 for f in fmts]
    medians = [statistics.median(r) for r in per_round]
    bars = a1.bar(fmts, medians, color="#1f77b4")
    a1.bar_label(bars, labels=[f"{m:.2f}x" + (f"\n(median of {len(r)})" if len(r) > 1 else "")
                               for m, r in zip(medians, per_round, strict=True)], fontsize=8)
    for x, (fmt, r) in enumerate(zip(fmts, per_round, strict=True)):
        if len(r) > 1:
            a1.scatter([x] * len(r), r, color="black", s=10, zorder=3, label="each round" if x == 0 else None)
        target, stretch = TARGETS.get(fmt, (None, None))
        if target is not None:
            a1.plot([x - 0.4, x + 0.4], [target] * 2, color="#d62728", ls="--", lw=1,
                    label="target" if x == 0 else None)
        if stretch is not None:
            a1.plot([x - 0.4, x + 0.4], [stretch] * 2, color="#d62728", ls=":", lw=1,
                    label="stretch" if x == 0 else None)
    a1.set_ylabel("conversion speed / copy speed")
    top = max(max(max(r) for r in per_round), 1.0)
    a1.set_ylim(0, top * 1.3)
    a1.set_title(f"{summary['bytes'] / 1e9:.2f} GB checkpoint -> {summary['target']}; "
                 f"copy {copy_gbs:.2f} GB/s (last round)", fontsize=10)
    a1.legend(fontsize=8, loc="upper right")
    largest = summary["largest_shard"]
    gb = [largest / 1e9, *(summary["formats"][f]["peak_rss"] / 1e9 for f in fmts)]
    bars = a2.bar(["largest shard", *fmts], gb, color=["#7f7f7f"] + ["#ff7f0e"] * len(fmts))
    a2.bar_label(bars, labels=[f"{v:.2f} GB" + ("" if i == 0 else f"\n({v * 1e9 / largest:.2f}x shard)")
                               for i, v in enumerate(gb)], fontsize=8)
    a2.axhline(3 * largest / 1e9, color="#d62728", ls="--", lw=1, label="target: < 3x largest shard")
    if summary.get("baseline_rss", -1) > 0:
        a2.axhline(summary["baseline_rss"] / 1e9, color="black", ls=":", lw=1, label="import-only RSS")
    a2.set_ylabel("GB")
    a2.set_ylim(0, max(max(gb), 3 * largest / 1e9) * 1.45)
    a2.set_title("peak RSS of the conversion process", fontsize=10)
    a2.legend(fontsize=8, loc="upper left")
    for ax in (a1, a2):
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("miles-lp bench convert", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
