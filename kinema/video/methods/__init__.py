"""The post-training methods of `kinema video train`, registered by name (`--train.method`). Adding one is a new
module with a `Method` subclass (and its options dataclass, if it has options, at `train.<name>`) plus one line here.
"""

from kinema.video.methods.afd import AFD
from kinema.video.methods.awr import VideoAWR
from kinema.video.methods.base import FAKE, REF, TRAINED, Method
from kinema.video.methods.distill import RewardDistill
from kinema.video.methods.flow_grpo import FlowGRPO
from kinema.video.methods.nft import DiffusionNFT
from kinema.video.methods.opsd import OPSD

VIDEO_METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (VideoAWR, DiffusionNFT, RewardDistill, AFD, OPSD, FlowGRPO)
}

__all__ = ["FAKE", "REF", "TRAINED", "VIDEO_METHODS", "Method"]
