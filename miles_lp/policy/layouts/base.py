"""Model layouts: every tensor of a checkpoint -> (layer, role, canonical name, joint-scale group).

One `ModelLayout` class does the work; an architecture is one small `ArchSpec` (see `llama.py`,
`qwen_moe.py`, `deepseek_v3.py`, `mixtral.py`) registered with `register`. Three naming schemes map to the
same canonical Hugging Face names:

- HF checkpoint names: ``model.layers.3.mlp.experts.7.gate_proj.weight`` (canonical, one tensor each);
- Megatron-Core names: ``decoder.layers.3.self_attention.linear_qkv.weight`` (members q, k, v),
  ``decoder.layers.3.mlp.experts.linear_fc1.weight7`` (members gate and up of expert 7), ...;
- transformers-5 fused in-memory names: ``model.layers.3.mlp.experts.gate_up_proj`` ``[E, 2I, H]``
  (members: gate and up of every expert).

`TensorInfo.members` lists the canonical names a (possibly fused) tensor holds. `engine_module` is the
module that SGLang / vLLM build for the tensor (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``,
experts -> one FusedMoE ``...experts``, DeepSeek q_a + kv_a -> ``fused_qkv_a_proj_with_mqa``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from miles_lp.errors import LayoutError
from miles_lp.policy.roles import Role

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str  # the name that was described (HF, Megatron or fused)
    canonical: str  # canonical HF name (the first member for a fused name)
    layer: int | None  # decoder layer index; MTP layers continue after the last decoder layer
    role: Role
    expert: int | None
    group: str | None  # joint-scale group: the shards an engine fuses (q/k/v, gate+up, MLA q_a+kv_a), else None
    kind: str  # "hf" | "megatron" | "fused"
    members: tuple[str, ...]  # canonical names held by this tensor
    engine_module: str | None = None  # SGLang/vLLM module holding it (None: not a linear module)
    engine_shard: str | None = None  # the shard name inside a fused engine module (q_proj, gate_proj, ...)


def _get(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """What differs between architectures. Everything else is shared by `ModelLayout`."""

    name: str
    model_types: tuple[str, ...]
    moe_module: str = "mlp"  # "block_sparse_moe" for Mixtral
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    shared: str | None = None  # "shared_expert" (Qwen2-MoE) | "shared_experts" (DeepSeek)
    shared_gate: bool = False  # Qwen2-MoE `mlp.shared_expert_gate`
    router_bias: bool = False  # DeepSeek-V3 `mlp.gate.e_score_correction_bias`
    mla: bool = False
    qk_norm: bool = False
    qkv_bias: Callable[[Mapping[str, Any]], bool] = lambda c: False
    o_bias: Callable[[Mapping[str, Any]], bool] = lambda c: False
    is_moe_layer: Callable[[Mapping[str, Any], int], bool] = lambda c, i: False
    num_experts: Callable[[Mapping[str, Any]], int] = lambda c: 0
    shared_intermediate: Callable[[Mapping[str, Any]], int] = lambda c: 0
    mtp_layers: Callable[[Mapping[str, Any]], int] = lambda c: 0


_REGISTRY: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    for mt in spec.model_types:
        _REGISTRY[mt] = spec
    return spec


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def get_layout(config: Mapping[str, Any]) -> ModelLayout:
    """The layout for a HF ``config.json`` mapping (or a transformers config's ``to_dict()``)."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    mt = config.get("model_type")
    spec = _REGISTRY.get(mt)
    if spec is None:
        raise LayoutError(f"no layout for model_type '{mt}'; supported: {', '.join(supported_model_types())}. "
                          "Adding one is a small ArchSpec file (docs/precision_policy.md).")
    with _config_keys(mt, "layout"):
        return ModelLayout(spec, dict(config))


@contextlib.contextmanager
def _config_keys(model_type: Any, what: str):
    """Turn a missing or non-numeric config field into a `LayoutError` naming it (not a bare KeyError)."""
    try:
        yield
    except KeyError as exc:
        raise LayoutError(f"the model config (model_type '{model_type}') has no '{exc.args[0]}', which the {what} "
                          "needs; pass the model's full config.json") from None
    except (TypeError, ValueError) as exc:
        raise LayoutError(f"the model config (model_type '{model_type}') has a field of the wrong type for the "
                          f"{what}: {exc}") from None


_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MEG_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MEG_EXPERT_RE = re.compile(r"mlp\.experts\.(?:linear_fc([12])\.weight(\d+)|local_experts\.(\d+)\.linear_fc([12])\.weight)")
_FUSED_EXPERT_RE = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)")


