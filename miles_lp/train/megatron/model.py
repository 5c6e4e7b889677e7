"""Build a Megatron-Core GPT / MoE model for a Hugging Face config and load the HF weights into it.

Supported layouts: ``llama``, ``qwen2``, ``qwen3`` (dense), ``qwen3_moe``, ``mixtral`` (MoE), ``qwen2_moe`` (MoE +
sigmoid-gated shared expert) and ``deepseek_v3`` (MLA, ``first_k_dense_replace`` dense layers, shared experts,
sigmoid router with ``e_score_correction_bias``). Dense and MoE layers may mix (per-layer specs; the layout's
``is_moe_layer`` decides, the same rule transformers uses). What Megatron cannot reproduce exactly is refused with
``LayoutError`` (see ``transformer_config_kwargs``).

Weight conversion (HF -> Megatron), per tensor-parallel rank:

* ``linear_qkv`` rows are interleaved per query group, the layout ``SelfAttention.
  get_query_key_value_tensors`` splits: for each group g, ``[q heads of g (np/ng * hn) | k_g (hn) | v_g (hn)]``;
  tensor parallelism gives each rank ng/tp whole groups.
* ``linear_fc1`` = ``[gate; up]`` (Megatron's SwiGLU chunks fc1's output in two, silu on the first); each
  rank holds ``[gate shard; up shard]``.
* ``linear_proj`` / ``linear_fc2`` are split along K (columns); embedding and output layer along the vocab.
* transformers-5 experts ``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]`` map to
  ``mlp.experts.local_experts.{e}.linear_fc1/fc2`` (SequentialMLP; local index = global - ep_rank * E/ep).
* shared experts: ``mlp.shared_expert(s).{gate,up,down}_proj`` -> ``mlp.shared_experts.linear_fc1`` ([gate; up],
  TP-sharded like a dense MLP) / ``linear_fc2``; Qwen2-MoE's ``mlp.shared_expert_gate.weight`` [1, H] ->
  ``mlp.shared_experts.gate_weight`` (a plain parameter, never quantized).
* MLA: ``q_a_proj`` -> ``linear_q_down_proj``, ``q_a_layernorm`` -> ``q_layernorm``, ``q_b_proj`` ->
  ``linear_q_up_proj`` (or ``q_proj`` -> ``linear_q_proj``), ``kv_a_proj_with_mqa`` -> ``linear_kv_down_proj``,
  ``kv_a_layernorm`` -> ``kv_layernorm``, ``kv_b_proj`` -> ``linear_kv_up_proj``; all column-parallel (rows
  sharded), ``o_proj`` -> ``linear_proj``. Megatron's MLA de-interleaves the rope dims (``x[0::2] | x[1::2]``)
  before a half-rotation, which is exactly HF's ``rope_interleave=True``: no weight permutation.
* router: ``mlp.gate.weight`` -> ``mlp.router.weight``; ``e_score_correction_bias`` -> the ``mlp.router.expert_bias``
  buffer (fp32).

Every HF tensor is read exactly once and every Megatron parameter (and the expert-bias buffer) is written, or
``LayoutError`` names the difference (DeepSeek MTP layers ``model.layers.{L+k}`` are not built and are skipped).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from miles_lp.errors import LayoutError
from miles_lp.train.megatron.hf_config import MLA_TYPES, expert_count
from miles_lp.train.megatron.hf_config import config_value as _get

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3")


def _rope_theta(cfg: Any) -> float:
    theta = _get(cfg, "rope_theta")
    if theta is None:
        theta = (_get(cfg, "rope_parameters") or {}).get("rope_theta", 10000.0)
    return float(theta)


def _layout(cfg: Any):
    from miles_lp.policy import get_layout

    return get_layout(cfg)


def moe_layer_pattern(hf_config: Any) -> list[int]:
    """1 for an MoE decoder layer, 0 for a dense one (the layout's rule, which is transformers')."""
    layout = _layout(hf_config)
    return [int(layout.is_moe_layer(i)) for i in range(int(_get(hf_config, "num_hidden_layers")))]


def _rope_parameters(cfg: Any) -> dict:
    rp = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
    return dict(rp) if isinstance(rp, Mapping) else {}


def transformer_config_kwargs(hf_config: Any, *, tp: int = 1, ep: int = 1, etp: int | None = None,
                              sequence_parallel: bool = False, params_dtype=torch.float32, pp: int = 1,
                              first_stage_layers: int | None = None, last_stage_layers: int | None = None
                              ) -> dict[str, Any]:
    """``TransformerConfig`` (``MLATransformerConfig`` when ``multi_latent_attention``) keyword arguments that
    reproduce the HF model (local, non-TE layers).

    ``pp > 1``: Megatron's pipeline settings the learner's schedule runs with: ``pipeline_dtype`` (the p2p
    buffers) = the parameters' dtype; ``calculate_per_token_loss`` (the schedule does not divide a micro-batch's
    loss by the number of micro-batches: miles-lp's losses are already normalised by the mini-batch's totals);
    ``batch_p2p_comm=False`` (plain isend / irecv, which gloo runs). Not ``variable_seq_lengths``: Megatron 0.16
    refuses it with the all-gather token dispatcher, so the schedule pads every row of a step to one length
    (``pipeline._schedule``)."""
    mt = _get(hf_config, "model_type")
    if mt not in SUPPORTED:
        raise LayoutError(f"the Megatron backend builds {', '.join(SUPPORTED)}; got model_type '{mt}' "
                          "(use the embedded backend for it)")
    act = _get(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise LayoutError(f"the Megatron backend builds SwiGLU MLPs (hidden_act 'silu'); got '{act}'")
    heads = int(_get(hf_config, "num_attention_heads"))
    hidden = int(_get(hf_config, "hidden_size"))
    mla = mt in MLA_TYPES
    attn_bias = bool(_get(hf_config, "attention_bias", False))
    if attn_bias and mt != "qwen2":
        raise LayoutError(f"{mt} with attention_bias=True has an o_proj bias (and for MLA q_a/kv_a biases), which "
                          "Megatron's local spec cannot hold without biasing every linear; use the embedded backend")
    rp = _rope_parameters(hf_config)
    rope_type = rp.get("rope_type", rp.get("type", "default")) or "default"
    if rope_type != "default":
        raise LayoutError(f"{mt}: rope_type '{rope_type}' is not mapped to Megatron (only default RoPE; "
                          "DeepSeek YaRN has not been checked against HF's inv_freq / attention_factor math); "
                          "use the embedded backend")
    kw: dict[str, Any] = dict(
        num_layers=int(_get(hf_config, "num_hidden_layers")), hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=heads if mla else int(_get(hf_config, "num_key_value_heads") or heads),
        kv_channels=int(_get(hf_config, "v_head_dim") if mla else (_get(hf_config, "head_dim") or hidden // heads)),
        ffn_hidden_size=int(_get(hf_config, "intermediate_size")),
        normalization="RMSNorm", layernorm_epsilon=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=bool(mt == "qwen2" or attn_bias
                          or (mt == "qwen2_moe" and _get(hf_config, "qkv_bias", True) is not False)),
        qk_layernorm=mt in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=False,
        persist_layer_norm=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
        expert_model_parallel_size=ep,
    )
    if pp > 1:
        kw.update(pipeline_model_parallel_size=pp, pipeline_dtype=params_dtype,
                  calculate_per_token_loss=True, batch_p2p_comm=False,
                  num_layers_in_first_pipeline_stage=first_stage_layers,
                  num_layers_in_last_pipeline_stage=last_stage_layers)
    if mla:
        if _get(hf_config, "rope_interleave", True) is False:
            raise LayoutError("deepseek_v3 with rope_interleave=False: Megatron's MLA always de-interleaves the rope "
                              "dims (HF's rope_interleave=True math); use the embedded backend")
        if float(kw["layernorm_epsilon"]) != 1e-6:
            raise LayoutError("deepseek_v3: HF's q_a_layernorm / kv_a_layernorm use eps 1e-6 whatever rms_norm_eps "
                              f"says ({kw['layernorm_epsilon']}); Megatron's MLA norms use rms_norm_eps")
        qlr = _get(hf_config, "q_lora_rank")
        kw.update(multi_latent_attention=True, q_lora_rank=int(qlr) if qlr else None,
                  kv_lora_rank=int(_get(hf_config, "kv_lora_rank")),
                  qk_head_dim=int(_get(hf_config, "qk_nope_head_dim")),
                  qk_pos_emb_head_dim=int(_get(hf_config, "qk_rope_head_dim")),
                  v_head_dim=int(_get(hf_config, "v_head_dim")), rope_type="rope",
                  rotary_base=_rope_theta(hf_config), rotary_percent=1.0, rotary_scaling_factor=1.0,
                  mscale=1.0, mscale_all_dim=0.0, rotary_interleaved=False)
    if etp is not None:
        kw["expert_tensor_parallel_size"] = etp
    n_exp = expert_count(hf_config)
    if n_exp:
        pattern = moe_layer_pattern(hf_config)
        if not any(pattern):
            raise LayoutError(f"{mt}: num_experts={n_exp} but no layer is MoE; nothing to build")
        moe_i = _get(hf_config, "moe_intermediate_size") or _get(hf_config, "intermediate_size")
        topk = int(_get(hf_config, "num_experts_per_tok"))
        kw.update(num_moe_experts=n_exp, moe_router_topk=topk, moe_layer_freq=pattern,
                  moe_ffn_hidden_size=int(moe_i), moe_grouped_gemm=False,
                  moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0, moe_router_dtype="fp32")
        if mt == "deepseek_v3":
            scoring = _get(hf_config, "scoring_func", "sigmoid") or "sigmoid"
            if scoring != "sigmoid":
                raise LayoutError(f"deepseek_v3 scoring_func '{scoring}': only sigmoid is mapped")
            if topk > 1 and not _get(hf_config, "norm_topk_prob", True):
                raise LayoutError("deepseek_v3 with norm_topk_prob=False: Megatron's sigmoid router always "
                                  "renormalizes the top-k probabilities (topk > 1)")
            n_group, topk_group = int(_get(hf_config, "n_group") or 1), int(_get(hf_config, "topk_group") or 1)
            if n_group > 1 and topk // topk_group != 2:
                raise LayoutError(f"deepseek_v3 group-limited routing scores a group by its top-2 experts (HF); "
                                  f"Megatron by its top-(topk/topk_group) = {topk // topk_group}: they differ")
            kw.update(moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                      moe_router_enable_expert_bias=True,
                      moe_router_topk_scaling_factor=float(_get(hf_config, "routed_scaling_factor", 1.0) or 1.0),
                      moe_shared_expert_intermediate_size=int(moe_i) * int(_get(hf_config, "n_shared_experts") or 1))
            if n_group > 1:
                kw.update(moe_router_num_groups=n_group, moe_router_group_topk=topk_group)
        else:
            # norm_topk_prob: softmax over the top-k logits == renormalized top-k of the full softmax
            kw.update(moe_router_score_function="softmax",
                      moe_router_pre_softmax=not bool(_get(hf_config, "norm_topk_prob", True) or mt == "mixtral"))
            if mt == "qwen2_moe":
                kw.update(moe_shared_expert_intermediate_size=int(_get(hf_config, "shared_expert_intermediate_size")),
                          moe_shared_expert_gate=True)
    return kw


def build_gpt_model(hf_config: Any, *, quantized: bool = True, tp: int = 1, ep: int = 1, etp: int | None = None,
                    sequence_parallel: bool = False, params_dtype=torch.float32, device=None,
                    parallel_output: bool = True, pp: int = 1, first_stage_layers: int | None = None,
                    last_stage_layers: int | None = None):
    """A Megatron ``GPTModel`` with the local layer spec (``quantized``: miles-lp's parallel linears).

    Model-parallel state must be initialized (``parallel_state.initialize_model_parallel``) first. Models whose
    dense and MoE layers mix (DeepSeek ``first_k_dense_replace``, Qwen ``mlp_only_layers``) get one layer spec per
    layer. ``sequence_parallel``: every norm (layer, q/k and final) is ``parallel.SequenceParallelNorm`` (the local
    spec's ``WrappedTorchNorm`` refuses SP). ``parallel_output=False``: the logits are gathered over TP (full
    vocabulary on every rank; the gather's backward hands each rank its vocabulary slice of the gradient).

    ``pp > 1``: this rank's pipeline stage (Megatron's ``get_transformer_layer_offset`` /
    ``get_num_layers_to_build`` for the layers, the embedding on the first stage, the final norm and output layer
    on the last); ``first_stage_layers`` / ``last_stage_layers``: Megatron's uneven first / last stages.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from miles_lp.train.megatron.layers import mla_without_te, quant_layer_spec, quantize_mla_down_projections

    kw = transformer_config_kwargs(hf_config, tp=tp, ep=ep, etp=etp, sequence_parallel=sequence_parallel,
                                   params_dtype=params_dtype, pp=pp, first_stage_layers=first_stage_layers,
                                   last_stage_layers=last_stage_layers)
    mla = bool(kw.get("multi_latent_attention"))
    if mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config = MLATransformerConfig(**kw)
    else:
        config = TransformerConfig(**kw)
    n_exp = kw.get("num_moe_experts")
    # MLA: the q_a / kv_a latent norms are the spec's q_layernorm / kv_layernorm (built when qk_layernorm)
    qk_norm = bool(kw["qk_layernorm"] or mla)

    norm = None
    if sequence_parallel:
        from miles_lp.train.megatron.parallel import SequenceParallelNorm

        norm = SequenceParallelNorm

    def layer_spec(experts):
        spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk_norm,
                                        multi_latent_attention=mla, normalization="RMSNorm")
        return quant_layer_spec(spec, quantized=quantized, norm=norm)

    pattern = kw.get("moe_layer_freq")
    if pp == 1 and norm is None and (not n_exp or all(pattern)):
        spec = layer_spec(n_exp)
    else:
        from megatron.core.transformer.transformer_block import LayerNormImpl, get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        dense, moe = layer_spec(None), layer_spec(n_exp)
        every = [moe if (pattern and m) else dense for m in (pattern or [0] * kw["num_layers"])]
        # a TransformerBlockSubmodules is taken as this stage's layers: slice the global list at Megatron's offset
        offset = get_transformer_layer_offset(config) if pp > 1 else 0
        n_local = get_num_layers_to_build(config) if pp > 1 else len(every)
        spec = TransformerBlockSubmodules(layer_specs=every[offset:offset + n_local],
                                          layer_norm=norm or LayerNormImpl)
    from megatron.core import parallel_state as ps

    first, last = (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()) if pp > 1 else (True, True)
    with mla_without_te() if mla else contextlib.nullcontext():
        model = GPTModel(config, spec, vocab_size=int(_get(hf_config, "vocab_size")),
                         max_sequence_length=int(_get(hf_config, "max_position_embeddings")),
                         position_embedding_type="rope", rotary_base=_rope_theta(hf_config),
                         share_embeddings_and_output_weights=bool(_get(hf_config, "tie_word_embeddings", False)),
                         parallel_output=parallel_output, pre_process=first, post_process=last)
    if quantized and mla:
        quantize_mla_down_projections(model)
    if device is not None:
        model = model.to(device)
    return model


