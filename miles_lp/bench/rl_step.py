"""``miles-lp bench rl-step``: one RL step per precision arm, side by side in one run, as ratios to the BF16 arm.

Each arm is a recipe (default: the four ``recipes/smollm2-*.yaml``: BF16, MXFP8 shared grid, MXFP8 learner + BF16
sampler, NVFP4) run by ``miles_lp.launch.runner.Run`` exactly as ``miles-lp run`` runs it (learner, reference engine,
sync with its checks), in a process of its own so that its peak RSS is its own: ``--warmup`` steps, then
``--steps`` timed steps; the best timed step is reported (a shared host's load only adds time). Per arm: the step
time and its ratio to the first arm (``--recipes``' first, BF16 by default), the stage split (generate /
old_log_prob / update_actor / sync + checks), the rollout's generated tokens per second, the process's peak RSS.

The anchor row: ``transformers`` ``generate`` (sampling, temperature 1, the same prompts x group size, the same
``max_new_tokens``, in the dtype the engine computes in) on the same model, in a process of its own; the arms'
rollout tokens/s are also given as a ratio to it. Tokens counted alike on both sides: each row's tokens up to and
including its first stop token.

Load average (1 min) is printed beside every figure: on a host shared with other jobs the wall times move with it;
the ratios measured in one run are the figures to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HELP = "RL step time per precision arm (ratios to BF16), stage split, rollout tokens/s vs transformers generate, RSS"
DESCRIPTION = HELP + """

  miles-lp bench rl-step                                   # the four recipes/smollm2-*.yaml, 1 warm-up + 2 timed steps
  miles-lp bench rl-step --recipes recipes/smollm2-bf16.yaml recipes/smollm2-mxfp8.yaml --steps 3
  miles-lp bench rl-step --set rl.prompts_per_step=4 --threads 2 --out docs/results/smollm2-speed
