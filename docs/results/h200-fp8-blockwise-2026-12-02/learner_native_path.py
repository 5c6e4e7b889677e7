import tempfile

import torch

from miles_lp.bench.rollout import _model
from miles_lp.config import Where
from miles_lp.policy import parse_policy
from miles_lp.train import fp8_block_gemm, gemm
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model
from miles_lp.train.quant_linear import QuantLinear

src = _model("0.5b", "cuda", tempfile.mkdtemp(), num_layers=2)
raw = {"default": "fp8_block", "backward": "quantized"}
plan = plan_for_model(parse_policy(raw, Where("<b>", "precision"), comparison_formats=True), src)
tr = EmbeddedTrainer(src, plan, TrainConfig(device="cuda", lr=1e-5, master_dtype="fp32", param_dtype="bf16"))
seen = {}
orig = QuantLinear.forward
def fwd(self, x):
    k = x.shape[-1]
    seen.setdefault(self.canonical, (x.dtype, tuple(x.shape), self.weight.dtype, tuple(self.weight.shape), self.grid.kernel,
        fp8_block_gemm.unavailable_reason(x.reshape(-1, k), self.weight), torch.is_autocast_enabled(), gemm._fp8_native(x.reshape(-1, k), self.weight, self.grid)))
    return orig(self, x)
QuantLinear.forward = fwd
g = torch.Generator().manual_seed(0)
st = tr.train_step([{"tokens": torch.randint(0, 151936, (512,), generator=g)} for _ in range(4)])
for k, v in list(seen.items())[:8]:
    print(k, v)
print(st)
