"""``miles-lp run`` without Ray: build the parts from a recipe, run the GRPO steps, log, checkpoint, resume.

    recipe = load_recipe("recipes/tiny-mxfp8.yaml", ["rl.kl_coef=0.01"])
    run = Run.start(recipe)            # or Run.resume(recipe, "runs/tiny-mxfp8-...")
    run.train()                        # metrics.jsonl, checkpoints, a progress bar

Start-up order: the recipe was validated whole before this (``load_recipe``); then the model folder (a tiny
model is built in ``RUN_DIR/model``), the plan, the run folder, the learner (+ a frozen BF16 reference when
``rl.kl_coef > 0``), the engine started from a converted checkpoint of the same weights (``miles-lp convert``
output; byte-identical to the learner's export, an invariant), and an initial full sync from the
learner with a full byte compare (on resume it carries the checkpoint's weights into the engine).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from miles_lp.errors import ConfigError
from miles_lp.launch.loop import HEADLINE, drive, tensorboard_writer
from miles_lp.launch.recipe import Recipe, load_recipe
from miles_lp.launch.run_dir import RunDir
from miles_lp.rl.step import RunError, StepParts, grpo_step

logger = logging.getLogger("miles_lp.run")

#: metric keys that vary between identical runs (wall-clock): left out of bit-identity comparisons
NONDETERMINISTIC_PREFIXES = ("timing_s/", "perf/")

#: fresh engines (after its process died while generating) before a run stops instead
MAX_ENGINE_RESTARTS = 3

VERSION_KEYS = ("rollout/weight_version", "sync/weight_version", "sync/check/version/figure")


def model_context(config: Mapping[str, Any] | None) -> int | None:
    """The model's context in tokens (``max_position_embeddings`` of its config.json, a multimodal model's
    ``text_config``'s), or None when the config does not say."""
    if not config:
        return None
    cfg = config.get("text_config") or config
    v = cfg.get("max_position_embeddings")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def rotation_base(engine: Any, version_offset: int) -> None:
    """Start C3's rotating layer where a straight run's would be after ``version_offset`` syncs (engines that
    rotate it by their own weight version, which a resumed or restarted engine counts from 0)."""
    from miles_lp.rollout.engine import Capability, engine_capabilities

    if Capability.ROTATION_BASE in engine_capabilities(engine):
        engine.c3_rotation_base = int(version_offset)


_rotation_base = rotation_base  # the name older callers import
_tensorboard = tensorboard_writer  # the name older callers import


def read_model_config(model_dir: Path) -> dict[str, Any] | None:
    import json

    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _key_origin(recipe: Recipe, key: str) -> str:
    """``FILE:LINE`` or ``--set k=v`` of ``key``, or ``the default`` when neither set it."""
    where, line = recipe.origin(key)
    return where if line is not None or where.startswith("--set") else "the default"


def check_task_fits(recipe: Recipe, task: Any, model_config: Mapping[str, Any] | None = None) -> None:
    """The task against the response cap and the model's context, refused naming the keys:

    * a response cap shorter than the task's exact answer makes the reward unreachable;
    * the longest prompt + ``rollout.max_response_len`` beyond ``max_position_embeddings`` (``model_config``, the
      model's config.json) would have the engine cut responses at the context and report them as ``length``
      (SGLang and vLLM refuse such a request; DAPO's overlong penalty, computed against the cap, would never
      fire); for vLLM also beyond ``rollout.max_model_len`` (the engine's own limit)."""
    need = int(getattr(task, "max_response_len", 0) or 0)
    cap = int(getattr(recipe.rollout, "max_response_len", need))
    where = _key_origin(recipe, "rollout.max_response_len")
    if cap < need:
        raise ConfigError(f"rollout.max_response_len {cap} is shorter than the task's longest answer ({need} tokens, "
                          f"stop token included): no response can earn the reward; set rollout.max_response_len >= "
                          f"{need} (now set by {where})")
    prompt = int(getattr(task, "max_prompt_len", 0) or 0)
    ctx = model_context(model_config)
    if ctx is not None and prompt + cap > ctx:
        fix = (f"set rollout.max_response_len <= {ctx - prompt}" if ctx - prompt >= max(need, 1) else
               "shorten the task's prompts or use a model with a longer context")
        raise ConfigError(f"rollout.max_response_len {cap} ({where}) + the task's longest prompt ({prompt} tokens) = "
                          f"{prompt + cap} tokens, beyond the model's context (max_position_embeddings {ctx} in "
                          f"{recipe.model.path}'s config.json): the engine would cut those responses at the context "
                          f"and report them as length (SGLang and vLLM refuse such requests); {fix}")
    ro = recipe.rollout
    if getattr(ro, "backend", None) == "vllm" and getattr(ro, "max_model_len", None) and prompt + cap > ro.max_model_len:
        mwhere = _key_origin(recipe, "rollout.max_model_len")
        raise ConfigError(f"rollout.max_response_len {cap} ({where}) + the task's longest prompt ({prompt} tokens) = "
                          f"{prompt + cap} tokens, beyond rollout.max_model_len {ro.max_model_len} ({mwhere}): vLLM "
                          f"refuses such requests; raise rollout.max_model_len to >= {prompt + cap} or lower "
                          "rollout.max_response_len")


