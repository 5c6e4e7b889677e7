"""The embedded learner's model under an attention mask: with ``miles_lp_packed`` attention, a left-padded batch
(``generate`` with ``attention_mask``, as ``pretrained.evaluate.greedy_answers`` runs it) gives the logits and
greedy answers of a plain ``sdpa`` model of the same weights and of each prompt alone; the packed training row
still takes the per-sequence path with no ``[T, T]`` mask."""

from __future__ import annotations

import pytest
import torch
import transformers

from miles_lp.config import Where, parse_dataclass
from miles_lp.pretrained.evaluate import greedy_answers
from miles_lp.rollout.testing import tiny_hf
from miles_lp.train import packed_attention as pa
from miles_lp.train.config import TrainConfig
from miles_lp.train.embedded import EmbeddedTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

PAD = 0


def _models(arch: str):
    path = tiny_hf(arch, 0, 2)
    cfg = parse_dataclass(TrainConfig, {"device": "cpu", "rounded_export": "allow"}, Where("<t>", "train"))
    learner = EmbeddedTrainer(path, None, cfg)
    assert learner.model.config._attn_implementation == pa.NAME
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert plain.config._attn_implementation == "sdpa"
    return learner, plain.eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 60, (n,), generator=g).tolist() for n in (3, 9, 5, 7)]


def _left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_left_padded_logits_equal_plain_sdpa_and_each_prompt_alone(arch):
    learner, plain = _models(arch)
    learner.model.eval()
    prompts = _prompts()
    ids, mask = _left_padded(prompts)
    with torch.no_grad():
        got = learner.model(input_ids=ids, attention_mask=mask).logits
        want = plain(input_ids=ids, attention_mask=mask).logits
        for row, p in enumerate(prompts):
            alone = learner.model(input_ids=torch.tensor([p])).logits[0]
            real = got[row, ids.shape[1] - len(p):]  # the prompt's own rows (padding rows are not compared)
            torch.testing.assert_close(real, want[row, ids.shape[1] - len(p):], rtol=0, atol=1e-5)
            torch.testing.assert_close(real, alone, rtol=0, atol=1e-5)


def test_left_padded_greedy_answers_equal_one_at_a_time_and_plain_sdpa():
    learner, plain = _models("llama")
    learner.model.eval()
    prompts = _prompts()
    batched = greedy_answers(learner.model, prompts, 6, [1], PAD)
    alone = [greedy_answers(learner.model, [p], 6, [1], PAD)[0] for p in prompts]
    assert batched == alone
    assert batched == greedy_answers(plain, prompts, 6, [1], PAD)


def test_packed_row_builds_no_mask(monkeypatch):
    # the training row (one row, position_ids restarting per sequence, no attention_mask) keeps the per-sequence
    # path: the mask function returns None and the attention cuts the row into its sequences
    learner, _ = _models("llama")
    seen = []
    real = pa.packed_causal_attention

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        seen.append(attention_mask)
        return real(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(transformers.AttentionInterface, "_global_mapping",
                        {**transformers.AttentionInterface._global_mapping, pa.NAME: spy})
    learner.logprobs([torch.tensor(p) for p in _prompts()])
    assert seen and all(m is None for m in seen)
    assert pa.packed_mask(batch_size=1, q_length=8, kv_length=8, attention_mask=None) is None
    _, mask = _left_padded(_prompts())
    got = pa.packed_mask(batch_size=4, q_length=9, kv_length=9, attention_mask=mask.bool())
    assert got is not None and got.shape == (4, 1, 9, 9)
    assert not got[0, 0, :, :6].any()  # the first prompt's six padding keys are never attended to
