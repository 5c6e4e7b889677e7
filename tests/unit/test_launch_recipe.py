"""The recipe schema: every section strict, errors with file:line, --set overrides validated the same way."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from miles_lp.errors import ConfigError
from miles_lp.launch.recipe import apply_override, load_recipe

GOOD = """\
model: {path: "tiny:qwen3", num_layers: 2}
precision:
  default: mxfp8
train: {lr: 1.0e-3, device: cpu}
rollout: {max_response_len: 4}
rl:
  group_size: 4
  rollout_correction: {rollout_is: token, rollout_is_threshold: 2.0}
task: {name: copy}
ray: {enabled: false, placement: split}
logging: {output_dir: /tmp/x}
steps: 3
seed: 1
checkpoint_every: 2
"""


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_good_recipe_parses_every_section(tmp_path):
    r = load_recipe(write(tmp_path, GOOD))
    assert r.model.is_tiny and r.model.arch == "qwen3"
    assert r.precision.default.value == "mxfp8"
    assert r.train.lr == 1e-3 and r.rl.group_size == 4 and r.rl.rollout_correction.rollout_is == "token"
    assert r.ray.placement == "split" and r.steps == 3 and r.seed == 1 and r.checkpoint_every == 2
    assert r.rollout.max_response_len == 4
    assert "precision" in r.to_yaml()


@pytest.mark.parametrize("bad, match", [
    (GOOD + "stepz: 3\n", r"r.yaml:15: 'stepz': unknown section 'stepz' \(did you mean 'steps'"),
    (GOOD.replace("train: {lr: 1.0e-3", "train: {lrr: 1.0e-3"), r"r.yaml:4: 'train.lrr': unknown key"),
    (GOOD.replace("group_size: 4", "group_size: 1"), r"r.yaml:7: 'rl.group_size'"),
    (GOOD.replace("tiny:qwen3", "tiny:qwen4"), r"r.yaml:1: 'model.path': unknown tiny architecture 'qwen4'"),
    (GOOD.replace("default: mxfp8", "default: mxfp9"), r"r.yaml:3: 'precision.default'"),
    (GOOD.replace("placement: split", "placement: spread"), r"'ray.placement': must be one of 'colocate'"),
    (GOOD.replace("name: copy", "name: cpy"), r"'task.name': unknown task 'cpy'"),
    (GOOD.replace("steps: 3", "steps: 0"), r"r.yaml:12: 'steps': must be >= 1"),
    (GOOD.replace("max_response_len: 4", "max_respons_len: 4"), r"'rollout.max_respons_len': unknown key"),
    (GOOD + "sync: {bucket_mbb: 1}\n", r"'sync.bucket_mbb': unknown key"),
    (GOOD + "sync: {checks: {gird: raise}}\n", r"r.yaml:15: 'sync.checks.gird': unknown key 'gird' \(did you mean"),
    (GOOD.replace("rollout: {max_response_len: 4}", "rollout: {sampling: {temprature: 1.0}}"),
     r"r.yaml:5: 'rollout.sampling.temprature': unknown key 'temprature' \(did you mean 'temperature'"),
    (GOOD.replace("default: mxfp8", "default: mxfp8\n  defualt_backward: quantized"), r"r.yaml:4: 'precision.defualt"),
    (GOOD.replace("steps: 3\n", ""), r"missing section 'steps'"),
])
def test_bad_recipes_name_file_line_and_key(tmp_path, bad, match):
    with pytest.raises(ConfigError, match=match):
        load_recipe(write(tmp_path, bad))


def test_the_sections_are_typed(tmp_path):
    """precision / rollout / sync are the sections' own classes (no untyped fallback section)."""
    import typing

    from miles_lp.launch.recipe import Recipe
    from miles_lp.policy.policy import PrecisionPolicy
    from miles_lp.rollout.config import RolloutConfig
    from miles_lp.sync.config import SyncConfig

    hints = typing.get_type_hints(Recipe)
    assert hints["precision"] is PrecisionPolicy and hints["sampler_precision"] == PrecisionPolicy | None
    assert hints["rollout"] is RolloutConfig and hints["sync"] is SyncConfig
    assert typing.Any not in {hints[k] for k in ("precision", "rollout", "sync", "train", "rl", "task", "ray")}
    r = load_recipe(write(tmp_path, GOOD))
    assert isinstance(r.rollout, RolloutConfig) and isinstance(r.sync, SyncConfig)
    assert isinstance(r.precision, PrecisionPolicy) and r.sampler_precision is None