def step_with_restarts(run: Any, *, engine_dead: Callable[[BaseException], bool], learner_steps: Callable[[], int],
                       what: str) -> dict[str, float]:
    """One step of ``run`` (the in-process run or the Ray run), surviving an engine that dies: died while
    generating (the learner has not stepped) -> ``run.restart_engine()`` (a fresh engine, a full resync) and the
    step re-run; died later (the learner already stepped: its update must not be lost) or too often -> a
    checkpoint of the learner and an error naming the resume command. ``engine_dead(exc)`` asks the engine
    itself, since the sync reports an engine's failure wrapped."""
    step = run.step
    learner_at = learner_steps()
    while True:
        try:
            m = grpo_step(run.parts, step)
            break
        except Exception as exc:
            if not engine_dead(exc):
                raise
            moved = learner_steps() != learner_at
            if moved or run.restarts >= MAX_ENGINE_RESTARTS:
                run.step = step + int(moved)
                if moved:
                    run.checkpoint()
                raise RunError(f"step {step}: {what} died ({type(exc).__name__}: {exc}); stopped (engine restarts so "
                               f"far: {run.restarts}); {resume_note(run.dir, run.recipe.steps)}") from exc
            print(f"miles-lp run: step {step}: {what} died ({exc}); restarting it and resyncing every tensor",
                  file=sys.stderr)
            run.restart_engine()
    return record_step(run, step, m)


def record_step(run: Any, step: int, m: dict[str, float]) -> dict[str, float]:
    """The end of a step, the same for the in-process run and the Ray run: the run's weight-version count (an
    engine's own count restarts with the engine), the restart count (every row, so a plot has one series),
    the metrics row, and a checkpoint every ``checkpoint_every`` steps and at the last one. ``run`` has ``dir``,
    ``recipe``, ``step``, ``version_offset``, ``restarts`` and ``checkpoint()``."""
    for k in VERSION_KEYS:
        if k in m:
            m[k] += run.version_offset
    m["rollout/engine_restarts"] = float(run.engine_restarts)
    run.dir.append_metrics(step, m)
    run.step += 1
    every = run.recipe.checkpoint_every
    if (every and run.step % every == 0) or run.step == run.recipe.steps:
        run.checkpoint()
    return m



