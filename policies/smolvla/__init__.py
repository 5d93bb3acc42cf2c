"""SmolVLA: LeRobot's SmolVLA checkpoints loaded, acted with, post-trained and saved back in LeRobot's layout."""

from policies.smolvla.configuration_smolvla import SmolVLAConfig
from policies.smolvla.modeling_smolvla import SmolVLAPolicy

__all__ = ["SmolVLAConfig", "SmolVLAPolicy"]
