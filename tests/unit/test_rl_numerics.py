"""RL numerics against values computed by hand (in the comments), not by the code under test."""

from __future__ import annotations

import math

import pytest
import torch

from miles_lp.config import Where, parse_dataclass
from miles_lp.errors import ConfigError
from miles_lp.rl.advantages import group_advantages, keep_groups, overlong_penalty
from miles_lp.rl.config import RLConfig, RolloutCorrection
from miles_lp.rl.corrections import (
    is_metrics,
    is_weights,
    offpolicy_metrics,
    rejection_mask,
    rollout_correction,
)
from miles_lp.rl.loss import agg_loss, clipped_policy_loss, kl_penalty

L = math.log


def close(a, b, tol=1e-5):
    return abs(float(a) - b) <= tol


def test_grpo_advantages_std_and_dr_grpo():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # group [1, 0]: mean .5, unbiased std sqrt(.5) = .70711 -> +-.70711
    a = group_advantages(r, 2)
    assert torch.allclose(a, torch.tensor([0.70711, -0.70711, -0.70711, 0.70711]), atol=1e-4)
    # Dr. GRPO: no std division
    assert torch.equal(group_advantages(r, 2, norm_by_std=False), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    # group [0, 0, 3]: mean 1, std sqrt(6/2) = 1.7321
    a3 = group_advantages(torch.tensor([0.0, 0.0, 3.0]), 3)
    assert torch.allclose(a3, torch.tensor([-0.57735, -0.57735, 1.15470]), atol=1e-4)
    # an all-equal group has zero advantage (std 0 + eps): no NaN
    assert torch.equal(group_advantages(torch.tensor([2.0, 2.0]), 2), torch.zeros(2))


def test_dynamic_sampling_and_overlong():
    assert keep_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2).tolist() == [False, True, False]
    # max 10, buffer 4: free up to 6 tokens, then -1/4 per token down to -1 at 10
    p = overlong_penalty(torch.tensor([5, 6, 7, 10]), 10, 4, 1.0)
    assert p.tolist() == [0.0, 0.0, -0.25, -1.0]
    assert overlong_penalty(torch.tensor([8]), 10, 4, 2.0).tolist() == [-1.0]


def test_loss_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert close(agg_loss(loss, mask, "token-mean"), 2.5)  # 10 / 4
    assert close(agg_loss(loss, mask, "seq-mean-token-mean"), 3.0)  # (6/3 + 4/1) / 2
    assert close(agg_loss(loss, mask, "seq-mean-token-sum"), 5.0)  # (6 + 4) / 2
    assert close(agg_loss(loss, mask, "token-mean", total_tokens=8), 1.25)
    assert close(agg_loss(loss, mask, "seq-mean-token-sum", total_seqs=4), 2.5)
    # micro-batch split: the sum of parts with global totals equals the whole
    whole = agg_loss(loss, mask, "seq-mean-token-mean")
    parts = sum(agg_loss(loss[i:i + 1], mask[i:i + 1], "seq-mean-token-mean", total_seqs=2) for i in range(2))
    assert close(parts, float(whole))


def test_clipped_loss_clip_higher_and_dual_clip():
    old = torch.zeros(1, 3)
    lp = torch.tensor([[L(1.5), L(0.5), L(0.5)]])
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    out = clipped_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # token 1: max(-1.5, -1.28) = -1.28 (clipped); token 2: max(-.5, -.8) = -.5; token 3: max(.5, .8) = .8 (clipped)
    assert close(out.loss, (-1.28 - 0.5 + 0.8) / 3)
    assert close(out.clipfrac, 2 / 3)
    # ppo_kl = mean(old - new) = -(ln 1.5 + 2 ln .5)/3
    assert close(out.ppo_kl, -(L(1.5) + 2 * L(0.5)) / 3)
    # dual clip: ratio 4, A = -1: max(4, 1.28) = 4, min(4, 3) = 3
    d = clipped_policy_loss(torch.tensor([[L(4.0)]]), torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1),
                            clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    assert close(d.loss, 3.0) and close(d.clipfrac_lower, 1.0)
    # IS weights multiply the per-token loss
    w = clipped_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28,
                            is_weights=torch.tensor([[2.0, 0.0, 1.0]]))
    assert close(w.loss, (2 * -1.28 + 0.8) / 3)


