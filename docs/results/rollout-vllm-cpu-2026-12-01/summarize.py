import json, sys, statistics as st
root = sys.argv[1] if len(sys.argv) > 1 else __file__.rsplit("/", 1)[0]
keys = ["rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/logprob_abs_diff_mean", "rollout_corr/logprob_abs_diff_max"]
times = ["timing_s/generate", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/sync", "timing_s/checks", "timing_s/step"]
for r in ["tiny-mxfp8-vllm", "tiny-mxfp8", "tiny-bf16-vllm"]:
    try:
        rows = [json.loads(l) for l in open(f"{root}/{r}/metrics.jsonl")]
    except FileNotFoundError:
        continue
    out = {"steps": len(rows)}
    out["kl_step0"] = rows[0]["rollout_corr/kl"]
    out["mean_abs_kl"] = st.mean(abs(m["rollout_corr/kl"]) for m in rows)
    out["mean_kl"] = st.mean(m["rollout_corr/kl"] for m in rows)
    out["kl_se"] = st.stdev(m["rollout_corr/kl"] for m in rows) / len(rows) ** 0.5
    out["mean_k3"] = st.mean(m["rollout_corr/k3_kl"] for m in rows)
    out["mean_gap"] = st.mean(m["rollout_corr/logprob_abs_diff_mean"] for m in rows)
    out["max_gap"] = max(m["rollout_corr/logprob_abs_diff_max"] for m in rows)
    out["reward_first5"] = st.mean(m["reward/mean"] for m in rows[:5])
    out["reward_last5"] = st.mean(m["reward/mean"] for m in rows[-5:])
    for t in times:
        out[t] = st.mean(m[t] for m in rows[1:])  # step 0 excluded (warm-up)
    out["sync_seconds"] = st.mean(m["perf/sync_seconds"] for m in rows[1:])
    chk = {k: min(m[k] for m in rows) for k in rows[0] if k.startswith("sync/check/") and "/figure" not in k}
    out["checks_min"] = chk
    out["self_check_fig"] = max(m.get("sync/check/self_check/figure", float("nan")) for m in rows)
    print(r, json.dumps(out, indent=None))
