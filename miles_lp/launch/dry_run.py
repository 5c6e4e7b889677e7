"""``miles-lp run --dry-run``: validate a recipe against its model without starting anything.

Checks what can be checked here: the schema (already parsed), the model folder's config (a tiny model is not
built: its config is derived from the architecture), the compiled plan, the task against the vocabulary, the
placement; the engine's quantization config for the rollout target (emitted, then re-read with the engine's own
matching rules: every planned weight must load in its planned format, as `miles-lp convert` proves), and for
`train.backend: megatron` the Megatron/TE arguments and environment from the plan with the parallel sizes
checked against the model. What the runner would still refuse at start is listed, not hidden. Returns a
JSON-able summary; a recipe the engine or Megatron cannot express raises ``ConfigError``.
"""

from __future__ import annotations

from typing import Any

from miles_lp.launch.recipe import Recipe


def dry_run(recipe: Recipe) -> dict[str, Any]:
    from miles_lp.formats.spec import Format
    from miles_lp.policy import compile_plan, get_layout
    from miles_lp.rl.tasks import make_task

    if recipe.model.is_tiny:
        from miles_lp.checkpoint.tiny import tiny_config

        cfg = tiny_config(recipe.model.arch, num_layers=recipe.model.num_layers)
        for k, v in recipe.model.overrides.items():
            setattr(cfg, k, v)
        config = cfg.to_dict()
    else:
        import json
        from pathlib import Path

        from miles_lp.launch.model import prepare_model

        config = json.loads((prepare_model(recipe.model, Path("/nonexistent")) / "config.json").read_text())
    pol = recipe.precision
    plan = None
    if not (pol.default is Format.BF16 and all(r.format is Format.BF16 for r in pol.rules)):
        plan = compile_plan(pol, get_layout(config))
    from miles_lp.errors import ConfigError
    from miles_lp.launch.runner import check_task_fits, never_answered, sync_env

    would_refuse = _would_refuse(recipe, plan, config)
    try:  # a task the model cannot encode (string prompts, no tokenizer in a config-only folder): listed, not fatal
        task = make_task(recipe.task, int(config["vocab_size"]),
                         None if recipe.model.is_tiny else Path(recipe.model.path))
    except ConfigError as e:
        task = None
        would_refuse.append(str(e))
    if task is not None:
        try:
            check_task_fits(recipe, task, config)
        except ConfigError as e:
            would_refuse.append(str(e))
    skipped = never_answered(recipe, sync_env())
    out = {
        "recipe": recipe.source, "model": recipe.model.path, "model_type": config.get("model_type"),
        "plan_hash": None if plan is None else plan.hash,
        "quantized_tensors": 0 if plan is None else len(plan.quantized()),
        "plan_warnings": [] if plan is None else list(plan.warnings),
        "task": recipe.task.name, "answer_tokens": None if task is None else task.max_response_len,
        **({"prompt_encoding": task.encoding, "eos_id": task.eos_id} if hasattr(task, "encoding") else {}),
        "samples_per_step": recipe.rl.prompts_per_step * recipe.rl.group_size, "steps": recipe.steps,
        "train_backend": recipe.train.backend, "rollout_backend": recipe.rollout.backend,
        "ray": {"enabled": recipe.ray.enabled, "address": recipe.ray.address or "local",
                "placement": recipe.ray.placement,
                **({"learner_ranks": _learner_placement(recipe, config)} if recipe.ray.enabled else {})},
        "rollout_engines": {"count": recipe.fleet.count, **({"urls": list(recipe.fleet.urls)} if recipe.fleet.urls
                                                           else {})},
        "sync_transport": recipe.sync.transport,
        "would_refuse_at_start": would_refuse,
        **({"checks_never_answered": skipped} if skipped else {}),
    }
    if plan is not None:
        out["engine_config"] = engine_config(plan, _engine_target(recipe))
        if recipe.train.backend == "megatron":
            out["megatron"] = megatron_config(plan, config, recipe.train.megatron)
    return out


def _engine_target(recipe: Recipe) -> str:
    return "vllm" if recipe.rollout.backend == "vllm" else getattr(recipe.rollout, "target", "sglang")


def engine_config(plan, target: str) -> dict[str, Any]:
    """The quantization config the engine gets (what convert writes), re-read with the engine's matching."""
    from miles_lp.errors import ConfigError
    from miles_lp.export.configs import emit_configs, engine_formats_for
    from miles_lp.formats.spec import Format

    quant_config, files = emit_configs(plan, target)
    engine = engine_formats_for(target, quant_config, files, plan)
    wrong = [n for n, e in plan.entries.items() if n.endswith(".weight") and len(e.shape) == 2
             and engine.get(n, Format.BF16) is not e.format]
    if wrong:
        raise ConfigError(f"the {target} engine would load {len(wrong)} weight(s) in another format than the plan, "
                          f"e.g. {wrong[0]} (engine: {engine.get(wrong[0], Format.BF16).value}, plan: "
                          f"{plan.entries[wrong[0]].format.value})")
    return {"target": target, "quantization_config": quant_config, "extra_files": sorted(files),
            "engine_reads_plan": True}


