"""Fixtures shared by every test folder."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny GEMMs on a shared 2-core CPU: one intra-op thread is 10-30x faster than two spinning ones. A module
    opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")`` (or adds it to its pytestmark list)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The fast tier (`pytest -m fast`): the day-to-day subset, under 5 minutes on 2 CPU cores. The default run (CI's)
# is unchanged; `fast` only selects. A file listed here is in the tier but for the named tests (each several
# seconds: exhaustive sweeps, whole-model plans, subprocesses), and never a `slow` or `gpu` test.
FAST_TIER: dict[str, set[str]] = {
    "tests/unit/test_layering.py": set(),
    "tests/unit/test_docs_paths.py": set(),
    "tests/unit/test_formats_bits.py": {"test_e8m0_exhaustive_over_every_positive_finite_bf16_amax",
                                        "test_e4m3_satfinite_equals_exact_rne_on_every_bf16_and_every_midpoint"},
    "tests/unit/test_formats_golden.py": {"test_exact_reference_equals_the_oracle_and_the_codec_on_random_blocks"},
    "tests/unit/test_formats_mxfp8.py": {"test_decode_error_is_within_the_e4m3_bound",
                                         "test_bytes_equal_torchao_rceil_on_finite_input"},
    "tests/unit/test_formats_nvfp4.py": {"test_scaled_error_is_at_most_half_an_e2m1_step_plus_saturation",
                                         "test_agreement_with_torchao_nvfp4_is_where_contract_2_says",
                                         "test_one_block_decode_error_is_bounded_by_its_amax"},
    "tests/unit/test_formats_fp8.py": set(),
    "tests/unit/test_formats_swizzle.py": set(),
    "tests/unit/test_formats_cores.py": set(),
    "tests/unit/test_format_schemes.py": set(),
    "tests/unit/test_policy.py": {"test_issue_recipe_on_deepseek", "test_percent_and_mtp_layers"},
    "tests/unit/test_layouts.py": set(),
    "tests/unit/test_emit.py": set(),
    "tests/unit/test_policy_recipes.py": set(),
    "tests/unit/test_policy_comparison_formats.py": set(),
    "tests/unit/test_sync_checks.py": set(),
    "tests/unit/test_sync_config.py": set(),
    "tests/unit/test_sync_buckets.py": set(),
    "tests/unit/test_sync_strided.py": set(),
    "tests/unit/test_sync_digest_groups.py": set(),
    "tests/unit/test_checkpoint_io.py": set(),
    "tests/unit/test_checkpoint_schemes.py": set(),
    "tests/unit/test_export_groups.py": set(),
    "tests/unit/test_export_fp8_block.py": set(),
    "tests/unit/test_launch_recipe.py": set(),
    "tests/unit/test_launch_rundir.py": set(),
    "tests/unit/test_train_config.py": set(),
    "tests/unit/test_train_quant_linear.py": set(),
    "tests/unit/test_rl_numerics.py": set(),
    "tests/unit/test_rl_step.py": set(),
    "tests/unit/test_rl_tasks.py": set(),
    "tests/unit/test_report_cost.py": {"test_cli_cost"},
    "tests/unit/test_report_summary_rate.py": set(),
    "tests/unit/test_cli_device_args.py": set(),
    "tests/unit/test_rollout_config.py": set(),
    "tests/unit/test_config_environment.py": set(),
    "tests/unit/test_rollout_self_check_probe.py": set(),
    "tests/unit/test_rollout_reference_jobs.py": set(),
    "tests/e2e/test_convert.py": {"test_converters_entry_point"},
    "tests/e2e/test_verify.py": set(),
    "tests/e2e/test_cli_bad_flags.py": {"test_explain_save_plan_needs_a_folder_that_exists"},
}


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        left_out = FAST_TIER.get(item.path.relative_to(root).as_posix())
        if left_out is None or item.get_closest_marker("slow") or item.get_closest_marker("gpu"):
            continue
        if item.originalname not in left_out:
            item.add_marker(pytest.mark.fast)
