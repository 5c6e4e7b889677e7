"""One schema for the whole recipe file, strict like ``precision:``.

    model: {path: "tiny:qwen3", num_layers: 2}      # an HF checkpoint dir, or tiny:<arch> built locally
    precision: {default: mxfp8, ...}                 # miles_lp.policy (docs/precision_policy.md)
    sampler_precision: null                          # comparison arms only: the sampler's own grid
    train: {lr: 1.0e-3, ...}                         # miles_lp.train.config.TrainConfig
    rollout: {backend: reference, ...}               # the rollout engine's section
    sync: {checks: {...}, ...}                       # miles_lp.sync.config.SyncConfig
    rl: {group_size: 8, ...}                         # miles_lp.rl.config.RLConfig
    task: {name: copy, ...}                          # miles_lp.rl.tasks.TaskConfig
    ray: {enabled: false, ...}                       # RayConfig below
    logging: {output_dir: runs, tensorboard: false}
    runtime: {kernels: auto, ...}                    # miles_lp.config.RuntimeConfig: how the code runs, not what
    steps: 60
    seed: 0
    checkpoint_every: 20

Unknown sections and keys are refused with ``file:line`` and a close-match suggestion; ``--set key=value``
overrides (the value read as YAML) are applied to the parsed mapping and validated the same way, an error
naming the ``--set``. Nothing starts before the whole recipe has parsed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from miles_lp.config import (
    RuntimeConfig,
    Where,
    YamlDoc,
    check_keys,
    load_yaml,
    load_yaml_text,
    parse_dataclass,
    suggest,
)
from miles_lp.errors import ConfigError
from miles_lp.policy.policy import PrecisionPolicy, parse_policy
from miles_lp.rl.config import RLConfig
from miles_lp.rl.tasks import TaskConfig
from miles_lp.rollout.config import RolloutConfig, parse_rollout_config
from miles_lp.sync.config import SyncConfig, parse_sync_config
from miles_lp.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """``path``: an HF checkpoint folder (``~`` expanded, made absolute at parse: ``normalize_paths``), or
    ``tiny:<arch>`` (built with ``checkpoint.tiny`` at run start).
    ``num_layers`` / ``overrides`` (transformers config fields such as ``hidden_size``) apply to tiny models."""

    path: str
    num_layers: int = 2
    seed: int = 0
    overrides: dict[str, int] = dataclasses.field(default_factory=dict)

    def _validate(self, where: Where) -> None:
        if self.is_tiny:
            from miles_lp.checkpoint.tiny import ARCHS

            if self.arch not in ARCHS:
                raise where.child("path").error(f"unknown tiny architecture '{self.arch}'"
                                                f"{suggest(self.arch, ARCHS)}; tiny:<arch> with arch in "
                                                f"{', '.join(ARCHS)}")
            if self.num_layers < 1:
                raise where.child("num_layers").error(f"must be >= 1, got {self.num_layers}")
            for k, v in self.overrides.items():
                if v < 1:
                    raise where.child("overrides").child(k).error(f"must be >= 1, got {v}")
        elif self.overrides:
            raise where.child("overrides").error("overrides apply to tiny:<arch> models only; an HF checkpoint "
                                                 "keeps its config.json")
        else:  # an HF checkpoint is used as is; a truncation or seed asked for must not be ignored
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for key, what in (("num_layers", "the layers of a model built here"),
                              ("seed", "the random init of a model built here")):
                if getattr(self, key) != defaults[key]:
                    raise where.child(key).error(
                        f"{key} {getattr(self, key)} applies to tiny:<arch> models only ({what}); the HF checkpoint "
                        f"{self.path} is used as is, with its config.json and weights: remove model.{key} (a smaller "
                        "model for a smoke test: a tiny:<arch> path, or a truncated checkpoint folder)")

    @property
    def is_tiny(self) -> bool:
        return self.path.startswith("tiny:")

    @property
    def arch(self) -> str:
        return self.path.removeprefix("tiny:")


@dataclasses.dataclass(frozen=True)
class RoleResources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0

    def _validate(self, where: Where) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise where.error("resources must be >= 0")


@dataclasses.dataclass(frozen=True)
class LearnerResources(RoleResources):
    """The learner's share. A Megatron learner of several ranks runs one Ray actor per rank
    (``launch/ray_layout.py``): ``nodes`` x ``gpus_per_node`` GPUs, one rank each; ``num_cpus`` are per node.
    ``gpus_per_node: null`` = ``num_gpus``; ``nodes: null`` = the ranks / ``gpus_per_node`` (1 on CPU)."""

    nodes: int | None = None
    gpus_per_node: int | None = None

    def _validate(self, where: Where) -> None:
        super()._validate(where)
        if self.nodes is not None and self.nodes < 1:
            raise where.child("nodes").error(f"must be >= 1, got {self.nodes}")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise where.child("gpus_per_node").error(f"must be >= 0, got {self.gpus_per_node}")


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """``enabled: false`` runs the same step in this process (what most tests use)."""

    enabled: bool = False
    address: str | None = None  # None: start a local cluster; "auto" or "host:port": connect
    placement: Literal["colocate", "split"] = "colocate"
    learner: LearnerResources = dataclasses.field(default_factory=LearnerResources)
    rollout: RoleResources = dataclasses.field(default_factory=RoleResources)
    num_cpus: int | None = None  # local cluster only: CPUs Ray may use (None: Ray's default)

    def _validate(self, where: Where) -> None:
        if self.num_cpus is not None and self.num_cpus < 1:
            raise where.child("num_cpus").error(f"must be >= 1, got {self.num_cpus}")
        if self.address is not None and self.num_cpus is not None:
            raise where.child("num_cpus").error("num_cpus sizes a local cluster; remove it when an address is given")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    output_dir: str = "runs"
    run_name: str | None = None  # default: <recipe stem>-<UTC time>
    tensorboard: bool = False
    progress: bool = True  # a tqdm bar with the headline numbers


@dataclasses.dataclass(frozen=True)
class FleetSection:
    """``rollout.engines`` / ``rollout.urls``: how many rollout engines serve the run (``launch/engines.py``).

    ``engines: N`` starts N engines of ``rollout.backend`` (reference, vllm: each its own engine; under Ray each its
    own actor). ``urls: [u1, u2, ...]`` (backend sglang) names N running servers, one engine each; an sglang-router
    given as ``rollout.url`` is replaced at start by its servers (``launch/router.py``)."""

    engines: int = 1
    urls: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.urls) or self.engines


SECTIONS = ("model", "precision", "sampler_precision", "train", "rollout", "sync", "rl", "task", "ray", "logging",
            "runtime", "steps", "seed", "checkpoint_every")


@dataclasses.dataclass(frozen=True)
class Recipe:
    model: ModelConfig
    precision: PrecisionPolicy
    sampler_precision: PrecisionPolicy | None  # a sampler on its own grid (comparison arms); None: the shared grid
    train: TrainConfig
    rollout: RolloutConfig
    sync: SyncConfig
    rl: RLConfig
    task: TaskConfig
    ray: RayConfig
    logging: LoggingConfig
    steps: int
    seed: int
    checkpoint_every: int
    source: str
    raw: dict[str, Any]  # the effective mapping (file + overrides): saved in the run folder
    # the source file's line of every key path (``sync.checks.grid``) and the ``--set`` texts applied after it: a
    # refusal made at start, after parsing, still names the line or the override that set the key
    lines: Mapping[str, int] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    overrides: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    fleet: FleetSection = dataclasses.field(default_factory=FleetSection)  # rollout.engines / rollout.urls
    # the run-time switches (``miles_lp.config.use_runtime`` makes them the process's, at run start)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

    def origin(self, key: str) -> tuple[str, int | None]:
        """Where ``key`` (a dotted path) got its value: ``("--set k=v", None)`` for the last override that set
        it or a section above it, else ``("FILE:LINE", LINE)`` (``(FILE, None)`` when the file does not have it)."""
        for text in reversed(self.overrides):
            k = text.partition("=")[0].strip()
            if key == k or key.startswith(k + "."):
                return f"--set {text}", None
        line = self.lines.get(key)
        return (f"{self.source}:{line}" if line is not None else self.source), line

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.raw, sort_keys=False)


def _fleet(mapping: Any, where: Where) -> tuple[Any, FleetSection]:
    """(the rollout mapping without the fleet's keys, the fleet section), validated naming the keys."""
    if not isinstance(mapping, dict):
        return mapping, FleetSection()
    rest = {k: v for k, v in mapping.items() if k not in ("engines", "urls")}
    engines = mapping.get("engines", 1)
    if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
        raise where.child("engines").error(f"must be an integer >= 1, got {engines!r}")
    urls = mapping.get("urls")
    if urls is None:
        if engines > 1 and rest.get("backend") == "sglang":
            raise where.child("engines").error(f"engines: {engines} with backend sglang: name each server in urls "
                                               "([http://HOST:PORT, ...]; one url is one engine, a server or a router)")
        return rest, FleetSection(engines=engines)
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u for u in urls):
        raise where.child("urls").error(f"must be a list of server URLs (http://HOST:PORT), got {urls!r}")
    if rest.get("backend") != "sglang":
        raise where.child("urls").error(f"urls names running SGLang servers: set backend: sglang (backend is "
                                        f"{rest.get('backend', 'reference')})")
    if rest.get("url") is not None:
        raise where.child("urls").error("give either url (one server, or one sglang-router in front of several) or "
                                        "urls (several servers), not both")
    if "engines" in mapping and engines != len(urls):
        raise where.child("engines").error(f"engines: {engines} but urls names {len(urls)} servers; remove engines "
                                           "(urls gives the count)")
    if len(set(urls)) != len(urls):
        raise where.child("urls").error(f"a server is named twice: {urls}")
    rest["url"] = urls[0]  # the rollout section's own checks (scheme, host, port) read the first; each is checked
    return rest, FleetSection(engines=len(urls), urls=tuple(urls))