def megatron_config(plan, hf_config: dict, mp) -> dict[str, Any]:
    """Megatron-Core / TE arguments and environment from the plan, and the parallel sizes against the model."""
    from miles_lp.errors import ConfigError
    from miles_lp.policy import emit, get_layout

    heads = int(hf_config.get("num_attention_heads", 1))
    kv = int(hf_config.get("num_key_value_heads") or heads)
    layers = int(hf_config["num_hidden_layers"])
    experts = get_layout(hf_config).num_experts
    problems = []
    if heads % mp.tp or kv % mp.tp:
        problems.append(f"train.megatron.tp={mp.tp} must divide the attention heads ({heads}) and the key/value "
                        f"heads ({kv})")
    if mp.pp > layers:
        problems.append(f"train.megatron.pp={mp.pp} exceeds the {layers} layers")
    if mp.ep > 1 and (not experts or experts % mp.ep):
        problems.append(f"train.megatron.ep={mp.ep} must divide the {experts} experts")
    if problems:
        raise ConfigError("; ".join(problems))
    return {"kwargs": emit.megatron_kwargs(plan, strict=False), "env": emit.te_env(plan),
            "bf16_overrides": len(emit.megatron_overrides(plan)),
            "parallel": {"tp": mp.tp, "pp": mp.pp, "ep": mp.ep, "etp": mp.etp, "impl": mp.impl},
            # Megatron splits unevenly only with decoder_first/last_pipeline_num_layers (DeepSeek-V3: 61 on 8)
            "uneven_pipeline": bool(layers % mp.pp)}


def _would_refuse(recipe: Recipe, plan=None, hf_config: dict | None = None) -> list[str]:
    """What ``miles-lp run`` itself does not start yet for this recipe (the dry run still validates the rest)."""
    out = []
    if recipe.rollout.backend == "vllm":
        from miles_lp.rollout.vllm import vllm_missing, vllm_python

        if vllm_python() is None:
            out.append("rollout.backend vllm: " + vllm_missing())
        experts = [] if plan is None else [n for n, e in plan.quantized().items() if e.expert is not None]
        if experts:
            out.append("rollout.backend vllm: quantized routed experts are Triton-only in vLLM (not runnable on the "
                       f"CPU build; {len(experts)} expert weights, e.g. {experts[0]}): keep experts bf16 or use "
                       "the reference engine")
        if hf_config is not None and recipe.rollout.engine_tp > 1:  # the model's sizes vs the engine's TP ranks
            from miles_lp.errors import ConfigError
            from miles_lp.launch.runner import check_engine_tp

            formats = [] if plan is None else [e.format for e in plan.quantized().values()]
            try:
                check_engine_tp(recipe.rollout.engine_tp, hf_config, formats, "the model")
            except ConfigError as e:
                out.append(str(e))
    if recipe.rollout.backend == "sglang" and getattr(recipe.rollout, "server", None) == "launch":
        from miles_lp.rollout.sglang_cpu.launch import sglang_missing, sglang_python

        if sglang_python() is None:
            out.append("rollout.server launch: " + sglang_missing())
    from miles_lp.errors import ConfigError
    from miles_lp.launch.actor_sync import check_broadcast
    from miles_lp.launch.engines import check_fleet
    from miles_lp.launch.runner import check_answerable, check_devices, check_transport, sync_env

    # under Ray the devices are the workers' (checked where the learner is built), not this host's; the transport's
    # are this host's either way (the ray / cuda_ipc sync runs in the driver)
    checks = (check_broadcast, check_transport, check_fleet) + (() if recipe.ray.enabled else (check_devices,))
    if not recipe.model.is_tiny:
        checks += (_check_source,)
    # raise for a check the engine can never answer (a stock SGLang server: C1-C4), with this shell's variables
    checks += (lambda r: check_answerable(r, sync_env()),)
    for check in checks:
        try:
            check(recipe)
        except ConfigError as e:
            out.append(str(e))
    if recipe.train.backend == "megatron" and hf_config is not None:
        # the learner's own size rules (tp/ep/etp > 1 run as a MegatronGroup of spawned ranks; pp > 1, the TE
        # path and multi-rank MLA are refused there), read here so the dry run says what the start would
        from miles_lp.train.megatron.parallel import resolve_parallel

        try:
            resolve_parallel(recipe.train.megatron, hf_config)
        except ConfigError as e:
            out.append(str(e))
    if recipe.ray.enabled and hf_config is not None:  # ray.learner against the learner's ranks (one actor each)
        from miles_lp.launch.ray_layout import learner_layout

        try:
            learner_layout(recipe, hf_config)
        except ConfigError as e:
            if str(e) not in out:  # a size the learner refuses is listed once
                out.append(str(e))
    return out


def _learner_placement(recipe: Recipe, hf_config: dict) -> dict[str, Any] | None:
    """What ``ray.learner`` places: the rank actors' layout, or None (one learner actor, or a layout refused)."""
    from miles_lp.errors import ConfigError
    from miles_lp.launch.ray_layout import learner_layout

    try:
        layout = learner_layout(recipe, hf_config)
    except ConfigError:
        return None  # listed in would_refuse_at_start
    return None if layout is None else layout.describe()


def _check_source(recipe: Recipe) -> None:
    """The model folder as the learner reads it at start (``io.validate.validate_source``: config.json,
    every shard header, the index; an already-quantized checkpoint is refused there), its
    ``CheckpointError`` reported as the start would."""
    from miles_lp.errors import CheckpointError, ConfigError
    from miles_lp.io.validate import validate_source

    try:
        validate_source(recipe.model.path)
    except CheckpointError as e:
        raise ConfigError(f"model.path {recipe.model.path}: {e}") from None
