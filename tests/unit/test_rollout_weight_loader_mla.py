"""The custom weight loader on a module tree shaped like SGLang's DeepSeek-V3 (MLA with q_lora_rank:
``fused_qkv_a_proj_with_mqa``; FusedMoE experts with the shared expert fused in as the last expert, or a separate
``shared_experts`` MLP). SGLang itself does not run on these machines: ``FakeDeepseek.load_weights`` reproduces the
behaviour of SGLang's DeepSeek ``load_weights`` as read from its models/deepseek_v2.py (written here, not copied):
q_a_proj / kv_a_proj_with_mqa halves cached per call and loaded as ``cat([q_a, kv_a], 0)`` once both are in (a 0-d
tensor: q_a's alone; an unpaired half dropped at the end of the call); gate/up and experts through shard loaders;
the shared expert renamed to ``experts.{E}`` when fused; layers past ``num_layers`` (MTP) skipped."""

from __future__ import annotations

import re

import pytest
import torch

from miles_lp import formats
from miles_lp.rollout import weight_loader as wl
from miles_lp.rollout.engine import EngineError
from miles_lp.rollout.weight_loader import load_weights

H, QR, KVR, MI, E, L = 64, 64, 48, 32, 2, 2  # hidden, q_lora_rank, kv_lora_rank + rope dim, moe width, experts, layers


def _swizzle_rows(scale: torch.Tensor) -> torch.Tensor:
    return formats.swizzle_scales(scale.reshape(-1, scale.shape[-1])).reshape(-1)


