"""A CPU Megatron learner (``train.device: cpu``) on a host that has CUDA: megatron-core 0.16.1 moves RoPE's
``inv_freq`` (and the MoE router's weight, and tensor-parallel buffers) to ``torch.cuda.current_device()``
whenever they are on the CPU, which put the rope tables on ``cuda:0`` next to CPU activations on an H200
(``Expected all tensors to be on the same device, cuda:0 and cpu``). Simulated here on CPU: ``is_available`` says
True, ``current_device`` answers the ``meta`` device and ``synchronize`` raises, so any Megatron tensor that follows
``current_device`` ends on ``meta`` and the forward fails; the learner must answer those names for the CPU in its
own thread (other threads keep the real ones: rank 0 shares the driver process with CUDA engines) and give the
same log-probs, bit for bit, as on a CPU-only host.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

mc = pytest.importorskip("megatron.core", reason="megatron-core not installed (extra 'megatron')")

from miles_lp.train.config import TrainConfig  # noqa: E402

CFG = TrainConfig(backend="megatron", lr=1e-3, device="cpu", micro_batch_tokens=64, seed=3)


@pytest.fixture(scope="module", autouse=True)
def world():
    import torch.distributed as dist
    from megatron.core import parallel_state

    warnings.filterwarnings("ignore")
    existed = dist.is_initialized()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    parallel_state.destroy_model_parallel()
    if not existed and dist.is_initialized():
        dist.destroy_process_group()


def _no_sync(*a, **k):
    raise AssertionError("torch.cuda.synchronize called for a CPU learner")


def cuda_host(monkeypatch):
    """Make this CPU-only torch look like a host with a GPU: what Megatron reads to pick its device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("meta"))
    monkeypatch.setattr(torch.cuda, "synchronize", _no_sync)


def _seqs():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g) for n in (17, 30, 9)]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3"])  # RoPE; + the MoE router; MLA's RoPE
def test_cpu_learner_on_a_cuda_host_equals_a_cpu_host(arch, tmp_path, monkeypatch):
    from miles_lp.checkpoint.tiny import make_tiny_model
    from miles_lp.train.megatron.learner import MegatronLearner

    d = make_tiny_model(arch, tmp_path / arch, num_layers=2)
    seqs = _seqs()
    want_lp, want_ent = MegatronLearner(d, None, CFG).logprobs(seqs)
    current = torch.cuda.current_device
    cuda_host(monkeypatch)
    m = MegatronLearner(d, None, CFG)
    got_lp, got_ent = m.logprobs(seqs)
    assert torch.cuda.current_device is not current  # the simulated host's own function, put back after
    assert torch.cuda.current_device() == torch.device("meta")
    for want, got in ((want_lp, got_lp), (want_ent, got_ent)):
        assert all(g.device.type == "cpu" and torch.equal(w, g) for w, g in zip(want, got, strict=True))
    rot = [mod for mod in m.model.modules() if hasattr(mod, "inv_freq")]
    assert rot and all(mod.inv_freq.device.type == "cpu" for mod in rot)


# Two callers defined in other modules' namespaces: the redirect answers megatron-core's calls only.
_MEGATRON: dict = {"__name__": "megatron.core.probe", "torch": torch}
_TORCH: dict = {"__name__": "torch._dynamo.device_interface", "torch": torch}
_CALLERS = "def current_device():\n    return torch.cuda.current_device()\n\ndef synchronize():\n    torch.cuda.synchronize()\n"
exec(_CALLERS, _MEGATRON)
exec(_CALLERS, _TORCH)


def test_redirect_is_per_thread_and_restored(monkeypatch):
    from miles_lp.train.megatron.cpu_redirect import cpu_megatron, inside

    cuda_host(monkeypatch)
    fake = torch.cuda.current_device
    seen: dict[str, object] = {}
    entered, checked = threading.Event(), threading.Event()

    def other():  # e.g. a CUDA engine's thread in the driver process, running megatron-core code too
        entered.wait(10)
        seen["other"] = (_MEGATRON["current_device"](), inside())
        try:
            _MEGATRON["synchronize"]()
        except AssertionError:
            seen["other_sync"] = "real"
        checked.set()

    t = threading.Thread(target=other)
    t.start()
    with cpu_megatron(torch.device("cpu")):
        with cpu_megatron(torch.device("cpu")):  # nests
            seen["learner"] = (_MEGATRON["current_device"](), inside())
            _MEGATRON["synchronize"]()  # a no-op in the learner's thread
            entered.set()
            assert checked.wait(10)
        assert inside() and _MEGATRON["current_device"]() == "cpu"
    t.join()
    assert seen == {"learner": ("cpu", True), "other": (torch.device("meta"), False), "other_sync": "real"}
    assert torch.cuda.current_device is fake and not inside()
    with cpu_megatron(torch.device("cuda")):  # a CUDA learner: nothing redirected
        assert torch.cuda.current_device is fake


def test_redirect_answers_megatron_callers_only(monkeypatch):
    """torch's own callers in the learner's thread (dynamo compiling megatron-core's fused functions indexes the
    CUDA device properties by the current device) get the real answers; megatron-core's get the CPU."""
    from miles_lp.train.megatron.cpu_redirect import cpu_megatron

    cuda_host(monkeypatch)
    with cpu_megatron(torch.device("cpu")):
        assert _MEGATRON["current_device"]() == "cpu"
        assert _TORCH["current_device"]() == torch.device("meta")
        assert torch.cuda.current_device() == torch.device("meta")  # this test module is not megatron-core
        _MEGATRON["synchronize"]()
        with pytest.raises(AssertionError):
            _TORCH["synchronize"]()