def test_set_overrides_are_validated(tmp_path):
    p = write(tmp_path, GOOD)
    r = load_recipe(p, ["rl.kl_coef=0.01", "steps=7", "rl.rollout_correction.rollout_rs=seq_mean_k3",
                        "rl.rollout_correction.rollout_rs_threshold=0.01"])
    assert r.rl.kl_coef == 0.01 and r.steps == 7 and r.rl.rollout_correction.rs_bounds == {"seq_mean_k3": (None, 0.01)}
    assert r.raw["rl"]["kl_coef"] == 0.01  # the effective recipe holds the override
    with pytest.raises(ConfigError, match=r"--set rl.kl_cof=0.1: 'rl.kl_cof': unknown key 'kl_cof' \(did you mean"):
        load_recipe(p, ["rl.kl_cof=0.1"])
    with pytest.raises(ConfigError, match=r"--set steps=abc: 'steps': expected an integer"):
        load_recipe(p, ["steps=abc"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_recipe(p, ["steps"])
    with pytest.raises(ConfigError, match="'steps' is a int, not a section"):
        apply_override({"steps": 3}, "steps.x=1")


def test_routing_replay_needs_an_moe_model_and_a_learner_with_the_hook(tmp_path):
    f = write(tmp_path, GOOD)
    with pytest.raises(ConfigError, match=r"--set rl.routing_replay=true: 'rl.routing_replay'.*tiny:qwen3 is dense "
                                          r"\(no MoE layers\).*set rl.routing_replay: false"):
        load_recipe(f, ["rl.routing_replay=true"])
    import dataclasses

    from miles_lp.launch import recipe as recipe_mod

    # both learners replay (embedded, Megatron); a backend outside REPLAY_BACKENDS is refused
    assert load_recipe(f, ["rl.routing_replay=true", "model.path=tiny:qwen3_moe", "train.backend=megatron"]).rl.routing_replay
    r = load_recipe(f, ["rl.routing_replay=true", "model.path=tiny:qwen3_moe"])
    with pytest.raises(ConfigError, match=r"routing replay \(Miles R3\) is not implemented in the other learner"):
        recipe_mod._check_routing_replay(r.model, dataclasses.replace(r.train, backend="other"), r.rl,
                                         recipe_mod.Where("<t>", "rl").child("routing_replay"))
    r = load_recipe(f, ["rl.routing_replay=true", "model.path=tiny:qwen3_moe"])
    assert r.rl.routing_replay
    # an HF folder: its config.json tells dense from MoE
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(ConfigError, match=r"is dense"):
        load_recipe(f, ["rl.routing_replay=true", f"model.path={dense}"])
    (dense / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts": 8}')
    assert load_recipe(f, ["rl.routing_replay=true", f"model.path={dense}"]).rl.routing_replay
    text = GOOD.replace("  group_size: 4\n", "  group_size: 4\n  routing_replay: true\n")
    with pytest.raises(ConfigError, match=r"r2.yaml:\d+: 'rl.routing_replay'"):
        load_recipe(write(tmp_path, text, "r2.yaml"))


def test_shipped_tiny_recipes_parse():
    from pathlib import Path

    recipes = sorted(Path(__file__).resolve().parents[2].glob("recipes/tiny-*.yaml"))
    assert recipes, "no recipes/tiny-*.yaml"
    for p in recipes:
        load_recipe(p)


@pytest.mark.parametrize("sets, match", [
    (["rollout.sampling.top_p=0.9"], r"rollout.sampling.top_p.*RL samples at top_p 1.0 only"),
    (["rollout.sampling.top_k=20"], r"rollout.sampling.top_k.*RL samples at top_k -1 only"),
    (["rollout.sampling.temperature=0"], r"rollout.sampling.temperature.*greedy"),
    (["rollout.sampling.temperature=0.6", "rollout.backend=vllm", "rollout.device=auto"],
     r"rollout.sampling.temperature.*vLLM backend reports the raw"),
    (["rollout.sampling.temperature=0.6", "rollout.backend=sglang", "rollout.url=http://127.0.0.1:1",
      "rollout.server=sglang", "rollout.device=auto"], r"rollout.sampling.temperature.*stock SGLang server"),
    (["rollout.sampling.temperature=0.6", "train.logits_temperature=1.0"],
     r"train.logits_temperature.*differs from rollout.sampling.temperature 0.6"),
])
def test_rl_refuses_sampling_the_learner_cannot_score(sets, match):
    """The learner scores tokens under softmax(logits / T) of the whole vocabulary: truncated or greedy sampling,
    or a learner temperature other than the sampler's, would bias GRPO silently."""
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-mxfp8.yaml"
    with pytest.raises(ConfigError, match=match):
        load_recipe(recipe, sets)


def test_the_learner_follows_the_sampling_temperature():
    from pathlib import Path

    from miles_lp.launch.runner import sampling_for
    from miles_lp.rl.tasks import make_task

    path = Path(__file__).resolve().parents[2] / "recipes" / "tiny-mxfp8.yaml"
    r = load_recipe(path, ["rollout.sampling.temperature=0.6"])
    assert r.train.logits_temperature == 0.6
    assert sampling_for(r, make_task(r.task)).logprob_mode == "processed"  # the tempered log-prob, as the learner
    r1 = load_recipe(path)
    assert r1.train.logits_temperature == 1.0 and sampling_for(r1, make_task(r1.task)).logprob_mode == "raw"


@pytest.mark.parametrize("url, match", [
    ("localhost:30000", r"'localhost:30000' has no scheme: write http://localhost:30000"),
    ("ftp://x:21", r"the scheme must be http or https, got 'ftp'"),
    ("http://:30000", r"names no host"),
    ("http://localhost", r"names no port"),
    ("http://localhost:99999", r"the port is not a number in 0-65535"),
    ("http://localhost:30000/?a=1", r"base address only"),
])
def test_rollout_url_is_checked_at_parse_time_with_file_line(tmp_path, url, match):
    """A bad rollout.url is refused while parsing (file:line, or the --set), not at the start-time
    probe after the model was built and converted."""
    text = GOOD.replace("rollout: {max_response_len: 4}", f"rollout: {{max_response_len: 4, backend: sglang, url: '{url}'}}")
    with pytest.raises(ConfigError, match=r"r.yaml:5: 'rollout.url': .*" + match):
        load_recipe(write(tmp_path, text))
    with pytest.raises(ConfigError, match=rf"--set rollout.url={re.escape(url)}: .*'rollout.url': .*" + match):
        load_recipe(write(tmp_path, GOOD), ["rollout.backend=sglang", f"rollout.url={url}"])
    for good in ("http://127.0.0.1:30000", "https://sglang.internal:8443/", "http://[::1]:30000"):
        assert load_recipe(write(tmp_path, GOOD), ["rollout.backend=sglang", f"rollout.url={good}"]).rollout.url == good


def test_tiny_only_model_keys_are_refused_for_an_hf_checkpoint(tmp_path):
    """Num_layers / seed other than their defaults with an HF checkpoint path are refused (as
    overrides is), not silently ignored; tiny models take them."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen3"}')
    for key, value in (("num_layers", 4), ("seed", 3)):
        text = GOOD.replace('model: {path: "tiny:qwen3", num_layers: 2}', f'model: {{path: "{hf}", {key}: {value}}}')
        with pytest.raises(ConfigError, match=rf"r.yaml:1: 'model.{key}': {key} {value} applies to tiny:<arch> models "
                                              rf"only .* remove model.{key}"):
            load_recipe(write(tmp_path, text))
        with pytest.raises(ConfigError, match=rf"--set model.{key}={value}: 'model.{key}'"):
            load_recipe(write(tmp_path, GOOD), [f"model.path={hf}", f"model.{key}={value}"])
        assert getattr(load_recipe(write(tmp_path, GOOD), [f"model.{key}={value}"]).model, key) == value  # tiny
    with pytest.raises(ConfigError, match=r"'model.overrides': overrides apply to tiny:<arch> models only"):
        load_recipe(write(tmp_path, GOOD), [f"model.path={hf}", "model.overrides={hidden_size: 8}"])
    assert load_recipe(write(tmp_path, GOOD), [f"model.path={hf}"]).model.path == str(hf)  # defaults: accepted


def test_a_mapping_override_merges_into_its_section():
    """`--set 'sync.checks={self_check: raise}'` reset every other check to warn; it merges now, and
    `=null` first still replaces the section whole."""
    from miles_lp.launch.recipe import load_recipe

    base = load_recipe("recipes/tiny-mxfp8.yaml").sync.checks
    got = load_recipe("recipes/tiny-mxfp8.yaml", ["sync.checks={self_check: raise}"]).sync.checks
    assert got.self_check == "raise" and (got.layer_audit, got.grid, got.storage) == (
        base.layer_audit, base.grid, base.storage) == ("raise", "raise", "raise")
    whole = load_recipe("recipes/tiny-mxfp8.yaml", ["sync.checks=null", "sync.checks={self_check: raise}"]).sync.checks
    assert whole.self_check == "raise" and whole.grid == "warn"
    r = load_recipe("recipes/tiny-mxfp8.yaml", ["rl={kl_coef: 0.01}"])
    assert r.rl.kl_coef == 0.01 and r.rl.group_size == load_recipe("recipes/tiny-mxfp8.yaml").rl.group_size


def test_a_plan_error_from_a_set_rule_names_that_set(tmp_path):
    """A compile-level error caused by a rule a --set gave named the recipe file, which has no such rule."""
    import pytest

    from miles_lp.checkpoint.tiny import make_tiny_model
    from miles_lp.errors import MilesLPError
    from miles_lp.launch.recipe import load_recipe
    from miles_lp.launch.runner import plan_for

    model = make_tiny_model("qwen3", tmp_path / "m", num_layers=1)
    rule = 'precision.rules=[{match: "*.q_proj*", format: bf16}]'
    r = load_recipe("recipes/tiny-mxfp8.yaml", [rule])
    with pytest.raises(MilesLPError, match=r"^--set precision\.rules=.*fused shards") as err:
        plan_for(r, model)
    assert "tiny-mxfp8.yaml" not in str(err.value)
    assert plan_for(load_recipe("recipes/tiny-mxfp8.yaml"), model) is not None


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_fp8_block_pow2_with_a_real_engine_is_refused_naming_pow2_scales(backend):
    """The engines' FP8 blockwise CPU methods quantize activations with fp32 tile scales: a learner on the
    power-of-two grid is refused when the recipe is read, not found out by the checks."""
    path = Path(__file__).resolve().parents[2] / "recipes" / f"tiny-fp8-blockwise-e2e-{backend}.yaml"
    assert load_recipe(str(path)).precision.default.value == "fp8_block"  # fp32 scales: served
    with pytest.raises(ConfigError, match=rf"pow2_scales.*fp8_block with pow2_scales and rollout.backend {backend}"):
        load_recipe(str(path), ["precision.pow2_scales=true"])
