"""The recipe's ``rollout:`` section: which engine samples, where, and its default sampling parameters.

Parsed with ``miles_lp.config.parse_dataclass`` (unknown keys refused with a suggestion and ``file:line``)::

    rollout:
      backend: reference        # reference (embedded, default) | vllm (vLLM CPU, own venv) | sglang (HTTP client)
      url: null                 # sglang: http://127.0.0.1:30000 (API key from MILES_LP_API_KEY / SGLANG_API_KEY)
      server: miles-lp          # sglang: miles-lp (`miles-lp serve`: safetensors tensor updates, live checks) |
                                #   sglang (a stock server: updates from disk, an exported checkpoint per sync) |
                                #   launch (real SGLang on CPU started here: updates from disk, live checks)
      max_model_len: null       # vllm: prompt + response tokens per sequence (null: max_response_len + 256)
      device: auto              # reference: auto (cuda if available) | cpu | cuda | cuda:N
      dtype: auto               # reference: activation dtype; auto = the learner's master dtype in `miles-lp run`
      kv_cache: bf16            # bf16 | fp8_e4m3 (per-tensor scale, 1.0 unless the checkpoint has k/v scales)
      max_response_len: 1024    # max_new_tokens of every rollout
      sampling: {temperature: 1.0, top_p: 1.0, top_k: -1, seed: 0}
      stop_token_ids: []        # stop tokens (the tokenizer's EOS, usually)
      engine_tp: 1              # tensor-parallel ranks inside each engine (vLLM's tensor_parallel_size, run
                                #   with the checks answered by every rank; elsewhere above 1 refused, naming why)

A key the chosen backend does not read (``kv_cache`` / ``dtype`` / ``device`` / ``max_model_len`` for sglang,
whose server decides them; a CUDA ``device`` for vllm; ``max_model_len`` for reference) is refused, not ignored.

``kv_cache`` lives here because the precision policy (``precision:``) has no key for it yet (noted for the
a ``precision.kv_cache`` key is not built); ``sampling_params()`` builds the ``SamplingParams`` of a rollout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from miles_lp.config import Where, load_yaml, parse_dataclass
from miles_lp.rollout.engine import SamplingParams


@dataclasses.dataclass(frozen=True)
class SamplingSection:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = 0

    def _validate(self, where: Where) -> None:
        if not self.temperature >= 0:
            raise where.child("temperature").error(f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise where.child("top_p").error(f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise where.child("top_k").error(f"must be -1 (off) or >= 1, got {self.top_k}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    backend: Literal["reference", "vllm", "sglang"] = "reference"
    url: str | None = None
    server: Literal["miles-lp", "sglang", "launch"] = "miles-lp"
    max_model_len: int | None = None
    device: str = "auto"
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    kv_cache: Literal["bf16", "fp8_e4m3"] = "bf16"
    max_response_len: int = 1024
    sampling: SamplingSection = dataclasses.field(default_factory=SamplingSection)
    stop_token_ids: tuple[int, ...] = ()
    engine_tp: int = 1

    def _validate(self, where: Where) -> None:
        self._validate_tp(where.child("engine_tp"))
        if self.max_response_len < 1:
            raise where.child("max_response_len").error(f"must be >= 1, got {self.max_response_len}")
        if self.backend == "sglang" and self.server == "launch" and self.url:
            raise where.child("url").error("server launch starts its own SGLang server (loopback, a free port): "
                                           "remove url, or use server sglang for a server started by hand")
        if self.backend == "sglang" and self.server != "launch" and not self.url:
            raise where.child("url").error("backend sglang needs the server's url, e.g. http://127.0.0.1:30000 "
                                           "(or server: launch, which starts SGLang itself)")
        if self.backend != "sglang" and self.url:
            raise where.child("url").error(f"url is only used by backend sglang (backend is {self.backend})")
        if self.server != "miles-lp" and self.backend != "sglang":
            raise where.child("server").error(f"server is only used by backend sglang (backend is {self.backend})")
        if self.max_model_len is not None and self.max_model_len <= self.max_response_len:
            raise where.child("max_model_len").error(f"must exceed max_response_len ({self.max_response_len}) to "
                                                     f"leave room for the prompt, got {self.max_model_len}")
        if self.backend == "vllm" and self.dtype == "fp32":
            raise where.child("dtype").error("vLLM CPU serves bf16 (its MXFP8/NVFP4 emulation kernels need it): "
                                             "use dtype auto or bf16 with backend vllm")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise where.child("device").error(f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        self._refuse_unread(where)

    def _validate_tp(self, where: Where) -> None:
        """``engine_tp``: an integer >= 1; above 1 only where this backend starts the engine with that many
        tensor-parallel ranks (backend vllm; the model's sizes: ``engine_tp_problems``, at start and in --dry-run)."""
        tp = self.engine_tp
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise where.error(f"must be an integer >= 1, got {tp!r}")
        if tp == 1:
            return
        if self.backend == "reference":
            raise where.error(f"backend reference has no tensor parallelism of its own (one engine is one device), "
                              f"got {tp}: remove rollout.engine_tp, or use rollout.engines: N for more engines")
        if self.backend == "sglang" and self.server == "miles-lp":
            raise where.error(f"server miles-lp (`miles-lp serve`) runs the reference engine, which has no tensor "
                              f"parallelism, got {tp}: remove rollout.engine_tp, or use rollout.engines: N")
        if self.backend == "sglang" and self.server == "launch":
            raise where.error(f"server launch at --tp-size {tp} is not built: SGLang 0.5.23's CPU platform builds a "
                              "PyNccl communicator for its TP group (it fails on a CPU device), and the introspection "
                              "hook that answers the sync's checks from the served model runs in every TP rank on one "
                              "port; remove rollout.engine_tp, or use rollout.engines: N")
        if self.backend == "sglang" and self.server == "sglang":
            raise where.error(f"a server started by hand has the tensor-parallel size it was started with (its "
                              f"--tp-size), got {tp}: remove rollout.engine_tp")

    def _refuse_unread(self, where: Where) -> None:
        """A key its backend does not read is refused, not ignored (a recipe asking for an fp8 KV cache must not
        sample with whatever the server has)."""
        unread: dict[str, tuple[bool, str]] = {
            "sglang": {"kv_cache": (self.kv_cache != "bf16", "start the server with --kv-cache-dtype"),
                       "dtype": (self.dtype != "auto", "start the server with --dtype"),
                       "device": (self.device != "auto", "the server's own devices serve"),
                       "max_model_len": (self.max_model_len is not None, "start the server with --context-length")},
            "vllm": {"device": (self.device not in ("auto", "cpu"), "this backend is vLLM's CPU build")},
            "reference": {"max_model_len": (self.max_model_len is not None,
                                            "the reference engine's KV cache grows with the sequence")},
        }[self.backend]
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key, (set_, why) in unread.items():
            if set_:
                raise where.child(key).error(f"backend {self.backend} does not read {key} ({why}); remove it (or "
                                             f"--set rollout.{key}={'null' if defaults[key] is None else defaults[key]})")

    @property
    def model_len(self) -> int:
        """vLLM's ``max_model_len``: ``max_model_len``, else room for a 256-token prompt and the longest response."""
        return self.max_model_len or self.max_response_len + 256

    @property
    def target(self) -> str:
        """The engine checkpoint's target (``miles-lp convert --target``): vLLM's names for vllm, else SGLang's."""
        return "vllm" if self.backend == "vllm" else "sglang"

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        s = self.sampling
        kw = dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                  max_new_tokens=self.max_response_len, stop_token_ids=tuple(self.stop_token_ids))
        kw.update(overrides)
        return SamplingParams(**kw)


