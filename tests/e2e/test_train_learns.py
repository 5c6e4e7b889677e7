"""The embedded trainer LEARNS under a low-precision plan ("trains" meant only a finite loss).

A learnable toy batch: four fixed random sequences of 64 tokens, trained on repeatedly (memorisation). Start
loss is ln(256) ~ 5.55 per token. Measured on this CPU (15 AdamW steps, lr 3e-3): the whole model falls to
0.49x (MXFP8 dense) / 0.50x (MXFP8 + NVFP4 experts); with every parameter frozen except the quantized
linears / experts, 0.80x / 0.81x, so the quantized layers' own gradients do the learning. The margins
below leave room for platform noise and fail if a quantized backward is broken (zero, wrong sign, stale grid).
"""

from __future__ import annotations

import json

import pytest
import torch

from miles_lp.checkpoint.tiny import make_tiny_model
from miles_lp.config import Where
from miles_lp.policy import compile_plan, get_layout, parse_policy
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer
from miles_lp.train.quant_linear import QuantExperts, QuantLinear

STEPS = 15
PLANS = {
    "qwen3": {"default": "mxfp8", "backward": "dequantized"},
    "qwen3_moe": {"default": "mxfp8", "backward": "dequantized",
                  "rules": [{"role": "routed_experts", "format": "nvfp4"}]},
}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: on the shared 2-core CI machine two OpenMP threads measured ~20x slower than one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("learn")
    return {a: make_tiny_model(a, root / a, num_layers=2) for a in PLANS}


def _plan(d, raw):
    return compile_plan(parse_policy(raw, Where("<test>", "precision")),
                        get_layout(json.loads((d / "config.json").read_text())))


def _batch():
    g = torch.Generator().manual_seed(0)
    return [{"tokens": torch.randint(0, 256, (64,), generator=g)} for _ in range(4)]


def _losses(d, plan, *, only_quantized=False, lr=3e-3) -> list[float]:
    tr = EmbeddedTrainer(d, plan, TrainConfig(lr=lr, micro_batch_tokens=256, grad_clip=1.0))
    if only_quantized:
        keep = {id(p) for m in tr.model.modules() if isinstance(m, QuantLinear | QuantExperts)
                for p in m.parameters()}
        assert keep, "the plan swapped in no quantized module"
        for p in tr.model.parameters():
            if id(p) not in keep:
                p.requires_grad_(False)
    batch = _batch()
    out = []
    for _ in range(STEPS):
        s = tr.train_step(batch)
        assert s["finite"] and not s["skipped"]
        out.append(s["loss"])
    return out


@pytest.mark.parametrize("arch", list(PLANS))
def test_loss_falls_by_a_third_on_a_learnable_batch(models, arch):
    d = models[arch]
    losses = _losses(d, _plan(d, PLANS[arch]))
    assert losses[0] == pytest.approx(5.55, abs=0.1)  # an untrained model: ~uniform over 256 tokens
    assert losses[-1] < 0.67 * losses[0], losses
    assert all(b < a for a, b in zip(losses[::3], losses[3::3], strict=False)), losses  # steadily


@pytest.mark.parametrize("arch", list(PLANS))
def test_the_quantized_layers_alone_learn(models, arch):
    """Only QuantLinear / QuantExperts parameters trainable: the loss still falls by >= 10%."""
    d = models[arch]
    losses = _losses(d, _plan(d, PLANS[arch]), only_quantized=True)
    assert losses[-1] < 0.9 * losses[0], losses


def test_mxfp8_training_tracks_bf16(models):
    """The same steps in BF16 (no plan): the MXFP8 run's final loss is within 5% of it."""
    d = models["qwen3"]
    bf16, mx = _losses(d, None), _losses(d, _plan(d, PLANS["qwen3"]))
    assert abs(mx[-1] - bf16[-1]) < 0.05 * bf16[-1], (mx[-1], bf16[-1])
    assert _losses(d, _plan(d, PLANS["qwen3"]), lr=0.0)[-1] == pytest.approx(mx[0], rel=1e-6)  # lr 0: no change
