"""Pipeline parallelism for the Megatron learner through Megatron-Core's own schedule.

    loss = pipeline_train(learner, rounds, samples, loss_fn, totals)   # forward + backward of every micro-batch
    found = pipeline_logprobs(learner, rounds, temperature)            # {sequence index: (logprobs, entropy)}

Both call ``megatron.core.pipeline_parallel.get_forward_backward_func()`` (1F1B without interleaving at pp > 1)
with one packed row per micro-batch (``micro_batch_size`` 1). The stages exchange ``[T, 1, hidden]`` activations
of one ``seq_length`` per call (Megatron 0.16 refuses ``variable_seq_lengths`` with the all-gather token
dispatcher), so every row of the call is padded with filler to the longest (``data.pad_pack``: the filler is its
own attention segment and carries no loss; the dense layers' MXFP8 token blocks of the real tokens are unchanged,
the padding adding whole filler blocks, while routed experts also see the filler tokens, which moves their
backward's token blocks). Each
stage reads the same pack from its own iterator over this replica's rounds: the first stage embeds its tokens,
every stage takes the pack's position ids (RoPE) and block-causal mask, and the last stage's loss function turns
the logits into the per-sequence log-probs and the miles-lp loss. The schedule runs with
``calculate_per_token_loss``, so it neither divides a micro-batch's loss by the token count it is handed nor by
the number of micro-batches: the loss functions already normalise by the whole mini-batch's totals, the same
number a one-rank learner backpropagates.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from miles_lp.train.embedded import Pack, token_logprobs_and_entropy


class _CudaFactoriesOnCpu(torch.overrides.TorchFunctionMode):
    """``device="cuda"`` -> ``"cpu"`` in torch calls: megatron-core 0.16's 1F1B schedule allocates its token
    counter with ``torch.zeros(..., device="cuda")``; on a CPU-only torch (only there, only during the schedule)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and str(dev).startswith("cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _schedule(learner, rounds: Sequence[Pack], loss_func, *, forward_only: bool) -> list[Any]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from miles_lp.train.megatron.data import pad_pack

    longest = max(p.tokens for p in rounds)
    rows = [pad_pack(p, longest) for p in rounds]

    def step(data_iterator, model):
        pack = next(data_iterator)
        return learner._forward(pack), functools.partial(loss_func, pack)

    cpu_only = learner.device.type == "cpu" and not torch.cuda.is_available()
    with _CudaFactoriesOnCpu() if cpu_only else contextlib.nullcontext():
        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter(rows), model=learner.model, num_microbatches=len(rows),
            seq_length=longest, micro_batch_size=1, forward_only=forward_only)


def pipeline_train(learner, rounds: Sequence[Pack], samples: Sequence[Mapping[str, Any]], loss_fn,
                   totals: Mapping[str, int]) -> float:
    """Forward and backward of every round through the schedule; the summed loss on the last stage (0 elsewhere)."""
    if not rounds:
        return 0.0
    one = torch.ones((), dtype=torch.int, device=learner.device)

    def loss_func(pack: Pack, logits: torch.Tensor):
        loss = learner.pack_loss(logits, pack, samples, loss_fn, totals)
        return loss, one, {"loss": loss.detach()}

    store = _schedule(learner, rounds, loss_func, forward_only=False)
    return float(sum(float(d["loss"]) for d in store))


def pipeline_logprobs(learner, rounds: Sequence[Pack], temperature: float) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence index: (logprobs, entropy) on CPU, on the last stage (``{}`` elsewhere)."""
    if not rounds:
        return {}
    one = torch.ones((), dtype=torch.int, device=learner.device)

    def loss_func(pack: Pack, logits: torch.Tensor):
        found = {}
        if pack.lengths:
            lp, ent = token_logprobs_and_entropy(logits, pack, temperature)
            found = {i: (a.cpu(), b.cpu()) for i, a, b in zip(pack.indices, lp, ent, strict=True)}
        return logits.sum() * 0.0, one, {"found": found}

    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for d in _schedule(learner, rounds, loss_func, forward_only=True):
        out.update(d["found"])
    return out
