"""Seed 000's matching experiment (its Table 2) on any recipe: one set of weights that never changes (learning
rate 0: no optimizer step is taken at all), the same prompts at every step and in every arm, and five
learner/sampler pairings; ``rollout_corr/kl`` per arm with paired bootstrap intervals over prompts and the
percentage change against the BF16-sampler arm.

Arms (the learner is the recipe's ``precision:`` except in the first):

- ``bf16/bf16``: BF16 learner, BF16 sampler (the floor);
- ``shared grid``: the sampler receives the learner's own forward grid (no ``sampler_precision``);
- ``partial (gate_up bf16)``: the sampler re-quantizes with the learner's rules but leaves ``gate_proj`` /
  ``up_proj`` BF16 (seed 000's F2: vLLM's exclusion bug left every gate_up_proj BF16);
- ``bf16 sampler``: the sampler receives the BF16 master weights;
- ``different grid``: the sampler re-quantizes the BF16 master weights with 128x128 FP32 block scales
  (``fp8_block``). The reference engine has no FP8 block GEMM, so those weights are rounded to that grid and
  served as BF16 (``miles_lp.launch.sampler``): the weight grid of a W8A16 sampler, no activation
  quantization. Say so when quoting it.

The arms are built with the launch package's own pieces (``Run``: tiny model, plan, learner, converted engine
checkpoint, ``SamplerView`` / ``SyncVia``, the initial full sync), so each arm is exactly what
``miles-lp run`` with that ``sampler_precision`` would start from.

Per prompt ``p`` (pooled over steps and its group of samples) the sums of ``d = lp_rollout - lp_train``
(k1), of verl's k3 ``rho - log rho - 1`` (``log rho = lp_train - lp_rollout``), of ``|d|`` and the token count
are kept; an arm's figure is ``sum d / sum tokens`` (verl's token mean), and each bootstrap resample draws
prompts with replacement, the same draw for every arm (paired).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from miles_lp.errors import ConfigError

ARMS = ("bf16/bf16", "shared grid", "partial (gate_up bf16)", "bf16 sampler", "different grid")
REFERENCE_ARM = "bf16 sampler"
#: seed 000's order, lowest KL first
SEED000_ORDER = ("bf16/bf16", "shared grid", "partial (gate_up bf16)", "bf16 sampler", "different grid")
GATE_UP = ["*.mlp.gate_proj", "*.mlp.up_proj", "*.gate_up_proj"]


def _policy_dict(policy) -> dict[str, Any]:
    return json.loads(json.dumps(policy.to_dict()))


def _swap_format(d: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    d = dict(d)
    if d.get("default") == old:
        d["default"] = new
    d["rules"] = [dict(r, format=new) if r.get("format") == old else dict(r) for r in d.get("rules", [])]
    return d


def arm_overrides(arm: str, learner_policy: dict[str, Any]) -> list[str]:
    """``--set`` overrides turning the recipe into one arm (values are YAML flow, validated by the recipe)."""
    def yaml_flow(x) -> str:
        return json.dumps(x)  # JSON is YAML

    audit = ["sync.checks.layer_audit=warn", "sync.checks.self_check=warn", "sync.checks.sentinel=warn"]
    if arm == "bf16/bf16":
        return ["precision=" + yaml_flow({"default": "bf16"}), "sampler_precision=null"]
    if arm == "shared grid":
        return ["sampler_precision=null"]
    if arm == "bf16 sampler":
        return ["sampler_precision=" + yaml_flow({"default": "bf16"})] + audit
    if arm == "partial (gate_up bf16)":
        d = dict(learner_policy)
        d["rules"] = [{"match": GATE_UP, "format": "bf16"}] + list(d.get("rules", []))
        return ["sampler_precision=" + yaml_flow(d)] + audit
    if arm == "different grid":
        d = _swap_format(learner_policy, "mxfp8", "fp8_block")
        d.pop("backward", None)
        d["rules"] = [{k: v for k, v in r.items() if k != "backward"} for r in d["rules"]]
        return ["sampler_precision=" + yaml_flow(d)] + audit
    raise ConfigError(f"--arms: unknown arm '{arm}'; arms are {', '.join(ARMS)}")


@dataclasses.dataclass
class ArmResult:
    name: str
    sum_d: np.ndarray      # per prompt: sum of lp_rollout - lp_train over its sampled tokens (all steps)
    sum_k3: np.ndarray
    sum_abs: np.ndarray
    tokens: np.ndarray
    seconds: float
    model_sha: str

    @property
    def kl(self) -> float:
        return float(self.sum_d.sum() / self.tokens.sum())

    @property
    def k3(self) -> float:
        return float(self.sum_k3.sum() / self.tokens.sum())

    @property
    def abs_diff(self) -> float:
        return float(self.sum_abs.sum() / self.tokens.sum())


def _file_sha(model_dir: Path) -> str:
    """The model's identity: its weight files (``select_weight_files``: a stray ``*.safetensors`` beside them is
    not part of the model, so it does not change the hash)."""
    from miles_lp.io.safetensors_io import select_weight_files

    h = hashlib.sha256()
    for f in sorted(select_weight_files(model_dir)[0]):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def run_arm(recipe_path: str, arm: str, sets: Sequence[str], steps: int, prompts: int | None, workdir: Path,
            seed: int = 0) -> ArmResult:
    """Build one arm with the launch package's ``Run`` and measure it for ``steps`` steps at fixed weights."""
    import torch

    from miles_lp.launch.recipe import load_recipe
    from miles_lp.launch.run_dir import RunDir
    from miles_lp.launch.runner import Run
    from miles_lp.rl.batch import make_sample, response_rows
    from miles_lp.rl.step import step_seed

    base = load_recipe(recipe_path, list(sets))
    recipe = load_recipe(recipe_path, list(sets) + arm_overrides(arm, _policy_dict(base.precision))
                         + ["rl.kl_coef=0"])
    t0 = time.perf_counter()
    safe = "".join(ch if ch.isalnum() else "_" for ch in arm)
    run = Run(recipe, RunDir.create(workdir, safe))
    try:
        n = prompts or recipe.rl.prompts_per_step
        fixed = run.task.prompts(0, n)  # the same prompts at every step (and in every arm)
        g = recipe.rl.group_size
        inputs = [list(p.ids) for p in fixed for _ in range(g)]
        acc = np.zeros((4, n))
        for step in range(steps):
            gens = run.engine.generate(inputs, dataclasses.replace(run.parts.sampling, seed=step_seed(seed, step)))
            batch = [make_sample(inputs[i], x.output_ids, x.logprobs, i) for i, x in enumerate(gens)]
            full, _ = run.learner.logprobs([s["tokens"] for s in batch])
            for s, lt in zip(batch, response_rows(full, batch), strict=True):
                lr = s["rollout_logprobs"].double()
                lt = lt.double()
                if not (torch.isfinite(lr).all() and torch.isfinite(lt).all()):
                    raise ConfigError(f"arm {arm}, step {step}: non-finite log-probs in sample {s['index']}")
                d = lr - lt
                log_rho = -d
                p = s["index"] // g
                acc[0, p] += float(d.sum())
                acc[1, p] += float((log_rho.exp() - log_rho - 1).sum())
                acc[2, p] += float(d.abs().sum())
                acc[3, p] += s["n"]
        sha = _file_sha(run.model_dir)
    finally:
        run.close()
    return ArmResult(arm, acc[0], acc[1], acc[2], acc[3], time.perf_counter() - t0, sha)