def test_clipped_loss_gradient_is_zero_when_clipped():
    lp = torch.tensor([[L(1.5)]], requires_grad=True)
    clipped_policy_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_low=0.2,
                        clip_high=0.2).loss.backward()
    assert lp.grad.item() == 0.0
    lp2 = torch.tensor([[L(1.1)]], requires_grad=True)
    clipped_policy_loss(lp2, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_low=0.2,
                        clip_high=0.2).loss.backward()
    assert close(lp2.grad.item(), -1.1)  # d(-r)/dlp = -r


def test_kl_estimators():
    lp, ref = torch.tensor([L(0.5)]), torch.tensor([L(0.25)])
    assert close(kl_penalty(lp, ref, "k1"), 0.693147)
    assert close(kl_penalty(lp, ref, "k2"), 0.240227)
    assert close(kl_penalty(lp, ref, "k3"), 0.193147)  # 0.5 + ln 2 - 1
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(lp, ref, "k4")


LR = torch.tensor([[L(3.0), L(0.25), L(1.5)]])
M = torch.ones(1, 3)


def test_is_weights_tis_icepop_sequence():
    applied, raw = is_weights(LR, M, "token", 2.0, None)
    assert torch.allclose(raw, torch.tensor([[3.0, 0.25, 1.5]]))
    assert torch.allclose(applied, torch.tensor([[2.0, 0.25, 1.5]]))  # TIS truncates at 2
    ice, _ = is_weights(LR, M, "token", 2.0, 0.5)
    assert torch.allclose(ice, torch.tensor([[0.0, 0.0, 1.5]]))  # IcePop zeroes outside [.5, 2]
    seq, _ = is_weights(LR, M, "sequence", 2.0, None)
    assert torch.allclose(seq, torch.full((1, 3), 1.125))  # 3 * .25 * 1.5


def test_is_metrics_token():
    applied, raw = is_weights(LR, M, "token", 2.0, None)
    m = is_metrics(applied, raw, LR, M, "token", 2.0, None)
    assert close(m["rollout_is_mean"], 1.25)  # (2 + .25 + 1.5) / 3
    assert close(m["rollout_is_max"], 2.0) and close(m["rollout_is_min"], 0.25)
    assert close(m["rollout_is_ratio_fraction_high"], 1 / 3) and close(m["rollout_is_ratio_fraction_low"], 1 / 3)
    assert close(m["rollout_is_std"], 0.735980)  # sqrt(6.3125/3 - 1.5625)
    assert close(m["rollout_is_eff_sample_size"], 0.742574)  # 1.5625 / 2.104167


def test_rejection_options():
    # k1 = -log r = [-1.0986, 1.3863, -0.4055]; kept inside [ln .5, ln 2] = [-.693, .693]: only the third
    keep, m = rejection_mask(LR, M, {"token_k1": (0.5, 2.0)})
    assert keep.tolist() == [[0.0, 0.0, 1.0]]
    assert close(m["rollout_rs_masked_fraction"], 2 / 3) and close(m["rollout_rs_seq_masked_fraction"], 1.0)
    # k3 = r - 1 - log r = [.9014, .6363, .0945], mean .5407
    assert rejection_mask(LR, M, {"seq_mean_k3": (None, 0.5)})[0].tolist() == [[0.0, 0.0, 0.0]]
    assert rejection_mask(LR, M, {"seq_mean_k3": (None, 0.6)})[0].tolist() == [[1.0, 1.0, 1.0]]
    # seq_sum_k1 = -ln 1.125 = -.1178, inside [ln .5, ln 2]
    assert rejection_mask(LR, M, {"seq_sum_k1": (0.5, 2.0)})[0].tolist() == [[1.0, 1.0, 1.0]]
    # seq_max_k3 = .9014; combined options must all pass
    both, mm = rejection_mask(LR, M, {"seq_sum_k1": (0.5, 2.0), "seq_max_k3": (None, 0.9)})
    assert both.tolist() == [[0.0, 0.0, 0.0]] and close(mm["rollout_rs_seq_max_k3_masked_fraction"], 1.0)
    # padding is never counted
    lr2 = torch.tensor([[L(3.0), 0.0], [0.0, 0.0]])
    k, m2 = rejection_mask(lr2, torch.tensor([[1.0, 0.0], [1.0, 1.0]]), {"token_k2": (None, 0.5)})
    assert k.tolist() == [[0.0, 0.0], [1.0, 1.0]]  # k2 = .5 ln(3)^2 = .6035 > .5
    assert close(m2["rollout_rs_masked_fraction"], 1 / 3)


