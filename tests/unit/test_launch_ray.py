"""Ray launcher pieces that need no cluster: address checks and placement bundles."""

from __future__ import annotations

import socket

import pytest

from miles_lp.errors import ConfigError
from miles_lp.launch.ray_launcher import _bundles, _check_reachable, _init_ray
from miles_lp.launch.recipe import load_recipe_text

BASE = "model: {path: 'tiny:qwen3'}\nprecision: {default: mxfp8}\nsteps: 1\n"


def test_unreachable_address_is_named_fast():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # a port nobody listens on
    r = load_recipe_text(BASE + f"ray: {{enabled: true, address: '127.0.0.1:{port}'}}\n")
    with pytest.raises(ConfigError, match=f"ray.address '127.0.0.1:{port}': nothing answers"):
        _init_ray(r)
    with pytest.raises(ConfigError, match="expected host:port"):
        _check_reachable("nowhere")


def test_placement_bundles():
    co = load_recipe_text(BASE + "ray: {enabled: true, placement: colocate, learner: {num_cpus: 1, num_gpus: 1}, "
                                 "rollout: {num_cpus: 2, num_gpus: 1}}\n")
    assert _bundles(co) == [{"CPU": 3.0, "GPU": 1.0}]  # one GPU shared by both roles
    sp = load_recipe_text(BASE + "ray: {enabled: true, placement: split, rollout: {num_cpus: 2}}\n")
    assert _bundles(sp) == [{"CPU": 1.0}, {"CPU": 2.0}]
    with pytest.raises(ConfigError, match="num_cpus sizes a local cluster"):
        load_recipe_text(BASE + "ray: {enabled: true, address: auto, num_cpus: 2}\n")


def test_wire_roundtrip_is_bit_exact():
    import torch

    from miles_lp.formats import quantize_mxfp8
    from miles_lp.launch.wire import pack, unpack
    from miles_lp.rollout.engine import Generation

    x = torch.randn(4, 64).bfloat16()
    q = quantize_mxfp8(x)
    g = Generation([1, 2], torch.tensor([-0.5, float("nan")]), "stop", 3)
    back = unpack(pack({"q": q, "g": [g], "t": (torch.tensor(5), torch.empty(0, 3))}))
    assert torch.equal(back["q"].data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(back["q"].scale, q.scale) and type(back["q"]) is type(q)
    assert back["g"][0].output_ids == [1, 2] and torch.equal(back["g"][0].logprobs.isnan(), g.logprobs.isnan())
    assert back["t"][0].item() == 5 and back["t"][1].shape == (0, 3)
