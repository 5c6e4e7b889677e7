"""The recipe's sync: section and its environment overrides."""

import pytest

from miles_lp.config import load_yaml_text
from miles_lp.errors import ConfigError
from miles_lp.sync.config import CHECKS, SyncConfig, parse_sync_config


def _parse(text):
    doc = load_yaml_text(text, "recipe.yaml")
    return parse_sync_config(doc.data.get("sync"), doc.where("sync"))


def test_defaults_match_the_issue():
    c = parse_sync_config(None)
    assert c.bucket_mb == 512 and c.bucket_bytes == 512 << 20
    assert c.transport == "inprocess" and c.self_check_tolerance == 0.25
    assert c.sentinel.kl_threshold == 1.0 and c.sentinel.consecutive_steps == 2
    assert all(c.mode(n) == "warn" for n in CHECKS)


def test_yaml_section_parses_nested_checks():
    c = _parse("sync:\n  bucket_mb: 64\n  transport: ray\n  checks:\n    self_check: raise\n    grid: off\n"
               "  sentinel:\n    kl_threshold: 0.5\n")
    assert c.bucket_mb == 64.0 and c.transport == "ray"
    assert c.mode("self_check") == "raise" and c.mode("grid") == "off" and c.mode("storage") == "warn"
    assert c.sentinel.kl_threshold == 0.5


def test_unknown_check_and_bad_mode_name_the_line():
    with pytest.raises(ConfigError, match=r"recipe.yaml:3: 'sync.checks.self_chek': unknown key.*self_check"):
        _parse("sync:\n  checks:\n    self_chek: raise\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml:3: 'sync.checks.grid': must be one of 'warn', 'raise'"):
        _parse("sync:\n  checks:\n    grid: stop\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml:2: 'sync.bucket_mb': must be > 0"):
        _parse("sync:\n  bucket_mb: 0\n")
    with pytest.raises(ConfigError, match="transport.*must be one of"):
        _parse("sync:\n  transport: tcp\n")


def test_env_overrides_one_check_or_all_and_per_check_wins():
    c = SyncConfig()
    assert c.with_env({"MILES_LP_SYNC_CHECK_SELF_CHECK": "raise"}).mode("self_check") == "raise"
    both = c.with_env({"MILES_LP_SYNC_CHECKS": "RAISE", "MILES_LP_SYNC_CHECK_GRID": "off"})
    assert both.mode("grid") == "off" and both.mode("layer_audit") == "raise" and both.mode("sentinel") == "raise"
    assert c.with_env({"PATH": "/bin"}) == c


def test_env_refuses_bad_values_and_unknown_checks():
    with pytest.raises(ConfigError, match="MILES_LP_SYNC_CHECK_GRID='loud': must be one of warn, raise, off"):
        SyncConfig().with_env({"MILES_LP_SYNC_CHECK_GRID": "loud"})
    with pytest.raises(ConfigError, match="MILES_LP_SYNC_CHECK_GIRD: no sync check by that name"):
        SyncConfig().with_env({"MILES_LP_SYNC_CHECK_GIRD": "raise"})
    with pytest.raises(ConfigError, match="unknown sync check 'nope'"):
        SyncConfig().with_modes(nope="raise")


def test_unquoted_full_compare_off_is_off():
    """YAML 1.1 reads ``full_compare: off`` as false; it was refused as "got False"."""
    import yaml

    from miles_lp.sync.config import parse_sync_config

    assert parse_sync_config(yaml.safe_load("full_compare: off")).full_compare == "off"
    with pytest.raises(ConfigError, match="full_compare.*got True"):
        parse_sync_config(yaml.safe_load("full_compare: true"))