def parse_rollout_config(mapping: Any, where: Where | None = None) -> RolloutConfig:
    """Build a ``RolloutConfig`` from the mapping under ``rollout:`` (``None`` gives the defaults)."""
    return parse_dataclass(RolloutConfig, mapping, where or Where("<rollout>", "rollout"))


def load_rollout_config(path: str | Path, section: str = "rollout") -> RolloutConfig:
    doc = load_yaml(path)
    data = doc.data or {}
    if not isinstance(data, dict):
        raise doc.where().error(f"expected a mapping at the top of the recipe, got {type(data).__name__}")
    return parse_rollout_config(data.get(section), doc.where(section))


def engine_tp_problems(tp: int, hf_config: Mapping[str, Any], block: int | None = None,
                       row_block: int | None = None) -> list[str]:
    """What of the model ``tp`` tensor-parallel engine ranks cannot split evenly (vLLM's rules: attention heads and
    the MLP's intermediate size divisible by tp; KV heads divisible by tp, or tp by them, each KV head then held
    whole by tp / heads ranks), naming the sizes; ``block``: the largest scale block along a weight's input
    features (``Format.block_size``), which a row-parallel shard must hold whole; ``row_block``: the scale block
    along output rows (FP8 blockwise: 128), which each rank's rows of q / k / v / gate / up must hold whole.
    Empty: it splits."""
    if tp <= 1:
        return []
    out = []
    heads = int(hf_config.get("num_attention_heads") or 0)
    kv = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or (int(hf_config.get("hidden_size") or 0) // max(heads, 1)))
    if heads and heads % tp:
        out.append(f"num_attention_heads {heads} is not divisible by rollout.engine_tp {tp}")
    if kv and kv % tp and tp % kv:
        out.append(f"num_key_value_heads {kv} and rollout.engine_tp {tp}: neither divides the other")
    rows = {"intermediate_size": hf_config.get("intermediate_size"),
            "moe_intermediate_size": hf_config.get("moe_intermediate_size"),
            "attention output (num_attention_heads x head_dim)": heads * head_dim or None}
    for key, n in rows.items():
        if not n:
            continue
        n = int(n)
        if n % tp:
            out.append(f"{key} {n} is not divisible by rollout.engine_tp {tp}")
        elif block and (n // tp) % block:
            out.append(f"{key} {n} / rollout.engine_tp {tp} = {n // tp} input features per rank is not a whole "
                       f"number of {block}-element scale blocks")
    if row_block and heads and not out:
        per_rank = {"q_proj": heads * head_dim // tp, "k_proj / v_proj": max(1, kv // tp) * head_dim,
                    "gate_proj / up_proj (intermediate_size)": int(hf_config.get("intermediate_size") or 0) // tp,
                    "moe gate / up (moe_intermediate_size)": int(hf_config.get("moe_intermediate_size") or 0) // tp}
        for key, n in per_rank.items():
            if n % row_block:
                out.append(f"{key}: {n} output rows per rank is not a whole number of {row_block}-row scale blocks")
    return out
