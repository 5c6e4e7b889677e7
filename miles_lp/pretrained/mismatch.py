"""Where the learner and the engine part ways, per layer: the measurement behind docs/pretrained.md's KL section.

    python -m miles_lp.pretrained.mismatch recipes/smollm2-mxfp8.yaml --steps 3 --out mxfp8.json

Builds the recipe's learner, engine and sync as ``miles-lp run`` does (initial sync and checks included), samples
``--prompts`` responses from the engine, then ``--steps`` times: an optimizer step of the learner (NLL on those
responses: a sharpening update like a GRPO step on positive advantages) and a sync. Before the first step and
after each sync it compares, on the very same token sequences:

* the log-probs of the response tokens: the learner's (``logprobs``) against the engine's teacher-forced ``score``
  (``k1`` = mean(engine - learner), what ``rollout_corr/kl`` reports; mean and max |diff|);
* every decoder layer's output hidden state (forward hooks on both models; relative L2 difference);
* the tensors the learner computes with against the engine's live tensors (max |diff| per kind: quantized
  weights compare as the grid the learner exports; the rest as the learner's compute parameter);
* ablation: the learner re-run with its non-quantized tensors (norms, embeddings) rounded to the engine's dtype.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence

import torch

from miles_lp.errors import MilesLPError
from miles_lp.pretrained.output import print_json


def _decoder_layers(model) -> Sequence[torch.nn.Module]:
    return model.model.layers


def _layer_outputs(model, run) -> list[torch.Tensor]:
    """Each decoder layer's output hidden state [T, H] (fp32) while ``run()`` runs ``model``."""
    outs: list[torch.Tensor] = []

    def hook(_m, _inp, out):
        h = out[0] if isinstance(out, tuple) else out
        outs.append(h.detach().float().reshape(-1, h.shape[-1]).clone())
    handles = [m.register_forward_hook(hook) for m in _decoder_layers(model)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return outs


def per_layer(learner, engine, seq: list[int]) -> list[float]:
    """Relative L2 difference of each decoder layer's output, learner vs engine, on one sequence."""
    n = len(seq)
    lo = _layer_outputs(learner.model, lambda: learner.logprobs([torch.tensor(seq)]))
    eo = _layer_outputs(engine.model, lambda: engine.score([seq]))
    return [float((a[:n] - b[:n]).norm() / b[:n].norm().clamp_min(1e-30)) for a, b in zip(lo, eo, strict=True)]


def logprob_gap(learner, engine, samples: Sequence[dict]) -> dict[str, float]:
    seqs = [s["tokens"] for s in samples]
    lp_l, _ = learner.logprobs(seqs)
    lp_e = engine.score([s.tolist() for s in seqs])
    d = torch.cat([(e - lr)[s["start"]:s["start"] + s["n"]] for lr, e, s in zip(lp_l, lp_e, samples, strict=True)])
    roll = torch.cat([s["rollout_logprobs"] - e[s["start"]:s["start"] + s["n"]] for e, s in
                      zip(lp_e, samples, strict=True)])
    return {"k1": float(d.mean()), "mean_abs": float(d.abs().mean()), "max_abs": float(d.abs().max()),
            "decode_vs_prefill_max_abs": float(roll.abs().max())}


def weight_gap(learner, engine) -> dict[str, float]:
    """Max |learner - engine| per kind of tensor (the learner's compute tensors; quantized: its exported grid)."""
    out: dict[str, float] = {}
    learner_tensors = dict(learner.export_weights())
    live = engine.read_weights(list(learner_tensors))
    params = dict(learner.model.named_parameters())
    for name, exported in learner_tensors.items():
        kind = "quantized" if not isinstance(exported, torch.Tensor) else (
            "norm" if "norm" in name else "embedding" if "embed" in name else "other")
        eng = live[name]
        if kind == "quantized":
            gap = float((exported.data.float() - eng.float()).abs().max()) if hasattr(exported, "data") else 0.0
        else:
            mine = params.get(name, exported)
            gap = float((mine.detach().float() - eng.float()).abs().max())
        out[kind] = max(out.get(kind, 0.0), gap)
    return out


def measure(learner, engine, samples) -> dict:
    res = logprob_gap(learner, engine, samples)
    res["weights_max_abs"] = weight_gap(learner, engine)
    return res


def rounded_rest(learner, dtype: torch.dtype):
    """Context: the learner's non-quantized parameters rounded to ``dtype`` (restored on exit)."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        from miles_lp.train.quant_linear import QuantLinear

        quantized = {id(m.weight) for m in learner.model.modules() if isinstance(m, QuantLinear)}
        saved = []
        with torch.no_grad():
            for p in learner.model.parameters():
                if id(p) not in quantized and p.dtype != dtype:
                    saved.append((p, p.detach().clone()))
                    p.copy_(p.to(dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, old in saved:
                    p.copy_(old)
    return ctx()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles_lp.pretrained.mismatch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from miles_lp.launch.recipe import load_recipe
    from miles_lp.launch.runner import Run
    from miles_lp.rl.batch import make_sample
    from miles_lp.train.embedded import nll_loss

    try:
        tmp = tempfile.mkdtemp(prefix="miles-lp-mismatch-")
        recipe = load_recipe(args.recipe, [*args.overrides, f"logging.output_dir={tmp}", "logging.progress=false"])
        run = Run.start(recipe, run_name="probe")
        learner, engine = run.learner, run.engine
        prompts = run.task.prompts(0, args.prompts)
        gens = engine.generate([list(q.ids) for q in prompts], run.parts.sampling)
        samples = [make_sample(list(q.ids), g.output_ids, g.logprobs, i) for i, (q, g) in
                   enumerate(zip(prompts, gens, strict=True))]
        seq = samples[0]["tokens"].tolist()
        steps = [measure(learner, engine, samples)]
        per_layer_0 = per_layer(learner, engine, seq)
        for _ in range(args.steps):
            learner.train_step(samples, nll_loss)
            run.sync.sync(learner)
            steps.append(measure(learner, engine, samples))
        result = {"recipe": args.recipe, "overrides": args.overrides, "train_dtype": str(recipe.train.compute_dtype),
                  "engine_dtype": str(engine.act_dtype), "kv_cache": engine.kv_cache, "steps": steps,
                  "per_layer_rel_l2_step0": per_layer_0, "per_layer_rel_l2": per_layer(learner, engine, seq)}
        learner_dtype = next(learner.model.parameters()).dtype
        if learner_dtype != torch.bfloat16:
            with rounded_rest(learner, torch.bfloat16):
                result["ablation_rest_rounded_bf16"] = logprob_gap(learner, engine, samples)
                result["ablation_rest_rounded_bf16_per_layer"] = per_layer(learner, engine, seq)
        run.close()
    except MilesLPError as exc:
        print(f"mismatch: error: {exc}", file=sys.stderr)
        return 2
    print_json(result, args.out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def plot(results: dict[str, dict], png: str) -> None:
    """Per-layer relative L2 difference (learner vs engine) of each named result, and its ablation if present."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, res in results.items():
        ys = res["per_layer_rel_l2"]
        ax.semilogy(range(len(ys)), [max(y, 1e-12) for y in ys], marker=".", label=name)
        if "ablation_rest_rounded_bf16_per_layer" in res:
            ys = res["ablation_rest_rounded_bf16_per_layer"]
            ax.semilogy(range(len(ys)), [max(y, 1e-12) for y in ys], ls="--", label=f"{name}, rest rounded to bf16")
        steps = res["steps"]
        bx.semilogy(range(len(steps)), [max(abs(s["k1"]), 1e-12) for s in steps], marker="o", label=f"{name} |k1|")
        bx.semilogy(range(len(steps)), [max(s["max_abs"], 1e-12) for s in steps], ls=":", marker="x",
                    label=f"{name} max |dlogp|")
    ax.set(xlabel="decoder layer", ylabel="rel. L2 diff of the layer output", title="learner vs engine, same tokens")
    bx.set(xlabel="optimizer steps + syncs", ylabel="response log-prob gap", title="engine - learner")
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