class MXFP8Linear(torch.nn.Module):
    """SGLang-shaped quantized linear: canonical ``weight`` / ``weight_scale_inv`` (+ an optional 0-d
    ``input_scale``), post-processing that allocates a NEW swizzled scale each time (FlashInfer's path)."""

    backend = "flashinfer_cutlass"

    def __init__(self, n: int, k: int, input_scale: bool = False):
        super().__init__()
        self.quant_method = self
        self.register_parameter("weight", torch.nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn), False))
        self.register_parameter("weight_scale_inv", torch.nn.Parameter(torch.zeros(n, k // 32, dtype=torch.uint8),
                                                                       False))
        if input_scale:
            self.register_parameter("input_scale", torch.nn.Parameter(torch.ones(()), False))

    def process_weights_after_loading(self, layer) -> None:
        layer.weight_scale_inv_swizzled = torch.nn.Parameter(_swizzle_rows(layer.weight_scale_inv.data), False)

    def forward(self, x):
        n, k = self.weight.shape
        scale = formats.unswizzle_scales(self.weight_scale_inv_swizzled.data.reshape(-1, (k // 32 + 3) // 4 * 4),
                                         n, k // 32)
        return x @ formats.MXFP8Tensor(self.weight.data, scale).dequantize(torch.float32).T


class FusedMoE(torch.nn.Module):
    """SGLang FusedMoE shape: ``w13_*`` [E, 2 MI, H] (gate rows then up rows), ``w2_*`` [E, H, MI], one module per
    layer, derived swizzled scales for the whole layer."""

    def __init__(self, experts: int):
        super().__init__()
        self.quant_method = self
        for w, (n, k) in (("w13", (2 * MI, H)), ("w2", (H, MI))):
            self.register_parameter(f"{w}_weight", torch.nn.Parameter(
                torch.empty(experts, n, k, dtype=torch.float8_e4m3fn), False))
            self.register_parameter(f"{w}_weight_scale_inv", torch.nn.Parameter(
                torch.zeros(experts, n, k // 32, dtype=torch.uint8), False))

    def process_weights_after_loading(self, layer) -> None:
        for w in ("w13", "w2"):
            setattr(layer, f"{w}_scale_swizzled", torch.nn.Parameter(
                _swizzle_rows(getattr(layer, f"{w}_weight_scale_inv").data), False))

    def load_expert(self, suffix: str, t: torch.Tensor, expert: int, shard: str) -> None:
        param = getattr(self, ("w2_" if shard == "down" else "w13_") + suffix)
        rows = {"gate": slice(0, MI), "up": slice(MI, 2 * MI), "down": slice(None)}[shard]
        param.data[expert, rows].copy_(t)


class MergedLinear(MXFP8Linear):
    """``gate_up_proj``: two shards written by their own loader (``shard_id``)."""

    def load_shard(self, suffix: str, t: torch.Tensor, shard: int) -> None:
        getattr(self, suffix).data[shard * (t.shape[0]):(shard + 1) * t.shape[0]].copy_(t)


class Norm(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n), False)


class Attn(torch.nn.Module):
    def __init__(self, input_scale: bool):
        super().__init__()
        self.fused_qkv_a_proj_with_mqa = MXFP8Linear(QR + KVR, H, input_scale)
        self.q_a_layernorm, self.kv_a_layernorm = Norm(QR), Norm(KVR)
        self.q_b_proj, self.kv_b_proj, self.o_proj = MXFP8Linear(64, QR), MXFP8Linear(64, 32), MXFP8Linear(H, 64)


class Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.down_proj = MergedLinear(2 * MI, H), MXFP8Linear(H, MI)


class MLP(torch.nn.Module):
    def __init__(self, fuse_shared: bool):
        super().__init__()
        self.experts = FusedMoE(E + int(fuse_shared))
        if not fuse_shared:
            self.shared_experts = Shared()


class Layer(torch.nn.Module):
    def __init__(self, fuse_shared: bool, input_scale: bool):
        super().__init__()
        self.self_attn, self.mlp = Attn(input_scale), MLP(fuse_shared)


class Inner(torch.nn.Module):
    def __init__(self, fuse_shared: bool, input_scale: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(fuse_shared, input_scale) for _ in range(L))


class FakeDeepseek(torch.nn.Module):
    def __init__(self, fuse_shared: bool = True, input_scale: bool = False, order: str = "q_first"):
        super().__init__()
        self.model = Inner(fuse_shared, input_scale)
        self.fuse_shared, self.order = fuse_shared, order

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        mods = dict(self.named_modules())
        cache: dict[str, torch.Tensor] = {}  # local to this call, as SGLang's
        for name, t in weights:
            if int(name.split(".")[2]) >= L:  # DeepSeek's MTP layer: not this model's
                continue
            if self.fuse_shared and ".mlp.shared_experts." in name:
                name = name.replace(".mlp.shared_experts.", f".mlp.experts.{E}.")
            m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.(\w+)", name)
            if m:
                mods[m.group(1)].load_expert(m.group(4), t, int(m.group(2)), m.group(3))
                continue
            m = re.fullmatch(r"(.*)\.(gate|up)_proj\.(\w+)", name)
            if m:
                mods[f"{m.group(1)}.gate_up_proj"].load_shard(m.group(3), t, int(m.group(2) == "up"))
                continue
            if "q_a_proj" in name or "kv_a_proj_with_mqa" in name:
                cache[name] = t
                q = name.replace("kv_a_proj_with_mqa", "q_a_proj")
                kv = q.replace("q_a_proj", "kv_a_proj_with_mqa")
                if q in cache and kv in cache:
                    parts = [cache.pop(q), cache.pop(kv)]
                    fused = parts[0] if parts[0].dim() == 0 else torch.cat(
                        parts if self.order == "q_first" else parts[::-1], dim=0)
                    params[q.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")].data.copy_(fused)
                continue
            params[name].data.copy_(t)


def _mx(seed: int, n: int, k: int):
    q = formats.quantize_mxfp8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return q.data, q.scale


def checkpoint(seed: int, input_scale: float | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's own names (what the learner exports for SGLang's MXFP8 target; ``input_scale``: a 0-d
    per-tensor value on both halves of the fused MLA projection)."""
    out: dict[str, torch.Tensor] = {}
    s = seed * 1000

    def lin(name, n, k):
        nonlocal s
        s += 1
        out[f"{name}.weight"], out[f"{name}.weight_scale_inv"] = _mx(s, n, k)

    for i in range(L):
        a = f"model.layers.{i}.self_attn"
        lin(f"{a}.q_a_proj", QR, H)
        lin(f"{a}.kv_a_proj_with_mqa", KVR, H)
        if input_scale is not None:
            out[f"{a}.q_a_proj.input_scale"] = torch.tensor(input_scale)
            out[f"{a}.kv_a_proj_with_mqa.input_scale"] = torch.tensor(input_scale)
        out[f"{a}.q_a_layernorm.weight"] = torch.full((QR,), 1.0 + seed)
        out[f"{a}.kv_a_layernorm.weight"] = torch.full((KVR,), 2.0 + seed)
        lin(f"{a}.q_b_proj", 64, QR)
        lin(f"{a}.kv_b_proj", 64, 32)
        lin(f"{a}.o_proj", H, 64)
        for e in range(E):
            for p, (n, k) in (("gate_proj", (MI, H)), ("up_proj", (MI, H)), ("down_proj", (H, MI))):
                lin(f"model.layers.{i}.mlp.experts.{e}.{p}", n, k)
        for p, (n, k) in (("gate_proj", (MI, H)), ("up_proj", (MI, H)), ("down_proj", (H, MI))):
            lin(f"model.layers.{i}.mlp.shared_experts.{p}", n, k)
    return out


def fresh(seed: int, fuse_shared: bool = True, input_scale: float | None = None) -> FakeDeepseek:
    """An engine started from checkpoint ``seed``: load, then post-process every module once (SGLang's start)."""
    m = FakeDeepseek(fuse_shared, input_scale is not None)
    m.load_weights(checkpoint(seed, input_scale).items())
    for mod in m.modules():
        if getattr(mod, "quant_method", None) is not None:
            mod.quant_method.process_weights_after_loading(mod)
    return m


def _state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{n}.{a}": t for n, mod in m.named_modules() for a, t in wl._tensors(mod).items()}


def _same(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    return [k for k in sa if not torch.equal(wl._bytes(sa[k]), wl._bytes(sb[k]))]


FUSED = "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa"


@pytest.mark.parametrize("fuse_shared", [True, False])
def test_update_equals_fresh_load_and_rebuilds_the_fused_mla_projection(fuse_shared):
    eng = fresh(0, fuse_shared=fuse_shared)
    ptrs = {k: t.data_ptr() for k, t in _state(eng).items()}
    new = checkpoint(1)
    # SGLang's tensor path alone (model.load_weights, no post-processing): the fused module serves stale scales
    stale = fresh(0, fuse_shared=fuse_shared)
    stale.load_weights(new.items())
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(5))
    target = fresh(1, fuse_shared=fuse_shared)
    assert not torch.equal(stale.model.layers[0].self_attn.fused_qkv_a_proj_with_mqa(x),
                           target.model.layers[0].self_attn.fused_qkv_a_proj_with_mqa(x))
    report = load_weights(eng, list(new.items()))
    touched = set(report["touched"])
    for i in range(L):
        a = f"model.layers.{i}.self_attn"
        assert {f"{a}.fused_qkv_a_proj_with_mqa", f"{a}.q_b_proj", f"{a}.kv_b_proj", f"{a}.o_proj",
                f"model.layers.{i}.mlp.experts"} <= touched
        if not fuse_shared:
            assert {f"model.layers.{i}.mlp.shared_experts.gate_up_proj",
                    f"model.layers.{i}.mlp.shared_experts.down_proj"} <= touched
    assert _same(eng, target) == []  # every canonical and derived tensor byte-equal to a fresh load of the update
    assert {k: t.data_ptr() for k, t in _state(eng).items()} == ptrs  # the captured storage kept
    assert torch.equal(eng.model.layers[0].self_attn.fused_qkv_a_proj_with_mqa(x),
                       target.model.layers[0].self_attn.fused_qkv_a_proj_with_mqa(x))
    # the fused bytes were compared with cat([q_a, kv_a], 0) for the weight and its per-block scales
    assert sorted(report["fused_checked"]) == sorted(f"model.layers.{i}.self_attn.fused_qkv_a_proj_with_mqa.{t}"
                                                     for i in range(L) for t in ("weight", "weight_scale_inv"))
    fused = eng.model.layers[1].self_attn.fused_qkv_a_proj_with_mqa
    assert torch.equal(fused.weight_scale_inv[:QR], new["model.layers.1.self_attn.q_a_proj.weight_scale_inv"])
    assert torch.equal(fused.weight_scale_inv[QR:], new["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"])


def test_without_the_mla_mapping_the_loader_refuses_instead_of_leaving_it_stale(monkeypatch):
    """The table before this fix (q/k/v and gate/up only): the fused module has no owner; the loader now refuses
    a quantized weight it cannot place rather than skipping its post-processing (M14's silent stale state)."""
    old = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
           (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))
    monkeypatch.setattr(wl, "STACKED", old)
    eng = fresh(0)
    before = eng.model.layers[0].self_attn.fused_qkv_a_proj_with_mqa.weight.clone()
    with pytest.raises(EngineError, match=r"'model\.layers\.0\.self_attn\.q_a_proj\.weight' \(4 quantized weight\(s\) "
                                          r"in all\) maps to no module with post-processing"):
        load_weights(eng, list(checkpoint(1).items()))
    assert torch.equal(wl._bytes(eng.model.layers[0].self_attn.fused_qkv_a_proj_with_mqa.weight), wl._bytes(before))


@pytest.mark.parametrize("drop", ["kv_a_proj_with_mqa.weight", "q_a_proj.weight_scale_inv"])
def test_a_bucket_with_half_of_the_pair_is_refused_before_loading(drop):
    eng = fresh(0)
    new = checkpoint(1)
    bucket = [(n, t) for n, t in new.items() if n.startswith("model.layers.0.self_attn.")
              and not n.endswith(drop)]
    before = {k: t.clone() for k, t in _state(eng).items()}
    other = "kv_a_proj_with_mqa" if drop.startswith("kv") else "q_a_proj"
    with pytest.raises(EngineError, match=rf"without model\.layers\.0\.self_attn\.{other}\.{drop.split('.')[1]} in "
                                          r"the same call: SGLang assembles .*fused_qkv_a_proj_with_mqa"):
        load_weights(eng, bucket)
    assert all(torch.equal(wl._bytes(t), wl._bytes(before[k])) for k, t in _state(eng).items())  # nothing written


def test_per_tensor_scales_of_the_pair_must_agree():
    eng = fresh(0, input_scale=0.5)
    new = checkpoint(1, input_scale=0.25)
    report = load_weights(eng, list(new.items()))
    assert f"{FUSED}.input_scale" in report["fused_checked"]
    assert eng.model.layers[0].self_attn.fused_qkv_a_proj_with_mqa.input_scale.item() == 0.25
    new["model.layers.1.self_attn.kv_a_proj_with_mqa.input_scale"] = torch.tensor(0.125)
    with pytest.raises(EngineError, match=r"layers\.1\.self_attn\.fused_qkv_a_proj_with_mqa\.input_scale: the shards' "
                                          r"per-tensor values differ \(q_a_proj: 0\.25, kv_a_proj_with_mqa: 0\.125\)"):
        load_weights(eng, list(new.items()))


def test_a_fusion_in_another_order_is_caught_after_the_load():
    """An engine version concatenating kv_a before q_a (same shapes): the byte check of the fused module fails."""
    eng = fresh(0)
    eng.order = "kv_first"
    with pytest.raises(EngineError, match=r"fused_qkv_a_proj_with_mqa\.weight': after the update its bytes are not "
                                          r"q_a_proj \+ kv_a_proj_with_mqa concatenated along dim 0"):
        load_weights(eng, list(checkpoint(1).items()))


def test_names_outside_this_model_and_bf16_names():
    eng = fresh(0)
    new = checkpoint(1)
    # DeepSeek's MTP layer (index L) is the draft model's: skipped by SGLang's loader, not refused here
    mtp = {n.replace("model.layers.1.", f"model.layers.{L}."): t for n, t in new.items()
           if n.startswith("model.layers.1.")}
    report = load_weights(eng, list({**new, **mtp}.items()))
    assert _same(eng, fresh(1)) == []
    assert not any(f"layers.{L}." in t for t in report["touched"])
    # norms (BF16, no scale) belong to no post-processed module: loaded, nothing refused
    norm = [("model.layers.0.self_attn.q_a_layernorm.weight", torch.full((QR,), 7.0))]
    assert load_weights(eng, norm)["touched"] == []
    assert torch.equal(eng.model.layers[0].self_attn.q_a_layernorm.weight, torch.full((QR,), 7.0))
    # a quantized weight of a held layer under a name no module here has: refused before loading
    qb = "model.layers.0.self_attn.q_b_proj"
    bad = [("model.layers.0.self_attn.q_proj.weight", new[f"{qb}.weight"]),
           ("model.layers.0.self_attn.q_proj.weight_scale_inv", new[f"{qb}.weight_scale_inv"])]
    with pytest.raises(EngineError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' \(1 quantized weight\(s\) in "
                                          r"all\) maps to no module"):
        load_weights(eng, bad)


def test_stacked_table_comes_from_the_policy_fused_modules():
    from miles_lp.policy.consumers import PACKED_MODULES

    assert {(s, f) for s, f in wl.STACKED} == {(f".{sh}", f".{fu}") for fu, shs in PACKED_MODULES.items() for sh in shs}
    assert (".kv_a_proj_with_mqa", ".fused_qkv_a_proj_with_mqa") in wl.STACKED


def test_deepseek_names_on_the_reference_engine_layers():
    """The same loader on the reference engine's DeepSeek-V3 layers (transformers' tree: q_a_proj and
    kv_a_proj_with_mqa are modules of their own, no fused module): nothing refused, every quantized layer
    rebuilt in place, the update serves as a fresh load does."""
    from safetensors.torch import load_file

    from miles_lp.rollout.engine import SamplingParams
    from miles_lp.rollout.reference import ReferenceEngine
    from miles_lp.rollout.testing import tiny_checkpoint

    torch.set_num_threads(1)
    eng = ReferenceEngine(tiny_checkpoint("deepseek_v3", "policies/deepseek-v3-mxfp8.yaml"), device="cpu")
    other = tiny_checkpoint("deepseek_v3", "policies/deepseek-v3-mxfp8.yaml", seed=1)
    new = {}
    for f in sorted(other.glob("*.safetensors")):
        new.update(load_file(f))
    ptrs, targets = eng.storage_pointers(), eng._captured

    def load(named):
        for n, t in named:
            targets[n].copy_(t)

    report = load_weights(eng.model, list(new.items()), load=load)
    quantized = {n.rpartition(".")[0] for n in new if n.endswith(".weight_scale_inv")}
    assert quantized <= set(report["touched"]) and any(".q_a_proj" in n for n in quantized)
    assert report["fused_checked"] == [] and eng.storage_pointers() == ptrs
    sp = SamplingParams(max_new_tokens=4, seed=1)
    a, b = eng.generate([[1, 2, 3]], sp)[0], ReferenceEngine(other, device="cpu").generate([[1, 2, 3]], sp)[0]
    assert a.output_ids == b.output_ids and torch.equal(a.logprobs, b.logprobs)