def _runtime(mapping: Any, where: Where) -> RuntimeConfig:
    """The ``runtime:`` section. Every process of a run applies it at its start: ``miles-lp run``'s own, the Ray
    actors (``ray_launcher``), the Megatron ranks (``RankSpec.runtime``) and the vLLM / SGLang engine processes
    (``config.child_runtime_env``)."""
    return parse_dataclass(RuntimeConfig, mapping, where)


def _sampler_policy(mapping: Any, where: Where) -> PrecisionPolicy | None:
    if mapping is None:
        return None
    from miles_lp.launch.sampler import check_sampler_policy

    pol = parse_policy(mapping, where)
    try:
        check_sampler_policy(pol)
    except ConfigError as exc:
        raise where.error(str(exc)) from None
    return pol


def _int(value: Any, where: Where, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise where.error(f"expected an integer, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise where.error(f"must be >= {minimum}, got {value}")
    return value


#: tiny architectures with MoE layers (``checkpoint.tiny``); routing replay needs one
MOE_TINY_ARCHS = ("qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral")
_MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _is_moe_model(model: ModelConfig) -> bool | None:
    """True / False when the recipe tells (a tiny arch, or an HF folder's config.json); None when it cannot."""
    if model.is_tiny:
        return model.arch in MOE_TINY_ARCHS
    cfg = Path(model.path) / "config.json"
    try:
        import json

        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None  # the learner checks when it sees the routes
    data = data.get("text_config", data)
    return any(isinstance(data.get(k), int) and data[k] > 0 for k in _MOE_CONFIG_KEYS)


def _check_routing_replay(model: ModelConfig, train: TrainConfig, rl: RLConfig, where: Where) -> None:
    """``rl.routing_replay`` needs an MoE model and a learner with the replay hook (``REPLAY_BACKENDS``: the
    embedded trainer and the Megatron learner)."""
    if not rl.routing_replay:
        return
    from miles_lp.train.routing_replay import REPLAY_BACKENDS

    if train.backend not in REPLAY_BACKENDS:
        raise where.error(f"routing replay (Miles R3) is not implemented in the {train.backend} learner yet (its "
                          "MoE routers have no replay hook); use train.backend: embedded or set "
                          "rl.routing_replay: false")
    if _is_moe_model(model) is False:
        raise where.error(f"model {model.path} is dense (no MoE layers): there are no routed experts to replay; set "
                          "rl.routing_replay: false")


def _check_url(rollout: RolloutConfig, where: Where) -> None:
    """``rollout.url`` (backend sglang): ``http(s)://HOST:PORT`` checked here, before the model is built or
    converted, not at the start-time probe."""
    import urllib.parse

    url = rollout.url
    if not url:
        return
    example = "e.g. http://localhost:30000 (miles-lp serve's and SGLang's default port)"
    if "://" not in url:
        raise where.error(f"{url!r} has no scheme: write http://{url.lstrip('/')} (https:// for a TLS server)")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise where.error(f"{url!r}: the scheme must be http or https, got {parts.scheme!r} ({example})")
    try:
        port = parts.port
    except ValueError:
        raise where.error(f"{url!r}: the port is not a number in 0-65535 ({example})") from None
    if not parts.hostname:
        raise where.error(f"{url!r} names no host ({example})")
    if port is None:
        raise where.error(f"{url!r} names no port ({example})")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise where.error(f"{url!r}: give the server's base address only (no query, fragment or user; the API key "
                          f"comes from MILES_LP_API_KEY / SGLANG_API_KEY) ({example})")


def _check_param_dtype(train: TrainConfig, rollout: RolloutConfig, where: Where) -> None:
    """``train.param_dtype: bf16`` (BF16 compute copies of FP32 masters) needs an engine computing in BF16 too
    (``rollout.dtype: auto`` = ``train.compute_dtype`` in the runner); an fp32 engine is refused as a likely
    mistake."""
    if not train.mixed_precision:
        return
    if rollout.dtype == "fp32":  # auto follows train.compute_dtype in the runner (make_engine)
        raise where.error(f"the learner computes in {train.compute_dtype} (BF16 copies of the {train.master_dtype} "
                          f"master) but rollout.dtype is fp32; set rollout.dtype: auto or {train.compute_dtype} so the "
                          "engine computes the same policy")


def _check_combinations(data: dict[str, Any], train: TrainConfig, rollout: RolloutConfig, rl: RLConfig,
                        ray: RayConfig, w: Where) -> None:
    """Sections that parse alone but cannot run together: refused here, before anything is built."""
    if data.get("sampler_precision") is not None:
        where = w.child("sampler_precision")
        if ray.enabled:
            raise where.error("a comparison arm runs without Ray only so far (the sampler's own re-quantization "
                              "reads the learner's master weights in-process); set ray.enabled: false")
        if train.backend != "embedded":
            raise where.error(f"a comparison arm re-quantizes the embedded trainer's weights by their HF names; the "
                              f"{train.backend} learner's are not (yet): use train.backend: embedded")
    sampling = rollout.sampling
    # the learner's log-probs (old policy, ratio, TIS/IcePop, rollout_corr/*) are those of the T = 1,
    # untruncated policy; samples drawn at another temperature or truncated by top-k/top-p would be scored
    # as if drawn from it (verl/slime divide the learner's logits by T; not implemented here)
    where = w.child("rollout").child("sampling")
    for key, value, default in (("top_p", sampling.top_p, 1.0), ("top_k", sampling.top_k, -1)):
        if value != default:
            raise where.child(key).error(
                f"{key} {value}: RL samples at {key} {default} only: the learner computes the log-probs of the "
                f"untruncated policy (the GRPO ratio, TIS/IcePop weights and rollout_corr/* use them), so "
                f"tokens drawn from a truncated distribution would be scored as if drawn from the whole one. "
                f"Set rollout.sampling.{key}: {default}")
    t = sampling.temperature
    if t == 0:
        raise where.child("temperature").error(
            "temperature 0 (greedy): every response of a group would be the same and GRPO's advantages zero; "
            "use a temperature > 0 (1.0: the policy itself)")
    if t != 1.0 and rollout.backend == "vllm":
        raise where.child("temperature").error(
            f"temperature {t:g}: this vLLM backend reports the raw (T = 1) log-probs only, and the learner "
            "scores tokens at the sampling temperature; use rollout.backend reference or sglang, or temperature 1")
    if t != 1.0 and rollout.backend == "sglang" and rollout.server == "sglang":
        raise where.child("temperature").error(
            f"temperature {t:g} with rollout.server sglang: which log-prob a stock SGLang server reports at a "
            "temperature != 1 (after temperature, or the original with SGLANG_RETURN_ORIGINAL_LOGPROB) depends on "
            "its version and environment, and was not verified here; use temperature 1 or rollout.server miles-lp")
    if t != train.logits_temperature and "logits_temperature" in (data.get("train") or {}):
        raise w.child("train").child("logits_temperature").error(
            f"{train.logits_temperature:g} differs from rollout.sampling.temperature {t:g}: the learner must "
            "score tokens at the temperature they were sampled at (drop train.logits_temperature: it follows "
            "the rollout's)")
    if rl.routing_replay and rollout.backend == "vllm":
        raise w.child("rl").child("routing_replay").error(
            "routing replay needs the routed experts of every generated token, which vLLM's offline engine does not "
            "report; use rollout.backend: reference (or sglang, which returns them) or set rl.routing_replay: false")


def _check_engine_formats(precision: PrecisionPolicy, rollout: RolloutConfig, where: Where) -> None:
    """A format the chosen engine cannot serve here is refused before anything is built (not at its start)."""
    from miles_lp.formats.spec import Format

    formats = {precision.default, *(r.format for r in precision.rules if getattr(r, "format", None) is not None)}
    pow2 = precision.pow2_scales or any(getattr(r, "pow2_scales", None) for r in precision.rules)
    if Format.FP8_BLOCK in formats and rollout.backend in ("vllm", "sglang") and pow2:
        # the engines' FP8 blockwise methods (rollout/vllm_plugin.py, rollout/sglang_cpu/linear.py) quantize
        # activations with fp32 tile scales: a `quant_method: fp8` checkpoint has no key for power-of-two ones
        raise where.child("pow2_scales").error(
            f"fp8_block with pow2_scales and rollout.backend {rollout.backend}: the {rollout.backend} CPU method "
            "quantizes activations in 1x128 tiles with fp32 scales (a 'quant_method: fp8' checkpoint cannot say "
            "power-of-two), not the learner's power-of-two grid; set precision.pow2_scales: false or use "
            "rollout.backend reference")


#: the recipe's path-valued keys (section, key): ``~`` expanded at parse time
PATH_KEYS = (("model", "path"), ("task", "path"), ("logging", "output_dir"))
#: of these, the model and the task are also made absolute (against the working directory, as they were always
#: read): the run's recipe.yaml then names the very folder and file the run started from, so a resume from
#: another working directory reads the same ones. ``logging.output_dir`` stays as written: the
#: run folder itself is made absolute (``RunDir``) and a resume never reads it.
ABSOLUTE_KEYS = (("model", "path"), ("task", "path"))


def normalize_paths(data: dict[str, Any], w: Where) -> dict[str, Any]:
    """``data`` with ``PATH_KEYS`` expanded (``~``, ``~user``) and ``ABSOLUTE_KEYS`` made absolute; a new mapping
    (sections copied where changed), so ``Recipe.raw`` and the saved recipe.yaml record the paths used. A
    ``tiny:<arch>`` model path and values that are not strings (refused by the schema) are left alone."""
    out = dict(data)
    for section, key in PATH_KEYS:
        sec = data.get(section)
        value = sec.get(key) if isinstance(sec, dict) else None
        if not isinstance(value, str) or not value or (section == "model" and value.startswith("tiny:")):
            continue
        try:
            path = Path(value).expanduser()
        except RuntimeError as exc:  # ~user of no such user, or no home folder
            raise w.child(section).child(key).error(f"{value!r}: cannot expand '~' ({exc}); write the path out") from None
        if (section, key) in ABSOLUTE_KEYS:
            path = path.absolute()
        if str(path) != value:
            out[section] = {**sec, key: str(path)}
    return out


def parse_recipe(doc: YamlDoc) -> Recipe:
    """Build a ``Recipe`` from a loaded YAML document; every section is validated here (paths: ``normalize_paths``)."""
    data = doc.data
    w = doc.where()
    if not isinstance(data, dict):
        raise ConfigError("a recipe must be a mapping of sections (model, precision, train, ...)", source=doc.source,
                          line=1)
    data = normalize_paths(data, w)
    check_keys(data, SECTIONS, w, what="section")
    for required in ("model", "precision", "steps"):
        if required not in data:
            raise ConfigError(f"missing section '{required}'", source=doc.source, line=1)
    model = parse_dataclass(ModelConfig, data["model"], w.child("model"))
    train = parse_dataclass(TrainConfig, data.get("train"), w.child("train"))
    rl = parse_dataclass(RLConfig, data.get("rl"), w.child("rl"))
    _check_routing_replay(model, train, rl, w.child("rl").child("routing_replay"))
    rollout_map, fleet = _fleet(data.get("rollout"), w.child("rollout"))
    rollout = parse_rollout_config(rollout_map, w.child("rollout"))
    _check_url(rollout, w.child("rollout").child("url"))
    for i, url in enumerate(fleet.urls[1:], 1):
        _check_url(dataclasses.replace(rollout, url=url), w.child("rollout").child("urls").child(str(i)))
    _check_param_dtype(train, rollout, w.child("train").child("param_dtype"))
    ray = parse_dataclass(RayConfig, data.get("ray"), w.child("ray"))
    _check_combinations(data, train, rollout, rl, ray, w)
    sampling = rollout.sampling
    if sampling.temperature != train.logits_temperature:
        train = dataclasses.replace(train, logits_temperature=float(sampling.temperature))  # verl's actor temperature
    precision = parse_policy(data["precision"], w.child("precision"))
    _check_engine_formats(precision, rollout, w.child("precision"))
    return Recipe(
        model=model,
        precision=precision,
        sampler_precision=_sampler_policy(data.get("sampler_precision"), w.child("sampler_precision")),
        train=train,
        rollout=rollout,
        sync=parse_sync_config(data.get("sync"), w.child("sync")),
        rl=rl,
        task=parse_dataclass(TaskConfig, data.get("task"), w.child("task")),
        ray=ray,
        logging=parse_dataclass(LoggingConfig, data.get("logging"), w.child("logging")),
        steps=_int(data["steps"], w.child("steps"), 1),
        seed=_int(data.get("seed", 0), w.child("seed"), 0),
        checkpoint_every=_int(data.get("checkpoint_every", 0), w.child("checkpoint_every"), 0),
        source=doc.source,
        raw=copy.deepcopy(data),
        lines=dict(doc.lines),
        fleet=fleet,
        runtime=_runtime(data.get("runtime"), w.child("runtime")),
    )


def apply_override(data: dict[str, Any], text: str) -> None:
    """``key.sub=value`` (value read as YAML) into ``data``, in place. Intermediate mappings are created; a mapping
    value merges into an existing mapping (``_merged``), anything else replaces the value."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. rl.kl_coef=0.01")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: the value is not valid YAML: {exc}") from None
    parts = key.split(".")
    node = data
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {text!r}: '{'.'.join(parts[:i + 1])}' is a {type(nxt).__name__}, not a "
                              "section")
        node = nxt
    old = node.get(parts[-1])
    if isinstance(parsed, dict) and isinstance(old, dict):
        # a mapping merges into the section it names (`--set 'sync.checks={self_check: raise}'` used to
        # reset every other check to its default): the keys it names change, the others keep the recipe's value.
        # To replace a section whole, set it to null first (`--set sync.checks=null --set 'sync.checks={...}'`)
        node[parts[-1]] = _merged(old, parsed)
    else:
        node[parts[-1]] = parsed


def _merged(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``new``'s keys set, mappings merged recursively (lists and scalars replaced)."""
    out = dict(base)
    for k, v in new.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read and validate ``path``, then apply every ``--set`` override and validate again (overrides that only
    make sense together, such as ``rollout_rs`` and its threshold, go in one run). An error in the overridden
    recipe names the override that set the offending key (or all of them)."""
    doc = load_yaml(path)
    recipe = parse_recipe(doc)
    if not overrides:
        return recipe
    data = copy.deepcopy(doc.data)
    for text in overrides:
        apply_override(data, text)
    try:
        # the overridden mapping has no lines of its own: the file's are kept for the keys no --set touched
        return dataclasses.replace(parse_recipe(YamlDoc(data, {}, doc.source)), lines=dict(doc.lines),
                                   overrides=tuple(overrides))
    except ConfigError as exc:
        msg = str(exc).removeprefix(f"{doc.source}: ")
        keys = {t: t.partition("=")[0].strip() for t in overrides}
        culprit = [t for t, k in keys.items() if msg.startswith(f"'{k}") or f"'{k}'" in msg]
        raise ConfigError(f"--set {', --set '.join(culprit or overrides)}: {msg}") from None


def load_recipe_text(text: str, source: str = "<recipe>") -> Recipe:
    return parse_recipe(load_yaml_text(text, source))


def recipe_summary(r: Recipe) -> Mapping[str, Any]:
    return {"model": r.model.path, "precision": r.precision.default.value, "task": r.task.name, "steps": r.steps,
            "ray": r.ray.enabled}
