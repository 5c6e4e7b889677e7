"""Megatron -> HF naming: HF -> Megatron -> HF is the identity byte for byte on every tiny
architecture the Megatron backend builds, at tp = 1 and with tp = 2 shards gathered; quantized grids of TP
shards gather into the converter's grid (2 gloo CPU ranks: NVFP4 global amax all-reduced over the group)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.config import Where
from miles_lp.errors import LayoutError
from miles_lp.io.safetensors_io import open_checkpoint, read_tensor
from miles_lp.policy import parse_policy
from miles_lp.train.megatron.model import SUPPORTED, hf_to_megatron
from miles_lp.train.megatron.naming import gather_shards, megatron_to_hf, shard_kind

ARCHS = ("llama", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            import transformers

            d = make_tiny_model(arch, tmp_path_factory.mktemp(arch), num_layers=3)
            model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16)
            cache[arch] = (d, model.config, model.state_dict())
        return cache[arch]
    return get


def same_bytes(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_identity(d, hf):
    ck = open_checkpoint(d).tensors
    assert set(hf) == set(ck), sorted(set(hf) ^ set(ck))[:6]
    bad = [n for n in ck if not same_bytes(hf[n], read_tensor(ck[n]))]
    assert not bad, bad[:6]


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_megatron_hf_is_the_identity(tiny, arch):
    assert arch in SUPPORTED
    d, cfg, sd = tiny(arch)
    assert_identity(d, megatron_to_hf(hf_to_megatron(sd, cfg), cfg))


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_shards_gather_into_the_identity(tiny, arch):
    d, cfg, sd = tiny(arch)
    ranks = [hf_to_megatron(sd, cfg, tp_rank=r, tp_size=2, etp_rank=r, etp_size=2) for r in range(2)]
    assert any(not torch.equal(ranks[0][n], ranks[1][n]) for n in ranks[0] if shard_kind(n) != "replicated")
    full = {n: gather_shards(n, [s[n] for s in ranks]) for n in ranks[0]}
    assert_identity(d, megatron_to_hf(full, cfg))


def test_refusals(tiny):
    d, cfg, sd = tiny("qwen3")
    meg = hf_to_megatron(sd, cfg)
    with pytest.raises(LayoutError, match="not consumed.*extra"):
        megatron_to_hf({**meg, "decoder.layers.0.extra": torch.zeros(1)}, cfg)
    with pytest.raises(LayoutError, match="has no 'decoder.layers.1.pre_mlp_layernorm.weight'"):
        megatron_to_hf({k: v for k, v in meg.items() if k != "decoder.layers.1.pre_mlp_layernorm.weight"}, cfg)
    n = "decoder.layers.0.input_layernorm.weight"
    with pytest.raises(LayoutError, match="replicated.*disagree"):
        gather_shards(n, [meg[n], meg[n] + 1])


# ---------------------------------------------------------------------------------------------------------
# quantized grids under TP = 2: two gloo ranks
# ---------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, world: int, port: int, jobs: list, megatron_job: tuple | None) -> None:
    """One TP rank (spawned: a fork of a long pytest process can crash in gloo/Megatron set-up). Phase 1, per
    (folder, recipes, config) job: its shards (written by the parent), the forward grid of each quantized weight
    with the NVFP4 amax all-reduced over the group, all-gathered, named; rank 0 writes them. Phase 2: a real
    Megatron model at tp = world (``_megatron_phase``). One spawn for both: the child's imports are most of its
    time."""
    from safetensors.torch import load_file, save_file

    from miles_lp.export.tensors import is_quantized
    from miles_lp.train.grid import WeightGrid
    from miles_lp.train.megatron.export import all_gather_value
    from miles_lp.train.megatron.naming import tp_amax_reduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = torch.distributed.new_group(list(range(world)))
        for shard_dir, recipes, hf_config in jobs:
            shard = load_file(os.path.join(shard_dir, f"rank{rank}.safetensors"))
            full = {}
            for name, w in shard.items():
                recipe = recipes.get(name)
                if recipe is None:
                    full[name] = all_gather_value(w, group)
                    continue
                grid = WeightGrid(recipe)
                grid.amax_reduce = tp_amax_reduce(group)  # what the Megatron layers install under TP
                full[name] = all_gather_value(grid.rowwise(w.float()), group)
            hf = megatron_to_hf({n: gather_shards(n, parts) for n, parts in full.items()}, hf_config)
            if rank == 0:
                flat = {}
                for n, v in hf.items():
                    for k, t in (v.components() if is_quantized(v) else {"tensor": v}).items():
                        flat[f"{n}::{k}"] = t.contiguous().clone()  # gate/up share one scale tensor
                save_file(flat, os.path.join(shard_dir, "gathered.safetensors"))
        if megatron_job is not None:
            _megatron_phase(rank, world, *megatron_job)
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def tp2_run(tiny, tmp_path_factory):
    """One spawn of two gloo ranks for both TP tests below; returns (folder, cases, plans)."""
    pytest.importorskip("megatron.core")
    tmp_path = tmp_path_factory.mktemp("tp2")
    from safetensors.torch import save_file

    from miles_lp.cli.convert import policy_for_format
    from miles_lp.train.embedded import plan_for_model
    from miles_lp.train.recipe import LinearRecipe

    cases = {"qwen3_moe": policy_for_format("mxfp8+nvfp4-experts"),
             "qwen3": parse_policy({"default": "nvfp4", "backward": "high_precision"}, Where("<t>", "precision"))}
    jobs, plans = [], {}
    for arch, policy in cases.items():
        d, cfg, sd = tiny(arch)
        plan = plans[arch] = plan_for_model(policy, d)
        (tmp_path / arch).mkdir()
        for r in range(2):
            shard = hf_to_megatron(sd, cfg, tp_rank=r, tp_size=2, etp_rank=r, etp_size=2)
            save_file({k: v.contiguous() for k, v in shard.items()}, str(tmp_path / arch / f"rank{r}.safetensors"))
        recipes = {}
        for name, w in shard.items():
            entries = [plan.entries[m] for m in plan.layout.describe(name).members if m in plan.entries]
            if entries and name.endswith("weight") and w.dim() == 2:
                recipe = LinearRecipe.from_entry(entries[0], name=name)
                if recipe is not None:
                    recipes[name] = recipe
        jobs.append((str(tmp_path / arch), recipes, cfg.to_dict()))
    (tmp_path / "megatron").mkdir()
    megatron_job = (str(tiny("qwen3")[0]), str(tiny("qwen3_moe")[0]), str(tmp_path / "megatron"))
    torch.multiprocessing.spawn(_tp_worker, args=(2, _free_port(), jobs, megatron_job), nprocs=2, join=True)
    return tmp_path, cases, plans


def test_tp2_gloo_grids_equal_the_converter(tiny, tp2_run):
    """Two gloo ranks, each quantizing its shards (the NVFP4 global amax all-reduced MAX over the TP group); the
    grids all-gathered and named equal, byte for byte, what `miles-lp convert` writes for the same weights:
    qwen3_moe with MXFP8 + NVFP4 experts, qwen3 all NVFP4 (q/k/v and gate/up share one scale)."""
    from safetensors.torch import load_file

    from miles_lp.checkpoint.convert import convert_checkpoint
    from miles_lp.export import naming
    from miles_lp.formats import Format

    tmp_path, cases, plans = tp2_run
    for arch, policy in cases.items():
        d, plan = tiny(arch)[0], plans[arch]
        got: dict = {}
        for key, t in load_file(str(tmp_path / arch / "gathered.safetensors")).items():
            n, k = key.split("::")
            if k == "tensor":
                got[n] = t
            else:
                got.setdefault(n, {})[k] = t
        conv = tmp_path / arch / "conv"
        convert_checkpoint(d, conv, policy, progress=False, log=lambda s: None)
        disk = {n: read_tensor(h) for n, h in open_checkpoint(conv).tensors.items()}
        checked = 0
        for name, v in got.items():
            f_ = plan.format_for(name)
            if f_ is Format.BF16:
                assert same_bytes(v, disk[name]), name
                continue

            class _Q:  # the components under the codec's names, encoded as convert encodes them
                format = f_

                def components(self, v=v):
                    return v
            for k, t in naming.encode("sglang", f_, name, _Q()).items():
                assert same_bytes(t, disk[k]), (arch, k)
                checked += 1
        assert checked > 50 and set(got) == set(open_checkpoint(d).tensors)


def _megatron_ep_phase(rank: int, world: int, d: str, out_dir: str) -> None:
    """A real Megatron MoE at expert parallel = world (tp = 1): each rank holds E/world experts; the export
    all-gathers them over the EP group under their global names; rank 0 writes the engine tensors."""
    import transformers
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from miles_lp.cli.convert import policy_for_format
    from miles_lp.export import engine_tensors
    from miles_lp.train.embedded import SourceInfo, plan_for_model
    from miles_lp.train.megatron.export import megatron_export_weights
    from miles_lp.train.megatron.layers import attach_plan
    from miles_lp.train.megatron.model import build_gpt_model, load_hf_weights

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        meg = build_gpt_model(hf.config, quantized=True, ep=world)
        load_hf_weights(meg, hf.state_dict(), hf.config)
        assert len(meg.decoder.layers[0].mlp.experts.local_experts) == hf.config.num_experts // world
        plan = plan_for_model(policy_for_format("mxfp8+nvfp4-experts"), d)
        attach_plan(meg, plan, plan.layout)
        exported = list(megatron_export_weights(meg, hf.config, ep_group=ps.get_expert_model_parallel_group(),
                                                dtypes=SourceInfo.from_checkpoint(d).dtypes))
        if rank == 0:
            flat = {k: v.contiguous().clone() for k, v in engine_tensors(exported, plan, "sglang")}
            save_file(flat, os.path.join(out_dir, "ep.safetensors"))
    finally:
        ps.destroy_model_parallel()


def _megatron_phase(rank: int, world: int, d: str, d_moe: str, out_dir: str) -> None:
    """One rank of a real Megatron GPT model at tp = 2 (gloo, CPU): build, load HF weights, attach each plan,
    export under HF names (grids gathered over the TP group); rank 0 writes the results."""
    import transformers
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from miles_lp.export import engine_tensors
    from miles_lp.train.embedded import SourceInfo, plan_for_model
    from miles_lp.train.megatron.export import megatron_export_weights
    from miles_lp.train.megatron.layers import attach_plan
    from miles_lp.train.megatron.model import build_gpt_model, load_hf_weights
    from miles_lp.train.quant_linear import invalidate_grids

    ps.initialize_model_parallel(world, 1)
    try:
        group = ps.get_tensor_model_parallel_group()
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        meg = build_gpt_model(hf.config, quantized=True, tp=world)
        load_hf_weights(meg, hf.state_dict(), hf.config)
        dtypes = SourceInfo.from_checkpoint(d).dtypes
        for tag, raw in (("nvfp4", {"default": "nvfp4", "backward": "high_precision"}), ("mxfp8", {"default": "mxfp8"})):
            plan = plan_for_model(parse_policy(raw, Where("<t>", "precision")), d)
            attach_plan(meg, plan, plan.layout)
            exported = list(megatron_export_weights(meg, hf.config, tp_group=group, dtypes=dtypes))
            if rank == 0:
                flat = {k: v.contiguous().clone() for k, v in engine_tensors(exported, plan, "sglang")}
                save_file(flat, os.path.join(out_dir, f"{tag}.safetensors"))
        # fault injection: an NVFP4 shard quantized with its own amax (no reduction) is refused by the gather
        plan = plan_for_model(parse_policy({"default": "nvfp4"}, Where("<t>", "precision")), d)
        attach_plan(meg, plan, plan.layout)
        proj = meg.decoder.layers[0].self_attention.linear_proj
        assert proj.grid.amax_reduce is not None  # set_recipe installed the TP reduction
        proj.grid.amax_reduce = None
        invalidate_grids(meg)
        try:
            list(megatron_export_weights(meg, hf.config, tp_group=group))
            verdict = "not refused"
        except LayoutError as exc:
            verdict = str(exc)
        from miles_lp.errors import ConfigError
        from miles_lp.train.quant_linear import learner_weights

        try:  # the per-module walker would yield a shard: refused, pointing at the gathering export
            list(learner_weights(meg))
            verdict += "\nlearner_weights not refused"
        except ConfigError as exc:
            verdict += "\n" + str(exc)
        if rank == 0:
            with open(os.path.join(out_dir, "fault.txt"), "w") as f:
                f.write(verdict)
    finally:
        ps.destroy_model_parallel()
    _megatron_ep_phase(rank, world, d_moe, out_dir)


def test_real_megatron_tp2_export_equals_the_embedded_export(tiny, tp2_run):
    """Megatron's own ColumnParallel / RowParallel linears at tp = 2 on 2 gloo ranks: the learner's export under HF
    names (grids all-gathered; NVFP4 amax MAX-reduced over the TP group by set_recipe) equals the embedded
    learner's export (= `miles-lp convert`) byte for byte, all NVFP4 and all MXFP8; without the reduction the
    ranks' global scales differ and the gather refuses it."""
    from safetensors.torch import load_file

    from miles_lp.cli.export import learner_from_hf
    from miles_lp.export import engine_tensors

    d, tmp_path = tiny("qwen3")[0], tp2_run[0] / "megatron"
    for tag, raw in (("nvfp4", {"default": "nvfp4", "backward": "high_precision"}), ("mxfp8", {"default": "mxfp8"})):
        learner = learner_from_hf(d, parse_policy(raw, Where("<t>", "precision")))
        want = dict(engine_tensors(learner.export_weights(), learner.plan, "sglang"))
        got = load_file(str(tmp_path / f"{tag}.safetensors"))
        assert got.keys() == want.keys()
        bad = [k for k in want if not same_bytes(got[k], want[k])]
        assert not bad, (tag, bad[:5])
    fault = (tmp_path / "fault.txt").read_text()
    assert "differs between tensor-parallel ranks" in fault and "megatron_export_weights" in fault


def test_real_megatron_ep2_export_gathers_the_experts(tiny, tp2_run):
    """Megatron MoE at expert parallel 2 (each rank 2 of 4 experts): the export all-gathers the experts over the
    EP group under their global names and equals the embedded learner's export byte for byte."""
    from safetensors.torch import load_file

    from miles_lp.cli.convert import policy_for_format
    from miles_lp.cli.export import learner_from_hf
    from miles_lp.export import engine_tensors

    d = tiny("qwen3_moe")[0]
    learner = learner_from_hf(d, policy_for_format("mxfp8+nvfp4-experts"))
    want = dict(engine_tensors(learner.export_weights(), learner.plan, "sglang"))
    got = load_file(str(tp2_run[0] / "megatron" / "ep.safetensors"))
    assert got.keys() == want.keys() and "model.layers.2.mlp.experts.3.down_proj.weight_scale_2" in got
    bad = [k for k in want if not same_bytes(got[k], want[k])]
    assert not bad, bad[:5]
