"""π0: LeRobot's pi0 checkpoints loaded, acted with, post-trained and saved back in LeRobot's layout."""

from policies.pi0.configuration_pi0 import Pi0Config
from policies.pi0.modeling_pi0 import Pi0Policy

__all__ = ["Pi0Config", "Pi0Policy"]
