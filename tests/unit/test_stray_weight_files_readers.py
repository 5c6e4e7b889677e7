"""Readers outside miles_lp.checkpoint take the model's weight files from ``select_weight_files``:
a stray ``consolidated.safetensors`` beside the model is neither reloaded into vLLM nor part of its identity."""

import torch
from safetensors.torch import save_file

from miles_lp.checkpoint.tiny import make_tiny_model


def _with_stray(tmp_path):
    model = make_tiny_model("qwen3", tmp_path / "m", num_layers=1)
    before = sorted(model.glob("*.safetensors"))
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, str(model / "consolidated.safetensors"))
    return model, before


def test_vllm_worker_reload_reads_the_model_files_only(tmp_path):
    from safetensors.torch import load_file

    from miles_lp.rollout.vllm_worker import _checkpoint_tensors

    model, files = _with_stray(tmp_path)
    got = _checkpoint_tensors(str(model))
    want = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert set(got) == set(want) and "layers.0.attention.wq.weight" not in got
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_report_model_identity_ignores_a_stray_file(tmp_path):
    from miles_lp.report.matching import _file_sha

    model = make_tiny_model("qwen3", tmp_path / "m", num_layers=1)
    clean = _file_sha(model)
    save_file({"x": torch.zeros(2)}, str(model / "consolidated.safetensors"))
    assert _file_sha(model) == clean
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:-1] + b" ")
    assert _file_sha(model) != clean  # the model's own file still counts