class ModelLayout:
    """Names, roles and shapes of one model (an `ArchSpec` applied to one config)."""

    def __init__(self, spec: ArchSpec, config: dict[str, Any]):
        self.spec = spec
        self.config = config
        self.model_type = config.get("model_type")
        self.num_layers: int = int(config["num_hidden_layers"])
        self.num_mtp_layers: int = int(spec.mtp_layers(config) or 0)
        self.num_experts: int = int(spec.num_experts(config) or 0)
        self.hidden: int = int(config["hidden_size"])
        moe = {i for i in range(self.num_layers) if self.num_experts and spec.is_moe_layer(config, i)}
        if self.num_experts:  # DeepSeek MTP layers are MoE layers
            moe |= set(range(self.num_layers, self.num_layers + self.num_mtp_layers))
        self._moe_layers = frozenset(moe)
        self._suffix = self._suffix_table()
        e = re.escape(spec.moe_module)
        self._expert_re = re.compile(rf"{e}\.experts\.(\d+)\.(\w+)\.weight")
        self._meg_table = self._megatron_table()

    # ---- per-layer suffix table: suffix -> (role, group suffix, engine module suffix, shard)
    def _suffix_table(self) -> dict[str, tuple[Role, str | None, str | None, str | None]]:
        s = self.spec
        t: dict[str, tuple[Role, str | None, str | None, str | None]] = {}
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
                     "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm", "enorm", "hnorm", "shared_head.norm"):
            t[f"{norm}.weight"] = (Role.NORM, None, None, None)
        # Joint-scale groups = the shards an engine fuses into one parameter: SGLang and vLLM build one
        # qkv_proj (and gate_up_proj, and DeepSeek's fused_qkv_a_proj_with_mqa) and keep ONE NVFP4 global scale
        # for it (vLLM: the max of the shards' for modelopt, the smallest decode scale for compressed-tensors),
        # so the shards must share one from the start, exactly like gate and up.
        for p in ("q_proj", "k_proj", "v_proj"):
            role = Role.MLA_Q_B if (s.mla and p == "q_proj") else Role.ATTENTION_QKV
            module = "self_attn.q_proj" if s.mla else "self_attn.qkv_proj"
            group = None if s.mla else "self_attn.qkv"
            t[f"self_attn.{p}.weight"] = (role, group, module, p)
            t[f"self_attn.{p}.bias"] = (Role.BIAS, None, None, None)
        t["self_attn.o_proj.weight"] = (Role.ATTENTION_OUT, None, "self_attn.o_proj", "o_proj")
        t["self_attn.o_proj.bias"] = (Role.BIAS, None, None, None)
        if s.mla:
            qa = "self_attn.fused_qkv_a_proj_with_mqa"
            t["self_attn.q_a_proj.weight"] = (Role.MLA_Q_A, "self_attn.fused_qkv_a", qa, "q_a_proj")
            t["self_attn.kv_a_proj_with_mqa.weight"] = (Role.MLA_KV_A, "self_attn.fused_qkv_a", qa,
                                                         "kv_a_proj_with_mqa")
            t["self_attn.q_b_proj.weight"] = (Role.MLA_Q_B, None, "self_attn.q_b_proj", "q_b_proj")
            t["self_attn.kv_b_proj.weight"] = (Role.MLA_KV_B, None, "self_attn.kv_b_proj", "kv_b_proj")
        for p in ("gate_proj", "up_proj"):
            t[f"mlp.{p}.weight"] = (Role.DENSE_MLP, "mlp.gate_up", "mlp.gate_up_proj", p)
        t["mlp.down_proj.weight"] = (Role.DENSE_MLP, None, "mlp.down_proj", "down_proj")
        for p in ("gate_proj", "up_proj", "down_proj"):
            t[f"mlp.{p}.bias"] = (Role.BIAS, None, None, None)
        t[f"{s.moe_module}.gate.weight"] = (Role.ROUTER, None, None, None)
        if s.router_bias:
            t[f"{s.moe_module}.gate.e_score_correction_bias"] = (Role.ROUTER_BIAS, None, None, None)
        if s.shared:
            sh = f"mlp.{s.shared}"
            for p in ("gate_proj", "up_proj"):
                t[f"{sh}.{p}.weight"] = (Role.SHARED_EXPERTS, f"{sh}.gate_up", f"{sh}.gate_up_proj", p)
            t[f"{sh}.down_proj.weight"] = (Role.SHARED_EXPERTS, None, f"{sh}.down_proj", "down_proj")
        if s.shared_gate:
            t["mlp.shared_expert_gate.weight"] = (Role.SHARED_EXPERT_GATE, None, None, None)
        if self.num_mtp_layers:
            t["eh_proj.weight"] = (Role.MTP_PROJ, None, None, None)
            t["embed_tokens.weight"] = (Role.EMBEDDING, None, None, None)
            t["shared_head.head.weight"] = (Role.LM_HEAD, None, None, None)
        return t

    # ---- describe --------------------------------------------------------------------------
    def describe(self, name: str) -> TensorInfo:
        """Layer, role, canonical name(s) and engine module of an HF, Megatron or fused in-memory name."""
        m = _LAYER_RE.fullmatch(name)
        if m:
            layer, rest = int(m.group(1)), m.group(2)
            hit = self._suffix.get(rest)
            if hit is not None:
                role, group, module, shard = hit
                pre = f"model.layers.{layer}."
                return TensorInfo(name, name, layer, role, None, pre + group if group else None, "hf", (name,),
                                  pre + module if module else None, shard)
            em = self._expert_re.fullmatch(rest)
            if em:
                return self._expert_info(name, layer, int(em.group(1)), em.group(2))
            fm = _FUSED_EXPERT_RE.fullmatch(rest)
            if fm:
                return self._fused_expert_info(name, layer, fm.group(1))
            if rest == "mlp.gate.weight" and self.spec.moe_module != "mlp":  # transformers-5 Mixtral router
                canon = f"model.layers.{layer}.{self.spec.moe_module}.gate.weight"
                return TensorInfo(name, canon, layer, Role.ROUTER, None, None, "fused", (canon,))
            return TensorInfo(name, name, layer, Role.OTHER, None, None, "hf", (name,))
        if name == "model.embed_tokens.weight":
            return TensorInfo(name, name, None, Role.EMBEDDING, None, None, "hf", (name,))
        if name == "lm_head.weight":
            return TensorInfo(name, name, None, Role.LM_HEAD, None, None, "hf", (name,))
        if name == "model.norm.weight":
            return TensorInfo(name, name, None, Role.NORM, None, None, "hf", (name,))
        meg = self._describe_megatron(name)
        if meg is not None:
            return meg
        return TensorInfo(name, name, None, Role.OTHER, None, None, "hf", (name,))

    def _expert_info(self, name: str, layer: int, expert: int, proj: str, kind: str = "hf") -> TensorInfo:
        gate, up, down = self.spec.expert_proj
        if proj not in (gate, up, down):
            return TensorInfo(name, name, layer, Role.OTHER, expert, None, kind, (name,))
        pre = f"model.layers.{layer}.{self.spec.moe_module}.experts"
        group = f"{pre}.{expert}.gate_up" if proj in (gate, up) else None
        canon = f"{pre}.{expert}.{proj}.weight"
        return TensorInfo(name, canon, layer, Role.ROUTED_EXPERTS, expert, group, kind, (canon,), pre, proj)

    def expert_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        pre = f"model.layers.{layer}.{self.spec.moe_module}.experts.{expert}"
        return tuple(f"{pre}.{p}.weight" for p in self.spec.expert_proj)  # type: ignore[return-value]

    def _fused_expert_info(self, name: str, layer: int, which: str) -> TensorInfo:
        gate, up, down = self.spec.expert_proj
        projs = (gate, up) if which == "gate_up_proj" else (down,)
        pre = f"model.layers.{layer}.{self.spec.moe_module}.experts"
        members = tuple(f"{pre}.{e}.{p}.weight" for e in range(self.num_experts) for p in projs)
        return TensorInfo(name, members[0], layer, Role.ROUTED_EXPERTS, None, None, "fused", members, pre, None)

    def _describe_megatron(self, name: str) -> TensorInfo | None:
        while name.startswith("module."):
            name = name[len("module."):]
        top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
               "output_layer.weight": "lm_head.weight", "decoder.final_layernorm.weight": "model.norm.weight"}
        if name in top:
            info = self.describe(top[name])
            return dataclasses.replace(info, name=name, kind="megatron")
        m = _MEG_LAYER_RE.fullmatch(name)
        if not m:
            return None
        layer, rest = int(m.group(1)), m.group(2)
        pre = f"model.layers.{layer}."
        em = _MEG_EXPERT_RE.fullmatch(rest)
        if em:
            fc = em.group(1) or em.group(4)
            expert = int(em.group(2) or em.group(3))
            gate, up, down = self.expert_names(layer, expert)
            members = (gate, up) if fc == "1" else (down,)
            info = self.describe(members[0])
            return dataclasses.replace(info, name=name, kind="megatron", members=members)
        hf = self._meg_table.get(rest)
        if hf is None:
            return None
        members = tuple(pre + h for h in hf)
        info = self.describe(members[0])
        return dataclasses.replace(info, name=name, kind="megatron", members=members)

    def _megatron_table(self) -> dict[str, tuple[str, ...]]:
        sh = f"mlp.{self.spec.shared}" if self.spec.shared else None
        table: dict[str, tuple[str, ...]] = {
            "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight"),
            "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                               "self_attn.v_proj.bias"),
            "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
            "input_layernorm.weight": ("input_layernorm.weight",),
            "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
            "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
            "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
            "self_attention.linear_q_down_proj.weight": ("self_attn.q_a_proj.weight",),
            "self_attention.linear_q_up_proj.weight": ("self_attn.q_b_proj.weight",),
            "self_attention.linear_q_proj.weight": ("self_attn.q_proj.weight",),
            "self_attention.linear_q_up_proj.layer_norm_weight": ("self_attn.q_a_layernorm.weight",),
            "self_attention.linear_kv_down_proj.weight": ("self_attn.kv_a_proj_with_mqa.weight",),
            "self_attention.linear_kv_up_proj.weight": ("self_attn.kv_b_proj.weight",),
            "self_attention.linear_kv_up_proj.layer_norm_weight": ("self_attn.kv_a_layernorm.weight",),
            "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight",),
            "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
            "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
            "mlp.router.weight": (f"{self.spec.moe_module}.gate.weight",),
            "mlp.router.expert_bias": (f"{self.spec.moe_module}.gate.e_score_correction_bias",),
        }
        if sh:
            table["mlp.shared_experts.linear_fc1.weight"] = (f"{sh}.gate_proj.weight", f"{sh}.up_proj.weight")
            table["mlp.shared_experts.linear_fc2.weight"] = (f"{sh}.down_proj.weight",)
            table["mlp.shared_experts.gate_weight"] = ("mlp.shared_expert_gate.weight",)
        return table

    # ---- synthesize ------------------------------------------------------------------------
    def is_moe_layer(self, layer: int) -> bool:
        return layer in self._moe_layers

    def synthesize(self, include_mtp: bool = False) -> dict[str, Shape]:
        """HF tensor names and shapes from the config alone (what ``save_pretrained`` writes).

        ``include_mtp`` adds DeepSeek's multi-token-prediction layers (``model.layers.{num_layers + k}``), which
        real DeepSeek-V3 checkpoints carry but transformers does not build.
        """
        with _config_keys(self.model_type, "tensor names and shapes"):
            return self._synthesize(include_mtp)

    def _synthesize(self, include_mtp: bool) -> dict[str, Shape]:
        c, H = self.config, self.hidden
        V = int(c["vocab_size"])
        out: dict[str, Shape] = {"model.embed_tokens.weight": (V, H)}
        n_total = self.num_layers + (self.num_mtp_layers if include_mtp else 0)
        for i in range(n_total):
            p = f"model.layers.{i}."
            self._synth_attention(p, out)
            out[p + "input_layernorm.weight"] = (H,)
            out[p + "post_attention_layernorm.weight"] = (H,)
            if self.is_moe_layer(i):
                self._synth_moe(p, out)
            else:
                inter = int(c["intermediate_size"])
                out[p + "mlp.gate_proj.weight"] = (inter, H)
                out[p + "mlp.up_proj.weight"] = (inter, H)
                out[p + "mlp.down_proj.weight"] = (H, inter)
            if i >= self.num_layers:  # DeepSeek MTP extras
                out[p + "enorm.weight"] = (H,)
                out[p + "hnorm.weight"] = (H,)
                out[p + "eh_proj.weight"] = (H, 2 * H)
                out[p + "embed_tokens.weight"] = (V, H)
                out[p + "shared_head.norm.weight"] = (H,)
                out[p + "shared_head.head.weight"] = (V, H)
        out["model.norm.weight"] = (H,)
        if not c.get("tie_word_embeddings", False):
            out["lm_head.weight"] = (V, H)
        return out

    def _synth_attention(self, p: str, out: dict[str, Shape]) -> None:
        c, s, H = self.config, self.spec, self.hidden
        heads = int(c["num_attention_heads"])
        if s.mla:
            nope, rope, vd = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
            qlr, kvlr = c.get("q_lora_rank"), int(c["kv_lora_rank"])
            if qlr:
                out[p + "self_attn.q_a_proj.weight"] = (int(qlr), H)
                out[p + "self_attn.q_a_layernorm.weight"] = (int(qlr),)
                out[p + "self_attn.q_b_proj.weight"] = (heads * (nope + rope), int(qlr))
            else:
                out[p + "self_attn.q_proj.weight"] = (heads * (nope + rope), H)
            out[p + "self_attn.kv_a_proj_with_mqa.weight"] = (kvlr + rope, H)
            out[p + "self_attn.kv_a_layernorm.weight"] = (kvlr,)
            out[p + "self_attn.kv_b_proj.weight"] = (heads * (nope + vd), kvlr)
            out[p + "self_attn.o_proj.weight"] = (H, heads * vd)
            return
        kv = int(_get(c, "num_key_value_heads", default=heads))
        hd = int(_get(c, "head_dim", default=H // heads))
        out[p + "self_attn.q_proj.weight"] = (heads * hd, H)
        out[p + "self_attn.k_proj.weight"] = (kv * hd, H)
        out[p + "self_attn.v_proj.weight"] = (kv * hd, H)
        out[p + "self_attn.o_proj.weight"] = (H, heads * hd)
        if s.qkv_bias(c):
            out[p + "self_attn.q_proj.bias"] = (heads * hd,)
            out[p + "self_attn.k_proj.bias"] = (kv * hd,)
            out[p + "self_attn.v_proj.bias"] = (kv * hd,)
        if s.o_bias(c):
            out[p + "self_attn.o_proj.bias"] = (H,)
        if s.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)

    def _synth_moe(self, p: str, out: dict[str, Shape]) -> None:
        c, s, H = self.config, self.spec, self.hidden
        moe_i = int(_get(c, "moe_intermediate_size", "intermediate_size"))
        gate, up, down = s.expert_proj
        for e in range(self.num_experts):
            q = f"{p}{s.moe_module}.experts.{e}."
            out[q + f"{gate}.weight"] = (moe_i, H)
            out[q + f"{up}.weight"] = (moe_i, H)
            out[q + f"{down}.weight"] = (H, moe_i)
        out[f"{p}{s.moe_module}.gate.weight"] = (self.num_experts, H)
        if s.router_bias:
            out[f"{p}{s.moe_module}.gate.e_score_correction_bias"] = (self.num_experts,)
        if s.shared:
            si = int(s.shared_intermediate(c))
            q = f"{p}mlp.{s.shared}."
            out[q + "gate_proj.weight"] = (si, H)
            out[q + "up_proj.weight"] = (si, H)
            out[q + "down_proj.weight"] = (H, si)
        if s.shared_gate:
            out[p + "mlp.shared_expert_gate.weight"] = (1, H)