#: metric name in the table -> the per-prompt sum it is the token mean of
METRIC_SUMS = {"kl": "sum_d", "k3_kl": "sum_k3", "logprob_abs_diff_mean": "sum_abs"}


def paired_bootstrap(results: Sequence[ArmResult], reference: str, resamples: int = 10_000, seed: int = 0,
                     level: float = 0.95) -> dict[str, dict[str, Any]]:
    """Per arm: kl with its interval, and the % change against ``reference`` with its interval; every resample
    draws the same prompts (with replacement) for all arms."""
    n = len(results[0].tokens)
    if any(len(r.tokens) != n for r in results):
        raise ConfigError("arms measured different prompt sets; run them with the same recipe and --prompts")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    q = [(1 - level) / 2, (1 + level) / 2]

    def boot(x, tok):
        return x[idx].sum(1) / tok[idx].sum(1)

    by = {r.name: r for r in results}
    ref = by.get(reference)
    out = {}
    for r in results:
        row: dict[str, Any] = {"tokens": int(r.tokens.sum()), "prompts": n, "seconds": r.seconds,
                               "model_sha": r.model_sha}
        for metric, attr in METRIC_SUMS.items():
            b = boot(getattr(r, attr), r.tokens)
            row[metric] = float(getattr(r, attr).sum() / r.tokens.sum())
            row[f"{metric}_ci"] = [float(v) for v in np.quantile(b, q)]
            if ref is None or r.name == reference:
                continue
            rb = boot(getattr(ref, attr), ref.tokens)
            base = float(getattr(ref, attr).sum() / ref.tokens.sum())
            rlo, rhi = np.quantile(rb, q)
            # a % change is meaningful only when the reference figure is clearly away from 0
            if rlo > 0 or rhi < 0:
                pct = 100.0 * (b / rb - 1.0)
                row[f"{metric}_pct_vs_ref"] = 100.0 * (row[metric] / base - 1.0)
                row[f"{metric}_pct_vs_ref_ci"] = [float(v) for v in np.quantile(pct, q)]
            else:
                row[f"{metric}_pct_vs_ref"] = None
                row[f"{metric}_pct_vs_ref_note"] = (f"the {reference} arm's {metric} interval contains 0: no % change")
            row[f"{metric}_p_below_ref"] = float((b < rb).mean())  # paired share of resamples
        out[r.name] = row
    return out


