"""``miles-lp selftest sync``: a healthy sync on the embedded stack, then each known silent failure injected,
with the check that caught it, its figure and the KL the fault produced.

The stack: a tiny random HF model (``make_tiny_model``), converted by ``convert_checkpoint`` with the recipe's
policy (the sampler's checkpoint, what ``miles-lp convert`` writes), served by the reference engine; the
learner is the embedded trainer on the same HF model and plan, moved away from the checkpoint by a few AdamW
steps (so a sync is a real change and stale state is visible). Every fault comes through an explicit hook:
the engine's ``EngineFaults``, a checkpoint converted with a modified policy (the sampler's rule), a transport
or learner wrapper (``miles_lp.sync.faults``). Each fault runs twice on a fresh engine: in ``raise`` mode
(the intended check must be among those that raise; a ``grid`` fault also once with ``full_compare: off``, so
the per-sync group digest must catch it too, not only the first sync's full byte compare) and in ``warn`` mode, after which the KL of the engine's
generations against the learner is measured (``rollout_corr/kl``, what a divergence alarm sees).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from miles_lp.errors import ConfigError
from miles_lp.formats.schemes import scheme_for
from miles_lp.sync.config import SyncConfig
from miles_lp.sync.sentinel import rollout_kl
from miles_lp.sync.verdict import SyncCheckError, SyncError
from miles_lp.sync.weight_sync import SyncReport, WeightSync

DEFAULT_RECIPES = {"moe": "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml", "dense": "policies/qwen3-mxfp8.yaml"}


@dataclasses.dataclass
class Row:
    fault: str
    intended: str
    caught_by: list[str]
    figure: float | None
    kl: float
    verdict: str  # "clean" | "CAUGHT" | "MISSED" | "FLAGGED" | "N/A"
    detail: str = ""
    kl_se: float = float("nan")  # standard error of ``kl`` over the sampled tokens

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Fault:
    name: str
    intended: str
    engine_faults: dict[str, Any] = dataclasses.field(default_factory=dict)
    sampler_rules: list[dict] | None = None  # rules prepended to the sampler's policy
    sampler_policy: Callable[[dict], dict] | None = None  # rewrite of the sampler's policy mapping
    transport: str | None = None  # "drop_last" | "skip_scales"
    engine_wrap: str | None = None  # "block128" | "floor" | "pow2"
    learner_wrap: str | None = None  # "split_scales"
    # "nvfp4_groups" | "experts" | "mxfp8" | "fp8_block_fp32_scales": N/A when the model/recipe has none
    needs: str | None = None


def _drop_layer_rules(policy: dict) -> dict:
    p = copy.deepcopy(policy)
    p["rules"] = [r for r in p.get("rules", []) if "layers" not in r]
    if len(p["rules"]) == len(policy.get("rules", [])):  # the learner keeps no BF16 layers: the sampler does
        p["rules"] = [{"layers": "first 1", "format": "bf16"}, *p["rules"]]
    return p


DENSE = "<first quantized dense weight>"  # resolved per model (q_proj, MLA's q_a_proj, ...; else any quantized)

FAULTS: list[Fault] = [
    Fault("lm_head quantized on the sampler", "layer_audit", engine_faults={"quantize_lm_head": True}),
    # A rule meant for the router ("gate") that matches the fused gate_up_proj by substring (seed 000, F2): a
    # dense MLP keeps gate and up BF16; a fused MoE layer (one FusedMoE: every expert one format) keeps all.
    Fault("router rule matches gate_up_proj by substring", "layer_audit",
          sampler_rules=[{"match": r"re:.*\.(mlp|block_sparse_moe)\.(experts\..*|gate_proj|up_proj)",
                          "format": "bf16"}]),
    Fault("first/last BF16 layers disagree", "layer_audit", sampler_policy=_drop_layer_rules),
    Fault("stale derived layout (finish without rebuild)", "self_check",
          engine_faults={"skip_rebuild": ("*",)}),
    Fault("stale expert layout only", "self_check", engine_faults={"skip_rebuild": ("*.experts.*",)},
          needs="experts"),
    Fault("re-bound parameter", "storage", engine_faults={"rebind": (DENSE,)}),
    Fault("dropped last bucket", "completeness", transport="drop_last"),
    Fault("missing scales (unwritten staging)", "completeness", transport="skip_scales"),
    Fault("engine loader skips names", "grid",
          engine_faults={"drop_updates": ("*.mlp.*down_proj.weight", "*.experts.*.w2.weight")}),
    Fault("different grid: 128x128 FP32-scale blocks", "grid", engine_wrap="block128", needs="mxfp8"),
    Fault("different grid: sampler re-quantizes BF16 (floor scales)", "grid", engine_wrap="floor", needs="mxfp8"),
    Fault("NVFP4 gate/up with separate global scales", "grid", learner_wrap="split_scales", needs="nvfp4_groups"),
    Fault("different grid: FP8 block scales rounded to powers of two", "grid", engine_wrap="pow2",
          needs="fp8_block_fp32_scales"),
]


SELFTEST_MARKER = ".miles-lp-selftest"  # in WORKDIR/hf: the folder is the selftest's own, safe to rebuild


class Stack:
    """The tiny model, its plan and converted checkpoints (cached per sampler policy), and the learner."""

    def __init__(self, arch: str, recipe: str | None, workdir: Path, *, target: str = "sglang", seed: int = 0,
                 num_layers: int = 4, train_steps: int = 2, lr: float = 5e-3, log: Callable[[str], None] = print,
                 device: str = "cpu"):
        from miles_lp.checkpoint.tiny import make_tiny_model
        from miles_lp.config import load_yaml

        self.arch, self.target, self.log, self.workdir = arch, target, log, Path(workdir)
        self.device = device  # the learner, the engine and the staging buffer (cuda: the kernels' paths)
        hf = self.workdir / "hf"
        marker = hf / SELFTEST_MARKER
        if hf.exists() and not marker.is_file() and any(hf.iterdir()):  # not ours: never write into it
            from miles_lp.errors import ConfigError

            raise ConfigError(f"--workdir {self.workdir}: {hf} exists and was not made by selftest sync (no "
                              f"{SELFTEST_MARKER}); the selftest builds its tiny model there: name an empty or new "
                              "--workdir, or one an earlier selftest used")
        self.hf = make_tiny_model(arch, hf, seed=seed, num_layers=num_layers)
        marker.write_text("made by miles-lp selftest sync: its tiny model, rebuilt by every run in this --workdir\n")
        cfg = _read_json(self.hf / "config.json")
        moe = any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts"))
        self.recipe = Path(recipe) if recipe else _recipes_dir() / DEFAULT_RECIPES["moe" if moe else "dense"]
        doc = load_yaml(self.recipe)
        self.policy_map = doc.data["precision"]
        self._ckpts: dict[str, Path] = {}
        self.plan = self._plan(self.policy_map)
        self.learner = self._learner(train_steps, lr, seed)
        # the learner at the checkpoint's own weights: the reference for a sampler whose update was refused
        self.learner0 = self._learner(0, lr, seed)
        quantized = self.plan.quantized()
        self.has_experts = any(".experts." in n for n in quantized)  # quantized experts (derived expert state)
        self.has_mxfp8 = any(e.format.value == "mxfp8" for e in quantized.values())
        # fp8_block entries with fp32 scales: of a format whose scales may be powers of two, not rounded so
        self.has_fp8_block_fp32_scales = any(scheme_for(e.format).pow2_scales and not e.pow2_scales
                                             for e in quantized.values())
        # NVFP4 groups: every member of a format with one global scale shared by fused siblings
        self.has_nvfp4_groups = any(all(scheme_for(self.plan.entries[m].format).joint_global_scale for m in g)
                                    for g in self.plan.groups.values())

    def _policy(self, mapping: dict):
        from miles_lp.config import Where
        from miles_lp.policy import parse_policy

        return parse_policy(mapping, Where(str(self.recipe), "precision"))

    def _plan(self, mapping: dict):
        from miles_lp.train.embedded import plan_for_model

        return plan_for_model(self._policy(mapping), self.hf)

    def _learner(self, steps: int, lr: float, seed: int):
        from miles_lp.train.config import TrainConfig
        from miles_lp.train.embedded import EmbeddedTrainer

        learner = EmbeddedTrainer(self.hf, self.plan, TrainConfig(lr=lr, seed=seed, device=self.device))
        g = torch.Generator().manual_seed(seed)
        vocab = int(_read_json(self.hf / "config.json")["vocab_size"])
        for _ in range(steps):  # move the learner off the checkpoint the sampler starts from
            samples = [{"tokens": torch.randint(0, vocab, (24,), generator=g)} for _ in range(4)]
            learner.train_step(samples)
        return learner

    def checkpoint(self, mapping: dict | None = None) -> Path:
        from miles_lp.checkpoint.convert import convert_checkpoint

        mapping = self.policy_map if mapping is None else mapping
        key = repr(mapping)
        if key not in self._ckpts:
            out = self.workdir / f"ckpt{len(self._ckpts)}"
            # overwrite: the folder is this selftest's own (a --workdir reused from an earlier run holds one
            # converted from an hf model rebuilt since)
            convert_checkpoint(self.hf, out, self._policy(mapping), target=self.target, overwrite=True,
                               progress=False, log=lambda s: None)
            self._ckpts[key] = out
        return self._ckpts[key]


def _read_json(p: Path) -> dict:
    import json

    return json.loads(Path(p).read_text())


def _recipes_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "recipes"


def measure_kl(engine: Any, learner: Any, prompts: list[list[int]], max_new_tokens: int, seed: int = 0
               ) -> tuple[float, float]:
    """``rollout_corr/kl`` of the engine's sampled tokens against the learner, and its standard error over
    tokens (NaN if any log-prob is not finite): a fault's KL within a few standard errors of the healthy one is
    one a divergence alarm cannot see."""
    from miles_lp.rollout.engine import SamplingParams

    gens = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed))
    seqs = [torch.tensor(list(p) + list(g.output_ids)) for p, g in zip(prompts, gens, strict=True)]
    lps, _ = learner.logprobs(seqs)
    train = [lp[len(p) - 1:] for lp, p in zip(lps, prompts, strict=True)]
    rollout = [g.logprobs for g in gens]
    if any(not bool(torch.isfinite(r).all()) for r in rollout):
        return float("nan"), float("nan")
    d = torch.cat([(r.double() - t.double()).reshape(-1) for r, t in zip(rollout, train, strict=True)])
    se = float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else float("nan")
    return rollout_kl(rollout, train), se


class SelfTest:
    def __init__(self, stack: Stack, *, bucket_mb: float = 0.25, prompts: int = 8, max_new_tokens: int = 16,
                 off: tuple[str, ...] = (), log: Callable[[str], None] = print):
        self.stack, self.bucket_mb, self.log = stack, bucket_mb, log
        self.off = tuple(off)  # checks turned off (to show that the table then reports the fault MISSED)
        vocab = int(_read_json(stack.hf / "config.json")["vocab_size"])
        g = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(0, vocab, (6,), generator=g).tolist() for _ in range(prompts)]
        self.max_new_tokens = max_new_tokens

    # ---- building one side of a fault ----------------------------------------------------------------
    def _sampler_policy(self, fault: Fault | None) -> dict:
        mapping = self.stack.policy_map
        if fault is not None and fault.sampler_rules:
            mapping = {**mapping, "rules": [*fault.sampler_rules, *mapping.get("rules", [])]}
        if fault is not None and fault.sampler_policy:
            mapping = fault.sampler_policy(mapping)
        return mapping

    def _engine(self, fault: Fault | None):
        from miles_lp.rollout.reference import EngineFaults, ReferenceEngine
        from miles_lp.sync.faults import RegridEngine

        mapping = self._sampler_policy(fault)
        hooks = dict(fault.engine_faults) if fault else {}
        quantized = list(self.stack.plan.quantized())
        dense = next((n for n in quantized if ".experts." not in n), quantized[0] if quantized else DENSE)
        for key in ("rebind", "drop_updates"):  # a hook that matches nothing would be a fault never injected
            if key in hooks:
                hooks[key] = tuple(dense if p == DENSE else p for p in hooks[key])
        engine = ReferenceEngine(self.stack.checkpoint(mapping), device=self.stack.device,
                                 faults=EngineFaults(**hooks))
        names = list(engine.param_specs())
        for key in ("rebind", "drop_updates"):
            pats = hooks.get(key, ())
            if pats and not any(fnmatch.fnmatchcase(n, p) for n in names for p in pats):
                raise ConfigError(f"selftest fault '{fault.name}': engine hook {key}={pats!r} matches no tensor "
                                  f"of this {self.stack.arch} checkpoint; the fault would not be injected")
        if fault is not None and fault.engine_wrap:
            engine = RegridEngine(engine, fault.engine_wrap)
        return engine

    def _transport(self, fault: Fault | None):
        from miles_lp.sync.faults import DropLastBucket, SkipScaleBytes
        from miles_lp.sync.transport import InProcessTransport

        t = InProcessTransport(self.stack.device)
        if fault is not None and fault.transport == "drop_last":
            return DropLastBucket(t)
        if fault is not None and fault.transport == "skip_scales":  # the expert scales' staging (verl's case)
            return SkipScaleBytes(t, "*.experts.*" if self.stack.has_experts else "*")
        return t

    def _learner(self, fault: Fault | None):
        from miles_lp.sync.faults import SplitScalesLearner

        if fault is not None and fault.learner_wrap == "split_scales":
            return SplitScalesLearner(self.stack.learner)
        return self.stack.learner

    def _sync(self, fault: Fault | None, mode: str, engine=None, full_compare: str = "initial"
              ) -> tuple[Any, SyncReport | None, SyncError | None]:
        engine = engine or self._engine(fault)
        cfg = SyncConfig(bucket_mb=self.bucket_mb, full_compare=full_compare).with_modes(all=mode).with_modes(
            **{c: "off" for c in self.off})
        ws = WeightSync(engine, self.stack.plan, self.stack.target, cfg, transport=self._transport(fault), env={},
                        log=lambda line: self.log("    " + line))
        try:
            return engine, ws.initial_sync(self._learner(fault)), None
        except SyncError as exc:
            return engine, exc.report, exc

    def _kl(self, engine, learner=None) -> tuple[float, float]:
        engine.resume()
        return measure_kl(engine, learner or self.stack.learner, self.prompts, self.max_new_tokens)

    # ---- the runs -----------------------------------------------------------------------------------
    def healthy(self) -> Row:
        self.log("healthy sync (raise mode)")
        engine, report, err = self._sync(None, "raise")
        kl, se = self._kl(engine) if err is None else (float("nan"), float("nan"))
        flagged = [v.name for v in report.verdicts if v.failed] if report else ["(no report)"]
        ok = err is None and not flagged
        fig = report.verdict("self_check").figure if report else None
        detail = "" if ok else f"{type(err).__name__ if err else ''}: {err}"
        return Row("healthy sync", "-", flagged, fig, kl, "clean" if ok else "FLAGGED", detail, se)

    def fault(self, fault: Fault) -> Row:
        st = self.stack
        if (fault.needs == "experts" and not st.has_experts) or (
                fault.needs == "nvfp4_groups" and not st.has_nvfp4_groups) or (
                fault.needs == "mxfp8" and not st.has_mxfp8) or (
                fault.needs == "fp8_block_fp32_scales" and not st.has_fp8_block_fp32_scales):
            return Row(fault.name, fault.intended, [], None, float("nan"), "N/A",
                       f"the model/recipe has no {fault.needs.replace('_', ' ')}")
        if fault.sampler_rules or fault.sampler_policy:  # a sampler rule that changes nothing injects nothing
            def fmts(plan):
                return {n: e.format.value for n, e in plan.entries.items()}
            try:
                same = fmts(st._plan(self._sampler_policy(fault))) == fmts(st.plan)
            except ConfigError as exc:  # e.g. the rule leaves nothing quantized: no converted sampler to start
                return Row(fault.name, fault.intended, [], None, float("nan"), "N/A",
                           f"the sampler's policy does not compile for {st.arch}: {exc}")
            if same:
                return Row(fault.name, fault.intended, [], None, float("nan"), "N/A",
                           f"the sampler's rule changes no tensor's format on {st.arch}")
        self.log(f"fault: {fault.name} (raise mode)")
        _, _, err = self._sync(fault, "raise")
        caught = [v.name for v in err.verdicts] if isinstance(err, SyncCheckError) else []
        digest_missed = ""
        if fault.intended == "grid":  # C2 both ways: the first sync's full compare and every later sync's digest
            self.log(f"fault: {fault.name} (raise mode, per-sync digest: no full compare)")
            _, _, derr = self._sync(fault, "raise", full_compare="off")
            if not (isinstance(derr, SyncCheckError) and "grid" in [v.name for v in derr.verdicts]):
                digest_missed = "the per-sync digest (full_compare off) did not catch it; "
        self.log(f"fault: {fault.name} (warn mode, then KL)")
        engine, report, _ = self._sync(fault, "warn")
        warned = [v.name for v in report.verdicts if v.failed] if report else []
        figure = None
        for v in (report.verdicts if report else ()):
            if v.name == fault.intended:
                figure = v.figure
        # The fault's KL: of the synced engine against the learner; when the update was refused before any byte
        # (the sampler keeps its checkpoint), of the faulty sampler against the learner at those same weights.
        refused = report is None or report.stage == "pre-checks"
        try:
            kl, se = self._kl(engine, st.learner0 if refused else st.learner)
        except Exception as exc:  # an engine a fault broke may refuse to generate: the table says so
            kl, se = float("nan"), float("nan")
            self.log(f"    KL not measured: {type(exc).__name__}: {exc}")
        verdict = "CAUGHT" if fault.intended in caught and not digest_missed else "MISSED"
        detail = "" if err is None else str(err).split(": ", 1)[-1][:300]
        detail = digest_missed + detail
        if err is not None and not isinstance(err, SyncCheckError):
            detail = f"{type(err).__name__}: {err}"[:300]
        if warned and set(warned) != set(caught):
            detail = f"warn mode flagged {warned}; " + detail
        if refused:
            detail = "update refused whole (KL vs the learner at the checkpoint's weights); " + detail
        return Row(fault.name, fault.intended, caught, figure, kl, verdict, detail, se)

    def run(self, only: list[str] | None = None) -> list[Row]:
        rows = [self.healthy()]
        for f in FAULTS:
            if only and not any(o in f.name for o in only):
                continue
            rows.append(self.fault(f))
        return rows


def format_table(rows: list[Row]) -> str:
    head = ("fault", "intended check", "caught by (raise mode)", "figure", "KL (± s.e.)", "verdict")
    body = [(r.fault, r.intended, ",".join(r.caught_by) or "-", "-" if r.figure is None else f"{r.figure:.4g}",
             "nan" if not math.isfinite(r.kl) else f"{r.kl:.2g} ± {r.kl_se:.1g}", r.verdict) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(head), line(tuple("-" * w for w in widths)), *(line(b) for b in body)])


def passed(rows: list[Row]) -> bool:
    """The healthy run is clean and every applicable fault was caught by its intended check."""
    return all(r.verdict in ("clean", "CAUGHT", "N/A") for r in rows) and rows[0].verdict == "clean"


def run_selftest(arch: str = "qwen3_moe", recipe: str | None = None, *, workdir: Path, only=None,
                 log: Callable[[str], None] = print, device: str = "cpu", **kw) -> list[Row]:
    t0 = time.perf_counter()
    stack = Stack(arch, recipe, workdir, log=log, device=device)
    log(f"stack ready in {time.perf_counter() - t0:.1f} s: {arch}, recipe {stack.recipe.name}, "
        f"{len(stack.plan.quantized())} quantized tensors")
    return SelfTest(stack, log=log, **kw).run(only)
