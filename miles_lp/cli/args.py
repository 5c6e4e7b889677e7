"""The argument types of the subcommands: ``miles_lp.devices`` (below every package that builds a parser)."""

from miles_lp.devices import device, torch_device

__all__ = ["device", "torch_device"]