def order_verdict(table: dict[str, dict[str, Any]], results: Sequence[ArmResult], resamples: int,
                  seed: int = 0, metric: str = "kl") -> dict[str, Any]:
    """Does seed 000's order hold for ``metric``? Point estimates, and per adjacent pair the share of paired
    resamples in which the lower arm's figure is below the higher one's."""
    arms = [a for a in SEED000_ORDER if a in table]
    by = {r.name: r for r in results}
    n = len(results[0].tokens)
    idx = np.random.default_rng(seed + 1).integers(0, n, size=(resamples, n))
    attr = METRIC_SUMS[metric]
    pairs = []
    for a, b in zip(arms, arms[1:], strict=False):
        ba = getattr(by[a], attr)[idx].sum(1) / by[a].tokens[idx].sum(1)
        bb = getattr(by[b], attr)[idx].sum(1) / by[b].tokens[idx].sum(1)
        pairs.append({"lower": a, "higher": b, "holds": bool(table[a][metric] < table[b][metric]),
                      "share_of_resamples": float((ba < bb).mean())})
    observed = sorted(arms, key=lambda k: table[k][metric])
    return {"metric": metric, "seed000_order": arms, "observed_order": observed, "holds": observed == arms,
            "pairs": pairs}


def _pct(r: dict[str, Any], metric: str) -> tuple[str, str]:
    v = r.get(f"{metric}_pct_vs_ref")
    if v is None:
        return ("n/a" if f"{metric}_pct_vs_ref_note" in r else "-"), "-"
    lo, hi = r[f"{metric}_pct_vs_ref_ci"]
    f = ".4f" if max(abs(v), abs(lo), abs(hi)) >= 99.95 else ".1f"  # -99.9996% must not print as -100.0%
    return f"{v:+{f}}%", f"{lo:+{f}}% .. {hi:+{f}}%"