def test_offpolicy_metrics_by_hand():
    lp_train = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    lp_roll = torch.tensor([[-1.5, -1.0], [-0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    m = offpolicy_metrics(lp_train, lp_roll, mask)
    assert close(m["kl"], 0.166667)  # mean(roll - train) = (-.5 + 1 + 0) / 3
    assert close(m["k3_kl"], 0.172200)  # (e^.5 - 1.5 + e^-1 + 0) / 3
    assert close(m["training_ppl"], 3.065205)  # (e^1.5 + e^.5) / 2
    assert close(m["rollout_ppl"], 2.569532)  # (e^1.25 + e^.5) / 2
    assert close(m["log_ppl_diff"], 0.125) and close(m["ppl_ratio"], 1.142013)
    assert close(m["chi2_token"], 0.284539)  # (e + e^-2 + 1) / 3 - 1
    assert close(m["chi2_seq"], -0.316060)  # (e^-1 + 1) / 2 - 1
    assert close(m["logprob_abs_diff_mean"], 0.5) and close(m["logprob_abs_diff_max"], 1.0)
    # identical policies: every divergence is exactly zero
    z = offpolicy_metrics(lp_train, lp_train, mask)
    assert z["kl"] == 0.0 and z["k3_kl"] == 0.0 and z["chi2_token"] == 0.0 and z["logprob_abs_diff_max"] == 0.0


def test_rollout_correction_prefixes_and_application():
    w, mask, m = rollout_correction(LR, torch.zeros(1, 3), M, rollout_is=None, is_upper=2.0, is_lower=None,
                                    rs_bounds=None)
    assert w is None and torch.equal(mask, M)  # monitor only
    assert all(k.startswith("rollout_corr/") for k in m) and "rollout_corr/rollout_is_mean" in m
    w, mask, m = rollout_correction(LR, torch.zeros(1, 3), M, rollout_is="token", is_upper=2.0, is_lower=None,
                                    rs_bounds={"token_k1": (0.5, 2.0)})
    assert torch.allclose(w, torch.tensor([[2.0, 0.25, 1.5]])) and mask.tolist() == [[0.0, 0.0, 1.0]]
    assert close(m["rollout_corr/rollout_rs_masked_fraction"], 2 / 3)


def parse(raw):
    return parse_dataclass(RLConfig, raw, Where("r.yaml", "rl", {"rl": 3, "rl.rollout_correction.rollout_rs": 9}))


def test_rl_config_strict():
    c = parse({"clip_high": 0.28, "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0",
                                                         "rollout_rs": "token_k1,seq_mean_k3",
                                                         "rollout_rs_threshold": "0.5_2.0,0.01"}})
    assert c.rollout_correction.is_bounds == (2.0, 0.5)
    assert c.rollout_correction.rs_bounds == {"token_k1": (0.5, 2.0), "seq_mean_k3": (None, 0.01)}
    with pytest.raises(ConfigError, match="r.yaml:9: 'rl.rollout_correction.rollout_rs': unknown rollout_rs "
                                          "option 'seq_mean_k4' \\(did you mean 'seq_mean_k3'"):
        parse({"rollout_correction": {"rollout_rs": "seq_mean_k4", "rollout_rs_threshold": 1.0}})
    with pytest.raises(ConfigError, match="needs rollout_rs_threshold"):
        parse({"rollout_correction": {"rollout_rs": "seq_sum_k1"}})
    with pytest.raises(ConfigError, match="single upper bound"):
        parse({"rollout_correction": {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": "0.1_0.2"}})
    with pytest.raises(ConfigError, match="unknown key 'clip_hihg'.*did you mean 'clip_high'"):
        parse({"clip_hihg": 0.3})
    with pytest.raises(ConfigError, match="lower_upper"):
        parse({"rollout_correction": {"rollout_is_threshold": "abc"}})
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        parse({"group_size": 1})
    with pytest.raises(ConfigError, match="split evenly into 3"):
        parse({"prompts_per_step": 2, "group_size": 4, "mini_batches": 3})
    with pytest.raises(ConfigError, match="bypass_mode uses the PPO ratio"):
        parse({"rollout_correction": {"bypass_mode": True, "rollout_is": "token"}})
    with pytest.raises(ConfigError, match="rollout_rs with bypass_mode is not supported"):
        parse({"rollout_correction": {"bypass_mode": True, "rollout_rs": "token_k1", "rollout_rs_threshold": 2.0}})
    with pytest.raises(ConfigError, match="must be one of 'token-mean'"):
        parse({"loss_agg": "token_mean"})
    assert isinstance(parse(None).rollout_correction, RolloutCorrection)
