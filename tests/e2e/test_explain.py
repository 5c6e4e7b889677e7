"""`miles-lp explain` on the DeepSeek-V3-shaped fixture and on a saved tiny model."""

import json
import math
from pathlib import Path

import pytest

from miles_lp.cli import main

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "deepseek_v3_config.json"


def test_explain_deepseek_v3_fixture(capsys, tmp_path):
    plan_path = tmp_path / "plan.json"
    rc = main(["explain", str(ROOT / "recipes" / "policies/deepseek-v3-mxfp8.yaml"), "--model", str(FIXTURE), "--mtp",
               "--save-plan", str(plan_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "61 layers + 1 MTP" in out
    assert "layers 51-60    routed_experts  bf16" in out
    assert "layers 3-50     routed_experts  mxfp8" in out
    assert "rules[2] role=mla_kv_b" in out and "compression" in out
    assert json.loads(plan_path.read_text())["num_layers"] == 61


def test_explain_json_and_warnings(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("precision:\n  default: mxfp8\n  rules:\n    - {role: attention, format: bf16}\n"
                      "    - {match: '*.o_proj', format: bf16}\n    - {match: '*.nothing', format: bf16}\n")
    rc = main(["explain", str(recipe), "--model", str(FIXTURE), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert report["totals"]["mxfp8"]["tensors"] > 40000
    assert any("shadowed" in w for w in report["warnings"]) and any("matched no tensor" in w for w in report["warnings"])


def test_explain_saved_tiny_model_uses_headers(capsys, tmp_path):
    pytest.importorskip("transformers")
    from miles_lp.checkpoint.tiny import make_tiny_model

    d = make_tiny_model("qwen3_moe", tmp_path / "m")
    rc = main(["explain", str(ROOT / "recipes" / "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"), "--model", str(d)])
    out = capsys.readouterr().out
    assert rc == 0 and "safetensors headers" in out and "nvfp4" in out


def test_explain_bad_recipe_exit_2(capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("precision:\n  default: mxfp8\n  rules:\n    - {layers: last 150%, format: bf16}\n")
    assert main(["explain", str(recipe), "--model", str(FIXTURE)]) == 2
    assert "r.yaml:4:" in capsys.readouterr().err


def test_explain_plot_writes_a_png(capsys, tmp_path):
    png = tmp_path / "plan.png"
    rc = main(["explain", str(ROOT / "recipes" / "policies/deepseek-v3-mxfp8.yaml"), "--model", str(FIXTURE), "--mtp",
               "--json", "--plot", str(png)])
    captured = capsys.readouterr()
    assert rc == 0
    json.loads(captured.out)  # the plot notice goes to stderr: --json output stays parseable
    assert f"plot written to {png}" in captured.err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 1500 and height > 500  # 62 layer columns + MTP, 13 role rows


def test_plan_grid_cells_follow_the_plan():
    from miles_lp.formats.spec import Format
    from miles_lp.policy import Role, compile_plan, get_layout, load_policy
    from miles_lp.policy.plot import plan_grid

    layout = get_layout(json.loads(FIXTURE.read_text()))
    plan = compile_plan(load_policy(ROOT / "recipes" / "policies/deepseek-v3-mxfp8.yaml"), layout,
                        layout.synthesize(include_mtp=True))
    grid = plan_grid(plan)
    assert grid.columns[0] == "model" and grid.columns[1:3] == ["0", "1"] and grid.columns[-1] == "mtp0"
    assert grid.roles.index(Role.ATTENTION_OUT) < grid.roles.index(Role.ROUTED_EXPERTS)
    cell = grid.cells
    assert set(cell[(Role.ROUTED_EXPERTS, "3")].params) == {Format.MXFP8}  # first MoE layer
    assert set(cell[(Role.ROUTED_EXPERTS, "60")].params) == {Format.BF16}  # last 15% (10 layers) bf16
    assert set(cell[(Role.ROUTED_EXPERTS, "50")].params) == {Format.MXFP8}
    assert (Role.ROUTED_EXPERTS, "2") not in cell  # first_k_dense_replace = 3: a dense MLP there
    assert set(cell[(Role.DENSE_MLP, "2")].params) == {Format.MXFP8}
    assert cell[(Role.ROUTER, "10")].invariant and not cell[(Role.SHARED_EXPERTS, "10")].invariant
    assert sum(grid.params.values()) == sum(math.prod(e.shape) for e in plan.entries.values())


def test_plot_cell_split_in_proportion():
    from miles_lp.formats.spec import Format
    from miles_lp.policy.plot import Cell

    assert Cell({Format.NVFP4: 3, Format.BF16: 1}, False).shares() == [(Format.BF16, 0.25), (Format.NVFP4, 0.75)]


def test_explain_bad_model_config_exit_2(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64}))
    assert main(["explain", str(ROOT / "recipes" / "policies/qwen3-mxfp8.yaml"), "--model", str(cfg)]) == 2
    assert f"--model {cfg}: the model config (model_type 'qwen3') has no 'num_hidden_layers'" in capsys.readouterr().err
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00")  # truncated: no 8-byte header
    cfg.write_text((ROOT / "tests" / "fixtures" / "deepseek_v3_config.json").read_text())
    assert main(["explain", str(ROOT / "recipes" / "policies/deepseek-v3-mxfp8.yaml"), "--model", str(tmp_path)]) == 2
    assert "model.safetensors: truncated safetensors file" in capsys.readouterr().err


def test_explain_refuses_an_already_quantized_checkpoint_and_says_where_its_plan_is(capsys, tmp_path):
    """A converted checkpoint's packed shapes and scales gave a confident, wrong plan table."""
    from miles_lp.checkpoint.tiny import make_tiny_model

    src = make_tiny_model("qwen3", tmp_path / "m", num_layers=1)
    out = tmp_path / "c"
    assert main(["convert", "--hf-checkpoint", str(src), "--output", str(out), "--format", "mxfp8"]) == 0
    capsys.readouterr()
    assert main(["explain", "recipes/tiny-mxfp8.yaml", "--model", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already-quantized checkpoint (quant_method='mxfp8')" in err and "miles_lp_plan.json" in err
    assert main(["explain", "recipes/tiny-mxfp8.yaml", "--model", str(src)]) == 0  # its BF16 source still plans