def markdown(table: dict[str, dict[str, Any]], verdicts: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"Matching experiment: {meta['recipe']} {' '.join(meta.get('sets', []))}, {meta['steps']} steps x "
             f"{meta['prompts']} prompts x {meta['group_size']} samples per arm at fixed weights (the same prompts "
             f"every step and arm), {meta['policy_state']}. 95% intervals from {meta['resamples']:,} bootstrap "
             "resamples of prompts, paired across arms. `rollout_corr/kl` is verl's k1 token mean of "
             "lp_rollout - lp_train; `k3_kl` estimates the same KL(rollout || train) with far lower variance.", "",
             "| arm | rollout_corr/kl | 95% CI | vs bf16 sampler | 95% CI | k3_kl | 95% CI | vs bf16 sampler | "
             "95% CI | mean abs dlogprob | tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in table.items():
        p1, c1 = _pct(r, "kl")
        p3, c3 = _pct(r, "k3_kl")
        lines.append(f"| {arm} | {r['kl']:.3e} | {r['kl_ci'][0]:.2e} .. {r['kl_ci'][1]:.2e} | {p1} | {c1} | "
                     f"{r['k3_kl']:.3e} | {r['k3_kl_ci'][0]:.2e} .. {r['k3_kl_ci'][1]:.2e} | {p3} | {c3} | "
                     f"{r['logprob_abs_diff_mean']:.2e} | {r['tokens']} |")
    notes = sorted({r[k] for r in table.values() for k in r if k.endswith("_pct_vs_ref_note")})
    lines += [f"\nn/a: {n}." for n in notes]
    for verdict in verdicts:
        lines += ["", f"Seed 000's order on `{verdict['metric']}` ({' < '.join(verdict['seed000_order'])}): "
                  f"{'holds' if verdict['holds'] else 'does NOT hold'} here; observed "
                  f"{' < '.join(verdict['observed_order'])}."]
        for p in verdict["pairs"]:
            lines.append(f"- {p['lower']} < {p['higher']}: {'yes' if p['holds'] else 'no'} "
                         f"(in {p['share_of_resamples']:.1%} of paired resamples)")
    return "\n".join(lines) + "\n"


def figure(table: dict[str, dict[str, Any]]):
    """One bar per arm with its interval as an error bar: ``rollout_corr/kl`` (k1) on the first axes, ``k3_kl``
    on the second (log scale); bar labels are the arm names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(table)
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for ax, metric, title in ((axes[0], "kl", "rollout_corr/kl (k1)"), (axes[1], "k3_kl", "k3_kl")):
        v = [table[a][metric] for a in arms]
        lo = [max(0.0, table[a][metric] - table[a][f"{metric}_ci"][0]) for a in arms]
        hi = [max(0.0, table[a][f"{metric}_ci"][1] - table[a][metric]) for a in arms]
        ax.bar(range(len(arms)), v, yerr=[lo, hi], capsize=4, color=[f"C{i}" for i in range(len(arms))])
        ax.set_xticks(range(len(arms)), arms, rotation=15, fontsize=8)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_title(title)
        if metric == "k3_kl" and all(x > 0 for x in v):
            ax.set_yscale("log")
            # bars start at 0, which a log axis would place decades below the data
            low = min(x for a in arms for x in (table[a][metric], table[a][f"{metric}_ci"][0]) if x > 0)
            ax.set_ylim(bottom=low / 3)
    axes[0].set_ylabel("token mean, 95% paired-bootstrap CI")
    fig.suptitle("sampler matching at fixed weights, same prompts")
    fig.tight_layout()
    return fig


def main(args) -> int:
    from miles_lp.launch.recipe import load_recipe

    arms = ARMS if not args.arms else tuple(a.strip() for a in args.arms.split(","))
    for a in arms:
        if a not in ARMS:
            raise ConfigError(f"--arms: unknown arm '{a}'; arms are {', '.join(ARMS)}")
    if args.steps < 1 or args.resamples < 100:
        raise ConfigError(f"--steps {args.steps} must be >= 1 and --resamples {args.resamples} >= 100")
    base = load_recipe(args.recipe, list(args.set))  # validated before anything is built
    from miles_lp.formats.spec import Format

    if base.precision.default is not Format.MXFP8 and not any(r.format is Format.MXFP8 for r in base.precision.rules):
        raise ConfigError(f"{args.recipe}: the matching experiment compares samplers against an MXFP8 learner; "
                          "the recipe's precision: has no mxfp8 (use e.g. recipes/tiny-mxfp8.yaml)")
    tmp = None
    if args.workdir:
        work = Path(args.workdir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="miles-lp-matching-")
        work = Path(tmp.name)
    try:
        results = []
        for a in arms:
            print(f"arm {a} ...", flush=True)
            r = run_arm(args.recipe, a, args.set, args.steps, args.prompts, work, args.seed)
            print(f"  rollout_corr/kl {r.kl:.3e} over {int(r.tokens.sum())} tokens ({r.seconds:.0f} s)", flush=True)
            results.append(r)
    finally:
        if tmp is not None:
            tmp.cleanup()
    if len({r.model_sha for r in results}) != 1:
        raise ConfigError("the arms started from different model weights; this comparison needs one checkpoint")
    table = paired_bootstrap(results, REFERENCE_ARM, args.resamples, args.seed)
    verdicts = [order_verdict(table, results, args.resamples, args.seed, m) for m in ("kl", "k3_kl")]
    meta = {"recipe": args.recipe, "sets": list(args.set), "steps": args.steps,
            "prompts": len(results[0].tokens), "group_size": base.rl.group_size, "resamples": args.resamples,
            "policy_state": "untrained policy (the recipe's freshly initialised model), temperature "
                            f"{base.rollout.sampling.temperature:g}" if base.model.is_tiny else
                            f"the checkpoint {base.model.path}"}
    md = markdown(table, verdicts, meta)
    print()
    print(md)
    if args.out:
        import matplotlib.pyplot as plt

        from miles_lp.report.plots import save

        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        for name, text in (("matching.json", json.dumps({"meta": meta, "arms": table, "order": verdicts, "per_prompt": {
                               r.name: {"sum_d": r.sum_d.tolist(), "sum_k3": r.sum_k3.tolist(),
                                        "sum_abs": r.sum_abs.tolist(), "tokens": r.tokens.tolist()}
                               for r in results}}, indent=1)),
                           ("matching.md", md)):
            t = d / f".{name}.tmp"
            t.write_text(text)
            t.replace(d / name)
        fig = figure(table)
        save(fig, d / "matching.png")
        plt.close(fig)
        print(f"wrote {d}/matching.json, matching.md, matching.png")
    return 0 if all(math.isfinite(r["kl"]) for r in table.values()) else 1