# ---------------------------------------------------------------------------------------------------------
# HF -> Megatron weights
# ---------------------------------------------------------------------------------------------------------


def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if size == 1:
        return t
    if t.shape[dim] % size:
        raise LayoutError(f"cannot split dim {dim} of shape {tuple(t.shape)} over {size} tensor-parallel ranks")
    return t.chunk(size, dim=dim)[rank]


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int,
                   tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
    """HF q/k/v (``[nh*hn, ...]``, ``[ng*hn, ...]``) -> this rank's Megatron ``linear_qkv`` rows."""
    ng = num_query_groups
    hn = k.shape[0] // ng
    rest = q.shape[1:]
    qg = q.reshape(ng, -1, *rest)  # [ng, nh/ng*hn, ...]
    kg, vg = k.reshape(ng, hn, *rest), v.reshape(ng, hn, *rest)
    fused = torch.cat([qg, kg, vg], dim=1)  # [ng, (nh/ng + 2)*hn, ...]
    return _shard(fused, 0, tp_rank, tp_size).reshape(-1, *rest)


class _Reads(Mapping):
    """A read-counting view of the HF state dict (every tensor must be read exactly once)."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self._state = state
        self.reads: dict[str, int] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._state:
            raise LayoutError(f"the HF state dict has no '{key}', which the Megatron model needs; was it built from "
                              "this config?")
        self.reads[key] = self.reads.get(key, 0) + 1
        return self._state[key]

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def __iter__(self):
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def check(self, num_layers: int) -> None:
        twice = sorted(k for k, n in self.reads.items() if n > 1)
        unread = []
        for k in self._state:
            if k in self.reads:
                continue
            parts = k.split(".")
            if k.startswith("model.layers.") and int(parts[2]) >= num_layers:
                continue  # DeepSeek multi-token-prediction layers: not built
            unread.append(k)
        if twice or unread:
            raise LayoutError(f"HF -> Megatron name map: HF tensors not consumed {sorted(unread)[:6]}"
                              f"{' ...' if len(unread) > 6 else ''}, read more than once {twice[:6]}")


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], hf_config: Any, *, tp_rank: int = 0, tp_size: int = 1,
                   ep_rank: int = 0, ep_size: int = 1, etp_rank: int = 0, etp_size: int = 1
                   ) -> dict[str, torch.Tensor]:
    """This rank's Megatron state dict from a transformers-5 in-memory HF state dict.

    Raises ``LayoutError`` unless every HF tensor (bar DeepSeek MTP layers) is read exactly once.
    """
    mt = _get(hf_config, "model_type")
    L = int(_get(hf_config, "num_hidden_layers"))
    ng = int(_get(hf_config, "num_key_value_heads") or _get(hf_config, "num_attention_heads"))
    n_exp = expert_count(hf_config)
    pattern = moe_layer_pattern(hf_config) if n_exp else [0] * L
    mla = mt in MLA_TYPES
    hf = _Reads(hf_state)
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": _shard(hf["model.embed_tokens.weight"], 0, tp_rank, tp_size),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not _get(hf_config, "tie_word_embeddings", False):
        out["output_layer.weight"] = _shard(hf["lm_head.weight"], 0, tp_rank, tp_size)
    elif "lm_head.weight" in hf:
        hf["lm_head.weight"]  # tied: the same tensor as the embedding, consumed through it

    def mlp(src: str, dst: str) -> None:  # dense SwiGLU MLP / shared experts (TP-sharded)
        out[dst + "linear_fc1.weight"] = torch.cat(
            [_shard(hf[src + "gate_proj.weight"], 0, tp_rank, tp_size),
             _shard(hf[src + "up_proj.weight"], 0, tp_rank, tp_size)])
        out[dst + "linear_fc2.weight"] = _shard(hf[src + "down_proj.weight"], 1, tp_rank, tp_size)

    for i in range(L):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        a, s = h + "self_attn.", m + "self_attention."
        if mla:
            if a + "q_a_proj.weight" in hf:
                out[s + "linear_q_down_proj.weight"] = _shard(hf[a + "q_a_proj.weight"], 0, tp_rank, tp_size)
                out[s + "q_layernorm.weight"] = hf[a + "q_a_layernorm.weight"]
                out[s + "linear_q_up_proj.weight"] = _shard(hf[a + "q_b_proj.weight"], 0, tp_rank, tp_size)
            else:
                out[s + "linear_q_proj.weight"] = _shard(hf[a + "q_proj.weight"], 0, tp_rank, tp_size)
            out[s + "linear_kv_down_proj.weight"] = _shard(hf[a + "kv_a_proj_with_mqa.weight"], 0, tp_rank, tp_size)
            out[s + "kv_layernorm.weight"] = hf[a + "kv_a_layernorm.weight"]
            out[s + "linear_kv_up_proj.weight"] = _shard(hf[a + "kv_b_proj.weight"], 0, tp_rank, tp_size)
        else:
            out[s + "linear_qkv.weight"] = interleave_qkv(
                hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], ng, tp_rank, tp_size)
            if a + "q_proj.bias" in hf:
                out[s + "linear_qkv.bias"] = interleave_qkv(
                    hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], ng, tp_rank, tp_size)
            if a + "q_norm.weight" in hf:
                out[s + "q_layernorm.weight"] = hf[a + "q_norm.weight"]
                out[s + "k_layernorm.weight"] = hf[a + "k_norm.weight"]
        out[s + "linear_proj.weight"] = _shard(hf[a + "o_proj.weight"], 1, tp_rank, tp_size)
        if not pattern[i]:
            mlp(h + "mlp.", m + "mlp.")
            continue
        out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
        if h + "mlp.gate.e_score_correction_bias" in hf:
            out[m + "mlp.router.expert_bias"] = hf[h + "mlp.gate.e_score_correction_bias"]
        gate_up, down = hf[h + "mlp.experts.gate_up_proj"], hf[h + "mlp.experts.down_proj"]
        inter = gate_up.shape[1] // 2
        per_rank = n_exp // ep_size
        for le in range(per_rank):
            e = ep_rank * per_rank + le
            gate, up = gate_up[e, :inter], gate_up[e, inter:]
            x = f"{m}mlp.experts.local_experts.{le}."
            out[x + "linear_fc1.weight"] = torch.cat(
                [_shard(gate, 0, etp_rank, etp_size), _shard(up, 0, etp_rank, etp_size)])
            out[x + "linear_fc2.weight"] = _shard(down[e], 1, etp_rank, etp_size)
        for shared in ("shared_expert", "shared_experts"):
            if h + f"mlp.{shared}.gate_proj.weight" in hf:
                mlp(h + f"mlp.{shared}.", m + "mlp.shared_experts.")
        if h + "mlp.shared_expert_gate.weight" in hf:
            out[m + "mlp.shared_experts.gate_weight"] = hf[h + "mlp.shared_expert_gate.weight"]
    hf.check(L)
    return out


def megatron_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of ``model`` that HF weights write: the parameters and the router's ``expert_bias`` buffer."""
    targets = dict(model.named_parameters())
    for name, buf in model.named_buffers():
        if name.endswith("router.expert_bias"):
            targets[name] = buf
    return targets


