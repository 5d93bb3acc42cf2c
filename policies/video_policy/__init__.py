"""kinema's video-diffusion policy (Cosmos Policy's recipe on the generator stack in `policies.video`)."""

from policies.video_policy.configuration_video_policy import VideoPolicyConfig
from policies.video_policy.modeling_video_policy import VideoPolicy

__all__ = ["VideoPolicy", "VideoPolicyConfig"]
