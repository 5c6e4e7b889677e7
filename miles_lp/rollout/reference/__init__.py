"""The embedded reference engine (``ReferenceEngine``, ``EngineFaults``): one module per job, see ``engine``."""

from miles_lp.rollout.reference.engine import ReferenceEngine
from miles_lp.rollout.reference.faults import EngineFaults

__all__ = ["EngineFaults", "ReferenceEngine"]