def stage_offset(model: torch.nn.Module) -> int:
    """Global index of the model's first decoder layer (its pipeline stage's offset; 0 without PP): Megatron
    numbers a stage's layers ``layer_number`` = global index + 1 while its module names count from 0."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if not layers:
        return 0
    return int(layers[0].layer_number) - 1


def load_hf_weights(model: torch.nn.Module, hf_state: Mapping[str, torch.Tensor], hf_config: Any) -> None:
    """Copy HF weights into ``model`` (this rank's shards; under PP this stage's layers, the embedding on the first
    stage, the final norm and output layer on the last). Every Megatron parameter must be written and every HF
    tensor read exactly once by the whole-model conversion (``LayoutError`` otherwise)."""
    from megatron.core import parallel_state as ps

    from miles_lp.train.megatron.naming import stage_state

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    ep_rank, ep_size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    etp_rank, etp_size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    state = hf_to_megatron(hf_state, hf_config, tp_rank=tp_rank, tp_size=tp_size, ep_rank=ep_rank,
                           ep_size=ep_size, etp_rank=etp_rank, etp_size=etp_size)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        state = stage_state(state, stage_offset(model), len(model.decoder.layers),
                            first=ps.is_pipeline_first_stage(), last=ps.is_pipeline_last_stage())
    params = megatron_targets(model)
    missing = sorted(set(params) - set(state))
    extra = sorted(set(state) - set(params))
    if missing or extra:
        raise LayoutError(f"HF -> Megatron name map mismatch: Megatron parameters not written {missing[:6]}, "
                          f"converted tensors without a parameter {extra[:6]}")
    with torch.no_grad():
        for name, p in params.items():
            src = state[name]
            if tuple(src.shape) != tuple(p.shape):
                raise LayoutError(f"{name}: converted shape {tuple(src.shape)} != Megatron {tuple(p.shape)}")
            p.copy_(src.to(device=p.device, dtype=p.dtype))