def sync_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``MILES_LP_SYNC_CHECK*`` variables of this (the driver's) environment: applied once, here, and handed
    to a sync built in another process (a Ray actor's environment is the raylet's, not the driver's)."""
    import os

    from miles_lp.sync.config import ENV_ALL, ENV_PREFIX

    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k == ENV_ALL or k.startswith(ENV_PREFIX)}


def sync_overrides(recipe: Recipe, env: Mapping[str, str]) -> dict[str, list[str]]:
    """``{check: [recipe mode, effective mode]}`` for each check the environment changes; each is printed at start
    (a variable left in a shell must not turn a recipe's raise-mode check off unseen) and kept in run.json."""
    from miles_lp.sync.config import CHECKS

    eff = recipe.sync.with_env(env)
    out = {c: [recipe.sync.mode(c), eff.mode(c)] for c in CHECKS if recipe.sync.mode(c) != eff.mode(c)}
    for check, (was, now) in out.items():
        print(f"miles-lp run: sync.checks.{check}: {was} -> {now} (from the environment: "
              f"{', '.join(sorted(env))})", file=sys.stderr, flush=True)
    return out


#: the checks a stock SGLang server cannot answer (no introspection endpoints), and what each would need from it
STOCK_SGLANG_SKIPS = {
    "layer_audit": "its live quantized parameters (C1)",
    "grid": "its live weight bytes (C2)",
    "self_check": "its serving kernels' output (C3)",
    "storage": "its tensors' storage (C4)",
}


def _stock_sglang(recipe: Recipe) -> bool:
    ro = recipe.rollout
    return getattr(ro, "backend", None) == "sglang" and getattr(ro, "server", None) == "sglang"


def never_answered(recipe: Recipe, env: Mapping[str, str] | None = None) -> list[str]:
    """The non-off checks (after the ``MILES_LP_SYNC_CHECK*`` variables in ``env``) that the recipe's engine can
    never answer: a stock SGLang server, C1-C4."""
    if not _stock_sglang(recipe):
        return []
    eff = recipe.sync.with_env(env or {})
    return [c for c in STOCK_SGLANG_SKIPS if eff.mode(c) != "off"]


def _mode_origin(recipe: Recipe, check: str, env: Mapping[str, str]) -> tuple[str, int | None, str]:
    """(where the effective mode of ``check`` comes from, its recipe line or None, how to make it warn)."""
    from miles_lp.sync.config import ENV_ALL, env_name

    var = env_name(check)
    if var in env:  # the per-check variable wins over MILES_LP_SYNC_CHECKS and the recipe (SyncConfig.with_env)
        return f"{var}={env[var]}", None, f"{var}=warn"
    if ENV_ALL in env:
        return f"{ENV_ALL}={env[ENV_ALL]}", None, f"{var}=warn"
    where, line = recipe.origin(f"sync.checks.{check}")
    return (f"line {line}" if line is not None else where), line, f"sync.checks.{check}: warn"


def check_answerable(recipe: Recipe, env: Mapping[str, str]) -> None:
    """``raise`` for a check the engine can never answer is refused at start: a stock SGLang server
    (``rollout.server: sglang``) has no introspection endpoints, so C1-C4 would be skipped at every sync and a
    ``raise`` there would guard nothing while the user believes it does. ``env``: the ``MILES_LP_SYNC_CHECK*``
    variables (``sync_env()``), applied as the sync applies them. The error names each key, the file and line (or
    the ``--set`` / variable that set it) and the ways out."""
    from miles_lp.sync.config import ENV_ALL

    if not _stock_sglang(recipe):
        return
    eff = recipe.sync.with_env(env)
    bad = [c for c in STOCK_SGLANG_SKIPS if eff.mode(c) == "raise"]
    if not bad:
        return
    origins = {c: _mode_origin(recipe, c, env) for c in bad}
    line = next((ln for _, ln, _ in origins.values() if ln is not None), None)
    keys = ", ".join(f"sync.checks.{c}: raise ({where})" for c, (where, _, _) in origins.items())
    needs = ", ".join(STOCK_SGLANG_SKIPS[c] for c in bad)
    it, they = ("it", "it") if len(bad) == 1 else ("them", "they")
    fixes = ", ".join(fix for _, _, fix in origins.values())
    if ENV_ALL in env and any(where.startswith(ENV_ALL) for where, _, _ in origins.values()):
        fixes += f" (or unset {ENV_ALL})"
    raise ConfigError(
        f"{keys}: a stock SGLang server (rollout.server: sglang) can never answer {it}: it has no endpoint "
        f"reporting {needs}, so {they} would be skipped at every sync and raise would guard nothing. Set "
        f"{fixes} (warn: skipped, said once at start; or off), or serve with "
        "rollout.server: miles-lp (`miles-lp serve` answers every check live). SGLang's in-process sglang.Engine "
        "with miles-lp's --custom-weight-loader rebuilds the derived state at each update but answers none of "
        "these checks either",
        source=recipe.source, line=line)


def note_skipped_checks(recipe: Recipe, env: Mapping[str, str] | None = None) -> list[str]:
    """``never_answered`` printed once at start (a warn-mode check skipped at every sync must not look like a
    passing one; raise for one was refused by ``check_answerable``)."""
    skipped = never_answered(recipe, env)
    if skipped:
        print(f"miles-lp run: rollout.server sglang (a stock server) answers none of {', '.join(skipped)}: they are "
              "skipped at every sync (sync/check/<name> = -1, warn mode); the weights are checked here before "
              "they are written to disk (C5) only", file=sys.stderr, flush=True)
    return skipped


def sync_log(line: str) -> None:
    """The sync's one line per sync (C7): a failed check (``warn`` mode too), or a raise-mode check the engine
    could not answer (first time), goes to stderr above the progress bar, where someone sees it; a clean sync to
    the log only."""
    if "FAILED" in line or "SKIPPED IN RAISE MODE" in line:
        from tqdm import tqdm

        tqdm.write(f"miles-lp run: {line}", file=sys.stderr)
    else:
        logger.info(line)


def plan_for(recipe: Recipe, model_dir: Path):
    """The learner's compiled plan (``plan_for_policy`` of ``precision:``). A compile error caused by a rule a
    ``--set`` gave names that ``--set``, not the recipe file."""
    from miles_lp.errors import MilesLPError

    try:
        return plan_for_policy(recipe.precision, model_dir)
    except MilesLPError as exc:
        msg = str(exc)
        m = re.search(r"\brules\[(\d+)\]", msg)
        where, _ = recipe.origin(f"precision.rules.{m.group(1)}" if m else "precision")
        prefix = f"{recipe.source}: "
        if not (where.startswith("--set") and msg.startswith(prefix)):
            raise
        try:
            named = type(exc)(f"{where}: {msg[len(prefix):]}")
        except TypeError:  # an error type whose constructor takes more than a message
            named = ConfigError(f"{where}: {msg[len(prefix):]}")
        raise named from None


def plan_for_policy(pol, model_dir: Path):
    """The compiled plan, or ``None`` for an all-BF16 policy (``{default: bf16}`` with no quantizing rule: it
    runs BF16 and needs no plan)."""
    from miles_lp.formats.spec import Format
    from miles_lp.train.embedded import plan_for_model

    if pol is None or (pol.default is Format.BF16 and all(r.format is Format.BF16 for r in pol.rules)):
        return None
    return plan_for_model(pol, model_dir)


def _engine_checkpoint(recipe: Recipe, model_dir: Path, policy, out: Path) -> Path:
    """The folder the engine loads: the model as ``miles-lp convert`` writes it for ``policy`` (None: as is)."""
    if policy is None:
        return model_dir
    if (out / "config.json").is_file():
        return out
    from miles_lp.checkpoint.convert import convert_checkpoint

    convert_checkpoint(model_dir, out, policy, target=target_of(recipe), overwrite=True, progress=False,
                       log=lambda s: logger.debug(s))
    return out


def engine_side(recipe: Recipe, model_dir: Path, plan, out: Path):
    """(engine checkpoint folder, the plan the engine serves, a view wrapper for the sync or None).

    Shared grid (no ``sampler_precision``): the learner's plan, converted. A comparison arm: the sampler's
    own policy (``miles_lp.launch.sampler``)."""
    if recipe.sampler_precision is None:
        return _engine_checkpoint(recipe, model_dir, None if plan is None else recipe.precision, out), plan, None
    from miles_lp.launch.sampler import SamplerView, engine_policy

    sampler_plan = plan_for_policy(recipe.sampler_precision, model_dir)
    epol = engine_policy(recipe.sampler_precision)
    engine_plan = plan_for_policy(epol, model_dir)
    ckpt = _engine_checkpoint(recipe, model_dir, epol if engine_plan is not None else None, out)
    return ckpt, engine_plan, (lambda learner: SamplerView(learner, sampler_plan, engine_plan))


def target_of(recipe: Recipe) -> str:
    return getattr(recipe.rollout, "target", "sglang")


def make_engine(recipe: Recipe, checkpoint: Path, *, run_dir: Path | None = None, index: int = 0):
    """The rollout engine of ``rollout.backend``, serving ``checkpoint`` (the converted engine checkpoint);
    ``index``: which of ``rollout.engines`` (its own log / update folder; with ``rollout.urls`` its server).

    * ``reference``: the embedded engine, computing in the learner's master dtype when ``dtype: auto``.
    * ``vllm``: vLLM CPU in its own process and venv (``rollout.vllm``; bf16); its log goes to
      ``RUN_DIR/vllm-engine.log``.
    * ``sglang``: the HTTP client of the server at ``rollout.url``, asked for ``/health`` first so an unreachable
      address fails here, before step 1, naming it. ``server: miles-lp``: tensor updates (safetensors bodies) and
      the live checks; ``server: sglang``: each sync exported as a checkpoint folder under
      ``RUN_DIR/engine_updates`` and loaded with ``/update_weights_from_disk`` (stock SGLang's tensor path takes
      pickle, which miles-lp never produces)."""
    ro = recipe.rollout
    run_dir = Path(run_dir) if run_dir is not None else Path(checkpoint).parent
    suffix = f"-engine{index}" if index else ""  # engine 0 keeps the names a one-engine run has
    if ro.backend == "vllm":
        import json

        from miles_lp.rollout.checkpoint import open_checkpoint
        from miles_lp.rollout.vllm import VLLMEngine

        formats = open_checkpoint(checkpoint).formats
        experts = sorted(n for n, f in formats.items() if ".experts." in n and f.quantized)
        if experts:  # what --dry-run lists under would_refuse_at_start
            raise ConfigError(f"rollout.backend vllm: {checkpoint} has {len(experts)} quantized routed-expert weights "
                              f"(e.g. {experts[0]}); vLLM's quantized fused-MoE kernels are Triton-only, not runnable "
                              "on its CPU build: keep experts bf16 (precision rules) or use rollout.backend reference")
        hf = json.loads((Path(checkpoint) / "config.json").read_text())
        check_engine_tp(ro.engine_tp, hf, formats.values(), str(checkpoint))

        # vLLM refuses a max_model_len above the model's positions: explicit values are the user's to fix
        limit = hf.get("max_position_embeddings")
        model_len = ro.model_len if (ro.max_model_len or not limit) else min(ro.model_len, int(limit))
        return VLLMEngine(checkpoint, dtype="bfloat16", max_model_len=model_len, kv_cache=ro.kv_cache,
                          log_path=run_dir / f"vllm-engine{suffix}.log", tp=ro.engine_tp,
                          cores=engine_cores(index, recipe.fleet.count) if ro.engine_tp > 1 else None)
    if ro.backend == "sglang":
        from miles_lp.rollout.sglang import SGLangHTTPEngine

        urls = recipe.fleet.urls
        url = urls[index] if urls else ro.url
        eng = SGLangHTTPEngine(url, flavor=ro.server, checkpoint=checkpoint,
                               update_dir=run_dir / f"engine_updates{suffix}")
        try:
            eng.probe()
        except Exception as exc:
            key = f"rollout.urls[{index}]" if urls else "rollout.url"
            raise ConfigError(f"{key} {url}: no engine answers there ({exc}); start the server first: "
                              "`miles-lp run RECIPE --prepare-engine DIR` writes the checkpoint it must serve and "
                              "prints the `miles-lp serve` command; or fix rollout.url") from None
        return eng
    from miles_lp.rollout.reference import ReferenceEngine

    kw = {k: getattr(ro, k) for k in ("device", "dtype", "kv_cache") if hasattr(ro, k)}
    if kw.get("dtype") == "auto":
        # the learner's activation dtype (its master dtype): on CUDA the engine's own default is bf16, which put
        # an fp32-master run at kl 2e-4 on the H200 before any update; matched, it is exactly 0 (2026-12-01)
        # (``compute_dtype``: the learner's forward dtype, = master_dtype unless train.param_dtype is set)
        kw["dtype"] = getattr(recipe.train, "compute_dtype", recipe.train.master_dtype)
    return ReferenceEngine(checkpoint, **kw)


def check_engine_tp(tp: int, hf_config: dict, formats: Iterable[Any], where: str) -> None:
    """``rollout.engine_tp`` against the model's sizes (``rollout.config.engine_tp_problems``; ``formats``: the
    served weights' formats, whose largest scale block a row-parallel shard must hold whole): a ConfigError
    naming them, at start and in --dry-run."""
    from miles_lp.formats.spec import FP8_BLOCK_SIZE, Format
    from miles_lp.rollout.config import engine_tp_problems

    formats = list(formats)
    block = max((f.block_size or 1 for f in formats), default=1)
    row_block = FP8_BLOCK_SIZE if Format.FP8_BLOCK in formats else None  # 128x128: output rows in blocks too
    problems = engine_tp_problems(tp, hf_config, block if block > 1 else None, row_block)
    if problems:
        raise ConfigError(f"rollout.engine_tp {tp}: the engine's tensor-parallel ranks cannot split {where}: "
                          + "; ".join(problems) + "; choose a rollout.engine_tp these sizes split into (1 always does)")


def engine_cores(index: int, count: int) -> list[int]:
    """Engine ``index`` of ``count`` on this host: its share of this process's cores (consecutive, equal), so that
    engines at ``rollout.engine_tp`` > 1 bind their ranks to cores of their own, not all to the same ones."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // count
    if per < 1:
        raise ConfigError(f"rollout.engines: {count} engines at rollout.engine_tp > 1 need cores of their own; this "
                          f"process may use {len(cores)}: lower rollout.engines or rollout.engine_tp")
    return cores[index * per:(index + 1) * per]


def check_devices(recipe: Recipe) -> None:
    """A ``cuda`` device in the recipe on a host without CUDA: one line naming the key, before anything is built."""
    import torch

    if torch.cuda.is_available():
        return
    for key, dev in (("train.device", recipe.train.device), ("rollout.device", getattr(recipe.rollout, "device", None))):
        if isinstance(dev, str) and dev.startswith("cuda"):
            raise ConfigError(f"{key}: {dev}, but this host has no CUDA device; set {key}: cpu (or auto)")


def check_transport(recipe: Recipe) -> None:
    """``sync.transport`` against ``ray.enabled`` and this host's devices, in recipe keys: the same
    refusal at start (``Run``, and ``miles-lp run`` before a Ray cluster starts) and in ``--dry-run``. The sync
    of ``ray`` and ``cuda_ipc`` runs in this (the driver's) process, so its devices are this host's under Ray too;
    ``nccl`` / ``gloo`` are ``actor_sync.check_broadcast``'s."""
    name = recipe.sync.transport
    if name == "ray" and not recipe.ray.enabled:
        raise ConfigError("sync.transport: ray relays the sync's buckets through Ray's object store, which exists only "
                          "in a Ray run; set ray.enabled: true, or sync.transport: inprocess (this process)")
    if name == "cuda_ipc":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("sync.transport: cuda_ipc shares CUDA buffers between processes, but this host has no "
                              "CUDA device; set sync.transport: inprocess (or ray, with ray.enabled: true)")


def make_learner(recipe: Recipe, model_dir: Path, plan, placement: Any = None):
    """The learner of ``recipe``. A Megatron learner of several ranks is a ``MegatronGroup`` whose ranks 1..world-1
    run where ``placement`` puts them: spawned processes (None, ``ranks.ProcessPlacement``) or Ray actors
    (``ray_ranks.RayPlacement``, the Ray launcher's); one build either way."""
    check_devices(recipe)
    if recipe.train.backend == "megatron":
        from miles_lp.train.megatron.group import make_megatron_learner

        kw = {} if placement is None else {"placement": placement,
                                           "worker_threads": max(1, int(getattr(placement, "cpus_per_rank", 1)))}
        # the engine's tensor-parallel size, for the activation-scale partition check (NVFP4)
        return make_megatron_learner(model_dir, plan, recipe.train, engine_tp=getattr(recipe.rollout, "engine_tp", 1), **kw)
    from miles_lp.train.embedded import EmbeddedTrainer

    return EmbeddedTrainer(model_dir, plan, recipe.train)


def sampling_for(recipe: Recipe, task):
    """The rollout's sampling parameters; stop tokens default to the task's (its EOS)."""
    ro = recipe.rollout
    stop = tuple(getattr(ro, "stop_token_ids", ()) or ()) or tuple(task.stop_token_ids)
    # at a temperature != 1 the engine reports the log-prob of the tempered distribution it sampled from, the
    # quantity the learner computes (train.logits_temperature follows rollout.sampling.temperature)
    mode = "raw" if ro.sampling.temperature == 1.0 else "processed"
    return ro.sampling_params(stop_token_ids=stop, logprob_mode=mode)


def check_start(recipe: Recipe, env: dict[str, str]) -> None:
    """Every refusal made before anything is built, in recipe keys (the CLI, ``--dry-run`` and both placements)."""
    from miles_lp.launch.actor_sync import check_broadcast
    from miles_lp.launch.engines import check_fleet

    check_broadcast(recipe)  # nccl / gloo: the learner and engine in actors of their own (ray.enabled)
    check_transport(recipe)
    check_fleet(recipe)
    if not recipe.ray.enabled:  # under Ray the devices are the workers' (checked where each part is built)
        check_devices(recipe)
    check_answerable(recipe, env)


def prepare(recipe: Recipe, run_dir: Any) -> Any:
    """The refusals, then the model folder, plan, task and engine checkpoint (``RUN_DIR/engine_init``)."""
    from miles_lp.launch.model import prepare_model, vocab_size
    from miles_lp.launch.placement import Prepared
    from miles_lp.rl.tasks import make_task

    env = sync_env()  # read once, here: the refusal and the sync see the same variables
    check_start(recipe, env)
    model_dir = prepare_model(recipe.model, run_dir.path / "model")
    plan = plan_for(recipe, model_dir)
    task = make_task(recipe.task, vocab_size(model_dir), model_dir)
    check_task_fits(recipe, task, read_model_config(model_dir))
    ckpt, engine_plan, view = engine_side(recipe, model_dir, plan, run_dir.path / "engine_init")
    return Prepared(model_dir, plan, task, ckpt, engine_plan, view, env)


class LocalPlacement:
    """The ``placement.Placement`` of a run without Ray: everything in this process (a Megatron learner's ranks are processes it spawns)."""

    engine_name = "the engine process"  # what a run's error calls an engine that died

    def __init__(self, build_engine: Any = None):
        self.build_engine = build_engine  # tests: an engine factory standing for make_engine

    def learner(self, run: Any, learner_state: Any) -> tuple[Any, Any]:
        learner = make_learner(run.recipe, run.model_dir, run.plan)
        run.learner = learner  # closed by the run if what follows fails
        if learner_state is not None:
            learner.load_state_dict(learner_state)
        reference = None
        if run.recipe.rl.kl_coef > 0:
            from miles_lp.train.embedded import EmbeddedTrainer

            reference = EmbeddedTrainer(run.model_dir, None, run.recipe.train)  # frozen: never stepped
        return learner, reference

    def engine(self, run: Any, index: int) -> Any:
        if self.build_engine is not None:
            return self.build_engine()
        return make_engine(run.recipe, run.prep.engine_ckpt, run_dir=run.dir.path, index=index)

    def sync_for(self, run: Any, engine: Any) -> Any:
        from miles_lp.sync import WeightSync

        sync = WeightSync(engine, run.prep.engine_plan, target_of(run.recipe), run.recipe.sync, env=run.sync_env,
                          log=sync_log)
        if run.prep.view is not None:  # a comparison arm: the sampler gets its own re-quantization of the master
            from miles_lp.launch.sampler import SyncVia

            sync = SyncVia(sync, run.prep.view(run.learner))
        return sync

    def fleet_sync(self, run: Any, engines: list[Any]) -> Any:
        from miles_lp.sync.fleet import FleetSync

        return FleetSync([self.sync_for(run, e) for e in engines], log=sync_log)

    def dead(self, engine: Any, exc: BaseException | None) -> bool:
        """The engine's process is gone (only engines with a process of their own report ``dead``)."""
        try:
            return str(engine.health().get("status")) == "dead"
        except Exception:  # noqa: BLE001 - cannot tell (an HTTP server that stopped answering): not restartable
            return False

    def checkpoint(self, run: Any, loop: dict[str, Any]) -> Path:
        return run.dir.save_checkpoint(run.step, run.learner.state_dict(), loop)

    def close(self, run: Any) -> None:
        # the engines' threads / processes, the Megatron learner's process group (also for a half-built run)
        for part in (getattr(run, "engine", None), getattr(run, "learner", None)):
            close = getattr(part, "close", None)
            if close is not None:
                close()


class Run:
    """One run: the parts, the run folder and the loop state, built the same way wherever the parts live
    (``placement``: this process by default, Ray actors with ``ray_launcher.RayPlacement``). Build with ``start`` or
    ``resume``; ``train`` runs the loop (``launch/loop.py``)."""

    def __init__(self, recipe: Recipe, run_dir: RunDir, *, start_step: int = 0, learner_state=None,
                 loop_state: Mapping[str, Any] | None = None, build_engine: Callable | None = None,
                 placement: Any = None):
        self.recipe, self.dir = recipe, run_dir
        self.placement = placement if placement is not None else LocalPlacement(build_engine)
        self.prep = prepare(recipe, run_dir)  # the refusals first: nothing is built before them
        self.sync_env = self.prep.sync_env
        self.model_dir, self.plan, self.task = self.prep.model_dir, self.prep.plan, self.prep.task
        self.engine_ckpt = self.prep.engine_ckpt
        try:
            self._build(recipe, start_step, learner_state, loop_state)
        except BaseException:  # no engine, actor or Megatron group outlives a run that failed to start
            self.close()
            raise

    def _build(self, recipe: Recipe, start_step: int, learner_state, loop_state) -> None:
        from miles_lp.launch.engines import engines_of

        self.learner, self.reference = self.placement.learner(self, learner_state)
        self._engines: list[Any] = []
        for i in range(engines_of(recipe)):
            self._engines.append(self.placement.engine(self, i))
        self.sync_overrides = sync_overrides(recipe, self.sync_env)
        note_skipped_checks(recipe, self.sync_env)
        if len(self._engines) == 1:
            self.engine = self._engines[0]
            self.sync = self.placement.sync_for(self, self.engine)
        else:
            self.engine, self.sync = self._fleet(self._engines)
        loop_state = dict(loop_state or {})
        if "sentinel" in loop_state:  # the C6 streaks, so a resumed run trips exactly when a straight one would
            self.sync.sentinel.load_state_dict(loop_state["sentinel"])
        self.initial = self.sync.initial_sync(self.learner)
        # the engine's version counts syncs since ITS start; report the run's count
        self.version_offset = int(loop_state.get("engine_weight_version", 0))
        for e in self._engines:
            rotation_base(e, self.version_offset)
        self.step = start_step
        self.restarts = 0
        self.parts = StepParts(learner=self.learner, engine=self.engine, sync=self.sync, task=self.task,
                               sampling=sampling_for(recipe, self.task), rl=recipe.rl, seed=recipe.seed,
                               reference=self.reference)

    def _fleet(self, engines: list[Any]) -> tuple[Any, Any]:
        """``rollout.engines`` > 1: the engines as one (``EngineFleet``), synced and checked each (``FleetSync``)."""
        from miles_lp.launch.engines import EngineFleet, FleetSyncForStep

        def restarted(i: int, engine: Any) -> None:  # C3's rotation where a straight engine's would be
            rotation_base(engine, self.version_offset + int(fleet.sync.expected_version)
                          - int(self.initial.weight_version))

        fleet = EngineFleet(engines, rebuild=lambda i: self.placement.engine(self, i), dead=self.placement.dead,
                            on_restart=restarted)
        fleet.attach(self.placement.fleet_sync(self, engines), self.learner)
        return fleet, FleetSyncForStep(fleet)

    # ---- construction ---------------------------------------------------------------------------------
    @classmethod
    def start(cls, recipe: Recipe, run_name: str | None = None, **kw) -> Run:
        from miles_lp.launch.router import with_router_workers

        recipe = with_router_workers(recipe)  # a router's servers are the engines, recorded in recipe.yaml
        name = run_name or recipe.logging.run_name or (
            f"{Path(recipe.source).stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
        rd = RunDir.create(recipe.logging.output_dir, name)
        try:
            run = cls(recipe, rd, **kw)
        except BaseException:  # failed or interrupted while starting: no half-made run folder
            rd.discard_unstarted()
            raise
        extra = {"miles_lp_version": _version(), **({"ray": dataclasses.asdict(recipe.ray)} if recipe.ray.enabled
                                                    else {})}
        rd.write_header(recipe.to_yaml(), None if run.plan is None else run.plan.to_json(),
                        {"plan_hash": None if run.plan is None else run.plan.hash,
                         "model_dir": str(Path(run.model_dir).resolve()), "recipe_source": recipe.source,
                         "created": time.time(), "steps": recipe.steps, **extra,
                         "sync_check_overrides": run.sync_overrides})
        return run

    @classmethod
    def resume(cls, run_dir: str | Path, recipe: Recipe | None = None, **kw) -> Run:
        """Continue ``run_dir`` from its latest checkpoint. ``recipe`` (if given) must be the run's effective
        recipe; only ``steps`` may differ (to run longer)."""
        rd = RunDir(run_dir)
        saved = resumed_recipe(rd, recipe)
        state, loop = cls._checkpoint_state(rd)
        rd.truncate_metrics(int(loop["step"]))
        run = cls(saved, rd, start_step=int(loop["step"]), loop_state=loop, **state, **kw)
        try:
            rd.record_resume(run.step, {"sync_check_overrides": run.sync_overrides})
        except BaseException:
            run.close()
            raise
        return run

    @classmethod
    def _checkpoint_state(cls, rd: RunDir) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the learner's state as keyword arguments of the constructor, loop.json) of ``rd``'s latest checkpoint."""
        state, loop = rd.load_checkpoint()
        return {"learner_state": state}, loop

    # ---- the loop -------------------------------------------------------------------------------------
    def step_once(self) -> dict[str, float]:
        """One step (``grpo_step``: generate -> train -> sync), surviving an engine that dies
        (``step_with_restarts``; a fleet replaces its own engines and never gets here for that)."""
        single = len(getattr(self, "_engines", ())) <= 1
        return step_with_restarts(self, engine_dead=lambda exc: single and self.placement.dead(self.engine, exc),
                                  learner_steps=self._learner_steps, what=self.placement.engine_name)

    def _learner_steps(self) -> int:
        v = self.learner.step  # the Learner protocol's attribute (a method on some proxies)
        return int(v() if callable(v) else v)

    def restart_engine(self) -> None:
        """A fresh engine from the same checkpoint, recorded anew by the sync, then a full resync (full compare)."""
        try:
            self.engine.close()
        except Exception:  # already gone
            pass
        self.restarts += 1
        ws = getattr(self.sync, "inner", self.sync)  # a comparison arm's SyncVia wraps the WeightSync
        served = ws.expected_version - int(self.initial.weight_version)  # syncs since the last (re)start
        self.engine = self.placement.engine(self, 0)
        self._engines = [self.engine]
        ws.engine = self.engine
        self.parts.engine = self.engine
        self.initial = self.sync.initial_sync(self.learner)
        self.version_offset += served
        rotation_base(self.engine, self.version_offset)

    def sync_failed(self, step: int, exc: BaseException) -> RunError:
        """The error the run stops with when the sync after ``step``'s update failed (``sync_failed``)."""
        return sync_failed(self.dir, step, self.recipe.steps, exc)

    @property
    def engine_restarts(self) -> int:
        """Engines started again over this run: the one engine's restarts, or every fleet engine's."""
        fleet = getattr(self.engine, "total_restarts", None)
        return self.restarts + (fleet() if callable(fleet) else 0)

    def checkpoint(self) -> Path:
        sent = self.sync.sentinel
        loop = {"data_position": self.step, "engine_weight_version": int(self.sync.expected_version)
                + self.version_offset - int(self.initial.weight_version),
                "sentinel": sent.state_dict()}
        return self.placement.checkpoint(self, loop)

    def train(self, progress: bool | None = None, tensorboard: bool | None = None,
              on_step: Callable[[Any, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
        """Run until ``recipe.steps``; returns the metrics of the steps run here (``launch/loop.py``)."""
        return drive(self, progress=progress, tensorboard=tensorboard, on_step=on_step)

    def close(self) -> None:
        engines = [e for e in getattr(self, "_engines", ()) if e is not getattr(self, "engine", None)]
        for e in engines:  # a fleet half built: the engines made so far
            try:
                e.close()
            except Exception:  # noqa: BLE001 - closing the rest matters more
                pass
        self.placement.close(self)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C in a run's loop (the Ray run raises it after stopping its actors): which folder, which step."""

    def __init__(self, run_dir: RunDir, step: int, steps: int | None = None):
        super().__init__(f"interrupted at step {step}")
        self.run_dir, self.step, self.steps = run_dir, step, steps


def resume_command(rd: RunDir, steps: int | None = None) -> str:
    """The command that resumes ``rd``: the run's own recipe.yaml (the effective recipe: every ``--set`` of its start
    is in it, and a resume refuses any other), plus ``--set steps=N`` when the run went on to more steps than
    recipe.yaml says (a resume that raised ``steps``: recipe.yaml keeps the start's)."""
    import shlex

    saved = load_recipe(rd.recipe_path).steps if rd.recipe_path.is_file() else None
    more = f" --set steps={int(steps)}" if steps is not None and saved is not None and int(steps) != saved else ""
    return f"miles-lp run {shlex.quote(str(rd.recipe_path))} --resume {shlex.quote(str(rd.path))}{more}"


def resume_note(rd: RunDir, steps: int | None = None) -> str:
    """What a stopped run can do next, one text for Ctrl-C, a failed sync and an engine that died (
    the last checkpoint, the step it resumes at and the exact command (``resume_command``; ``steps``:
    the run's effective ``steps``), or, without a checkpoint, that there is nothing to resume and what to do."""
    latest = rd.latest()
    if latest is not None:
        at = int(json_load(latest / "loop.json").get("step", -1))
        return f"the last checkpoint is {latest} (it resumes at step {at}): {resume_command(rd, steps)}"
    rows = len(rd.read_metrics())
    every = rd.recipe_path.is_file() and load_recipe(rd.recipe_path).checkpoint_every
    return (f"no checkpoint yet (checkpoint_every: {every or 0}, and the last step writes one): nothing to resume. "
            f"{rd.path} keeps the metrics of {rows} step(s); to train, start a new run (a lower checkpoint_every "
            "leaves a checkpoint to resume from sooner)")


def sync_failed(rd: RunDir, step: int, steps: int, exc: BaseException) -> RunError:
    """The error a run stops with when the sync after ``step``'s update fails (a raise-mode check, or an aborted
    sync): the failure, then ``resume_note``. A resume re-runs from the checkpoint with the same seeds (bit-identical,
    docs/rl.md), so a failed check is expected to fail again there: the note says how to let it warn instead."""
    from miles_lp.sync.config import env_name

    text = f"step {step}: {exc}; {resume_note(rd, steps)}"
    names = [v.name for v in getattr(exc, "verdicts", ())]
    if names:
        if rd.latest() is not None:
            env = " ".join(f"{env_name(n)}=warn" for n in names)
            text += (f". The resume re-runs the same steps with the same seeds, so the same check is expected to fail "
                     f"again unless its cause is fixed; to go on with it warning, put {env} before that command "
                     "(run.json records it)")
        else:
            keys = ", ".join(f"sync.checks.{n}: warn" for n in names)
            text += f"; to run past this check, set {keys} in the new run's recipe, or fix its cause"
    return RunError(text)


def interrupted_note(rd: RunDir, step: int, steps: int | None = None) -> str:
    """What to do after Ctrl-C at ``step`` (the step in progress): ``resume_note``. A folder holding
    neither a checkpoint nor a metrics row is removed (``discard_unstarted``), as for a run interrupted while
    starting."""
    if rd.latest() is not None:
        rows = len(rd.read_metrics())
        return (f"miles-lp run: interrupted at step {step} ({rows} metrics rows in {rd.metrics_path}); "
                f"{resume_note(rd, steps)}")
    rd.discard_unstarted()
    if not rd.path.exists():
        return (f"miles-lp run: interrupted at step {step}; no checkpoint and no metrics row yet: nothing to resume "
                f"(removed {rd.path})")
    return f"miles-lp run: interrupted at step {step}; {resume_note(rd, steps)}"


def json_load(path: Path) -> dict[str, Any]:
    import json

    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def resumed_recipe(rd: RunDir, recipe: Recipe | None) -> Recipe:
    """The run's saved effective recipe; ``recipe`` (if given) must equal it except for ``steps``. Refused here,
    before anything is built (the in-process and the Ray resume, and ``miles-lp run`` before a cluster starts):
    a model folder that is not the run's (``check_resumed_model``), and ``steps`` that leave nothing to run
    (the resume then ran no step, exited 0 and recorded a resume)."""
    rd.require_run()
    saved = load_recipe(rd.recipe_path)
    check_resumed_model(rd, saved)
    if recipe is not None:
        a = {k: v for k, v in saved.raw.items() if k != "steps"}
        b = {k: v for k, v in recipe.raw.items() if k != "steps"}
        if a != b:
            diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            paths = [f"{s}.{k}: this recipe names {(b.get(s) or {}).get(k)}, the run's "
                     f"{(a.get(s) or {}).get(k)}" for s, k in (("model", "path"), ("task", "path"))
                     if (a.get(s) or {}).get(k) != (b.get(s) or {}).get(k)]
            why = (f" ({'; '.join(paths)}: a relative path is read against the working directory, now {Path.cwd()})"
                   if paths else "")
            raise ConfigError(f"--resume {rd.path}: the recipe differs from the run's recipe.yaml in section(s) "
                              f"{', '.join(diff)}{why}; resume with the same recipe and the same --set overrides "
                              f"(only steps may change), or with the run's own: "
                              f"`miles-lp run {rd.recipe_path} --resume {rd.path}`")
        saved = dataclasses.replace(saved, steps=recipe.steps, raw={**saved.raw, "steps": recipe.steps})
    latest = rd.latest()
    if latest is not None:
        at = int(json_load(latest / "loop.json").get("step", 0))
        if saved.steps <= at:
            raise ConfigError(f"--resume {rd.path}: the run is at step {at} (its latest checkpoint, {latest.name}) and "
                              f"steps is {saved.steps}: nothing to run; pass --set steps=M with M > {at} to continue")
    return saved


def check_resumed_model(rd: RunDir, saved: Recipe) -> None:
    """The model a resume would read is the one the run started from: run.json's ``model_dir``
    against the saved recipe's ``model.path`` (a relative path in an older run's recipe.yaml is read against
    today's working directory), and run.json's ``model_id`` (config.json's sha256, the weight files' names and
    sizes) against the folder now. A ``tiny:<arch>`` model is the run's own ``RUN_DIR/model`` (rebuilt from its
    stamp if missing; the folder may have been moved since). A ``task.path`` (task jsonl) against run.json's
    ``task_id`` (its sha256 and size). Refused naming both."""
    from miles_lp.launch.model import model_id, model_id_difference

    info = rd.info()
    recorded = info.get("model_dir")
    if saved.model.is_tiny:
        current = rd.path / "model"
        if not current.is_dir():
            return  # rebuilt deterministically from the recipe's tiny settings
    else:
        current = Path(saved.model.path)
        if recorded and Path(recorded).resolve() != current.resolve():
            raise ConfigError(f"--resume {rd.path}: model.path {current} is not the model this run started from: "
                              f"run.json's model_dir is {recorded} (a relative model.path in {rd.recipe_path} is "
                              f"read against the working directory, now {Path.cwd()}); resume from the folder the "
                              f"run started in, or set model.path: {recorded} in {rd.recipe_path}")
    rec_id = info.get("model_id")
    if rec_id:
        diff = model_id_difference(rec_id, model_id(current))
        if diff:
            raise ConfigError(f"--resume {rd.path}: the model folder {current} is not the one this run started from "
                              f"({diff}; run.json's model_id records config.json's sha256 and the weight files' "
                              "sizes at the start); resume with the run's own model")
    task = info.get("task_id")
    if task and saved.task.path:
        from miles_lp.launch.model import file_id

        now = file_id(saved.task.path)
        if Path(saved.task.path) != Path(task.get("path", "")) or now is None or now["sha256"] != task.get("sha256"):
            what = ("cannot be read" if now is None else f"is {now['size']} bytes, sha256 {now['sha256'][:12]}")
            raise ConfigError(f"--resume {rd.path}: task.path {saved.task.path} is not the prompts file this run "
                              f"started from ({task.get('path')}, {task.get('size')} bytes, sha256 "
                              f"{str(task.get('sha256'))[:12]}; now it {what}): the resumed steps would draw other "
                              "prompts; resume with the run's own file")


def _version() -> str:
    from miles_lp import __version__

    return __version__


def deterministic_metrics(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics with wall-clock keys removed (for bit-identity comparisons)."""
    return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)} for r in rows]


def summary(rows: list[dict[str, Any]], last: int = 5) -> dict[str, float]:
    """First and last-``last``-mean of the headline metrics."""
    if not rows:
        return {}
    out: dict[str, float] = {}
    for k, _ in HEADLINE:
        vals = [r[k] for r in rows if k in r]
        if vals:
            out[f"{k}/first"] = vals[0]
            tail = vals[-last:]
            out[f"{k}/last{len(tail)}"] = sum(tail) / len(tail)
    # each check's failed / skipped steps (0.0 / -1.0 in its metric), so a warn-mode failure shows in the summary
    for k in sorted({k for r in rows for k in r if k.startswith("sync/check/") and k.count("/") == 2}):
        for what, value in (("failed_steps", 0.0), ("skipped_steps", -1.0)):
            n = sum(1 for r in rows if r.get(k) == value)
            if n:
                out[f"{k}/{what}"] = float(n)
    return out

