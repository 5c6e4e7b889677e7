"""``--device`` is validated at parse time by every command that takes it: a usage error naming the
flag, exit code 2, before any work, not a torch traceback seconds later."""

import pytest

from miles_lp.cli import main


@pytest.mark.parametrize("argv", [
    ["selftest", "sync", "--device", "gpu"],
    ["bench", "sync", "--device", "gpu"],
    ["bench", "rollout", "--device", "cuda0"],
    ["bench", "quantize", "--device", "auto"],
    ["bench", "linear", "--device", "tpu"],
])
def test_a_bad_device_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device: must be" in err and repr(argv[-1]).strip("'") in err


def test_device_values_accepted():
    from miles_lp.cli import args

    assert [args.device(v) for v in ("auto", "cpu", "cuda", "cuda:1")] == ["auto", "cpu", "cuda", "cuda:1"]
    assert args.torch_device("cuda:0") == "cuda:0"