"""

DEFAULT_RECIPES = ("smollm2-bf16.yaml", "smollm2-mxfp8.yaml", "smollm2-mxfp8-bf16-sampler.yaml", "smollm2-nvfp4.yaml")
STAGES = ("generate", "reward", "old_log_prob", "update_actor", "sync", "checks")


def add_arguments(p) -> None:
    p.add_argument("--recipes", nargs="+", default=None, metavar="YAML",
                   help="the arms (the first is the ratios' baseline); default: the four recipes/smollm2-*.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="a recipe override applied to every arm (repeatable), e.g. model.path=DIR")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per arm first (default 1)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per arm; the best is reported (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads in every process")
    p.add_argument("--no-generate-anchor", action="store_true", help="skip the transformers generate row")
    p.add_argument("--out", default=None, metavar="DIR", help="write rl_step.json and rl_step.md there")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per arm (default 3600)")


def _recipe_paths(args) -> list[Path]:
    if args.recipes:
        return [Path(r) for r in args.recipes]
    from miles_lp.rollout.testing import recipe_path

    return [Path(recipe_path(n)) for n in DEFAULT_RECIPES]


def _child(kind: str, recipe: Path, args, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "miles_lp.bench.rl_step", kind, str(recipe), str(out),
           "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    for o in args.overrides:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail), "wall_s": time.perf_counter() - t0}
    return json.loads(out.read_text())


def run(args) -> int:
    recipes = _recipe_paths(args)
    for r in recipes:
        if not r.exists():
            print(f"bench rl-step: recipe {r} does not exist", file=sys.stderr)
            return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="miles-lp-bench-rl-step-") as tmp:
        for i, r in enumerate(recipes):
            print(f"bench rl-step: arm {r.stem} ...", file=sys.stderr, flush=True)
            rows.append({"arm": r.stem, "recipe": str(r), **_child("arm", r, args, Path(tmp) / f"arm{i}.json")})
        anchor = None
        if not args.no_generate_anchor:
            print("bench rl-step: transformers generate ...", file=sys.stderr, flush=True)
            anchor = _child("generate", recipes[0], args, Path(tmp) / "generate.json")
    result = summarize(rows, anchor)
    result["args"] = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    print(render(result))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        _write(out / "rl_step.json", json.dumps(result, indent=1, default=str) + "\n")
        _write(out / "rl_step.md", render(result) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # written whole, then renamed
    tmp.write_text(text)
    tmp.replace(path)


def summarize(rows: list[dict[str, Any]], anchor: dict[str, Any] | None) -> dict[str, Any]:
    """Ratios to the first arm and to the generate anchor (pure: the rows as the children wrote them)."""
    base = next((r for r in rows if "error" not in r), None)
    gen_tps = None if not anchor or "error" in anchor else anchor.get("tokens_per_s")
    for r in rows:
        if "error" in r:
            continue
        if base is not None and base.get("step_s"):
            r["step_vs_first"] = r["step_s"] / base["step_s"]
        if gen_tps:
            r["rollout_vs_generate"] = r["rollout_tokens_per_s"] / gen_tps
    return {"arms": rows, "generate_anchor": anchor, "host": _host()}


def _host() -> dict[str, Any]:
    import platform

    import torch

    flags = ""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0]
    except (OSError, IndexError):
        pass
    return {"cpu_count": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__,
            "avx512_bf16": " avx512_bf16" in flags, "amx_bf16": " amx_bf16" in flags}


def _ratio(v: float | None) -> str:
    """``1.23x``, or ``-`` where there is none (no generate anchor: ``--no-generate-anchor``, or it failed)."""
    return "-" if v is None else f"{v:.2f}x"


def render(result: dict[str, Any]) -> str:
    rows, anchor, host = result["arms"], result.get("generate_anchor"), result["host"]
    isa = "AMX" if host.get("amx_bf16") else ("AVX512-BF16, no AMX" if host.get("avx512_bf16") else "no BF16 ISA")
    lines = [f"bench rl-step: {host['cpu_count']} CPU(s) ({isa}), torch {host['torch']}; best of the timed steps; "
             "load = 1-min load average during the arm",
             "",
             "| arm | step s | vs first | generate | old_log_prob | update_actor | sync+checks | rollout tok/s | "
             "vs generate | peak RSS GB | tokens (update) | load |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arm']} | failed: {r['error']} |" + " |" * 10)
            continue
        st = r["stages_s"]
        lines.append(
            f"| {r['arm']} | {r['step_s']:.1f} | {r.get('step_vs_first', float('nan')):.2f}x | {st.get('generate', 0):.1f} | "
            f"{st.get('old_log_prob', 0):.1f} | {st.get('update_actor', 0):.1f} | "
            f"{st.get('sync', 0) + st.get('checks', 0):.1f} | {r['rollout_tokens_per_s']:.0f} | "
            f"{_ratio(r.get('rollout_vs_generate'))} | {r['peak_rss_gb']:.2f} | {int(r['tokens_update'])} | "
            f"{r['load'][0]:.1f}-{r['load'][1]:.1f} |")
    if anchor:
        if "error" in anchor:
            lines.append(f"\ntransformers generate: failed: {anchor['error']}")
        else:
            lines.append(f"\ntransformers generate ({anchor['dtype']}, {anchor['rows']} rows, <= {anchor['max_new_tokens']} "
                         f"new tokens): {anchor['tokens']} tokens in {anchor['seconds']:.2f} s = "
                         f"{anchor['tokens_per_s']:.0f} tok/s (best of {anchor['repeats']}), peak RSS "
                         f"{anchor['peak_rss_gb']:.2f} GB, load {anchor['load'][0]:.1f}-{anchor['load'][1]:.1f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# The child processes (one per arm, one for the anchor): ``python -m miles_lp.bench.rl_step KIND RECIPE OUT``
# ---------------------------------------------------------------------------------------------------------


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def _load_recipe(recipe: str, overrides: list[str], run_root: str, steps: int):
    from miles_lp.launch.recipe import load_recipe

    return load_recipe(recipe, [*overrides, f"steps={steps}", f"logging.output_dir={run_root}",
                                f"checkpoint_every={10**6}", "logging.progress=false", "logging.tensorboard=false"])


def child_arm(recipe: str, out: str, warmup: int, steps: int, overrides: list[str]) -> None:
    from miles_lp.launch.runner import Run

    loads = []
    with tempfile.TemporaryDirectory(prefix="miles-lp-bench-run-") as root:
        r = _load_recipe(recipe, overrides, root, warmup + steps)
        t0 = time.perf_counter()
        run = Run.start(r)
        start_s = time.perf_counter() - t0
        timed = []
        try:
            for i in range(warmup + steps):
                loads.append(os.getloadavg()[0])
                m = run.step_once()
                run.step += 1
                if i >= warmup:
                    timed.append(m)
                loads.append(os.getloadavg()[0])
        finally:
            run.close()
    best = min(timed, key=lambda m: m["timing_s/step"])
    stages = {k: float(best.get(f"timing_s/{k}", 0.0)) for k in STAGES}
    gen_s = max(stages["generate"], 1e-9)
    result = {"step_s": float(best["timing_s/step"]), "steps_s": [float(m["timing_s/step"]) for m in timed],
              "stages_s": stages, "start_s": start_s,
              "rollout_tokens_per_s": float(best["tokens/generate"]) / gen_s,
              "tokens_generate": float(best["tokens/generate"]), "tokens_update": float(best["tokens/update_actor"]),
              "update_tokens_per_s": float(best["tokens/update_actor"]) / max(stages["update_actor"], 1e-9),
              "kl": float(best.get("rollout_corr/kl", float("nan"))), "peak_rss_gb": _peak_rss_gb(),
              "load": [min(loads), max(loads)], "threads": _threads()}
    _write(Path(out), json.dumps(result))


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def child_generate(recipe: str, out: str, repeats: int, overrides: list[str]) -> None:
    """transformers ``generate`` on the first arm's model and prompts (its step 0), sampling at temperature 1."""
    import torch
    import transformers

    from miles_lp.launch.model import prepare_model, vocab_size
    from miles_lp.launch.runner import sampling_for
    from miles_lp.rl.tasks import make_task

    with tempfile.TemporaryDirectory(prefix="miles-lp-bench-gen-") as root:
        r = _load_recipe(recipe, overrides, root, 1)
        model_dir = prepare_model(r.model, Path(root) / "model")
        task = make_task(r.task, vocab_size(model_dir), model_dir)
        sp = sampling_for(r, task)
        prompts = task.prompts(0, r.rl.prompts_per_step)
        rows = [list(p.ids) for p in prompts for _ in range(r.rl.group_size)]
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[r.train.compute_dtype]
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        width = max(len(x) for x in rows)
        pad = int(getattr(model.generation_config, "pad_token_id", None) or 0)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, x in enumerate(rows):  # left padding, as the engine's prefill
            ids[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
        stop = set(sp.stop_token_ids)
        best, loads, count = None, [], 0
        for rep in range(repeats):
            loads.append(os.getloadavg()[0])
            torch.manual_seed(rep)
            t0 = time.perf_counter()
            with torch.no_grad():
                gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                     top_k=0, max_new_tokens=sp.max_new_tokens, eos_token_id=sorted(stop) or None,
                                     pad_token_id=pad)
            dt = time.perf_counter() - t0
            loads.append(os.getloadavg()[0])
            count = 0
            for row in gen[:, width:].tolist():
                for t in row:
                    count += 1
                    if t in stop:
                        break
            if best is None or count / dt > best[0] / best[1]:
                best = (count, dt)
    _write(Path(out), json.dumps({"tokens": best[0], "seconds": best[1], "tokens_per_s": best[0] / best[1],
                                     "rows": len(rows), "max_new_tokens": sp.max_new_tokens, "repeats": repeats,
                                     "dtype": str(dtype).removeprefix("torch."), "peak_rss_gb": _peak_rss_gb(),
                                     "load": [min(loads), max(loads)], "threads": _threads()}))


def _child_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m miles_lp.bench.rl_step")
    p.add_argument("kind", choices=("arm", "generate"))
    p.add_argument("recipe")
    p.add_argument("out")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--set", action="append", default=[], dest="overrides")
    a = p.parse_args(argv)
    if a.threads is not None:
        import torch

        torch.set_num_threads(a.threads)
    if a.kind == "arm":
        child_arm(a.recipe, a.out, a.warmup, a.steps, a.overrides)
    else:
        child_generate(a.recipe, a.out, max(1, a.warmup + a.steps), a.overrides)


if __name__ == "__main__":
    _child_main()
