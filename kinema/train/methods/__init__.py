"""The RL methods of `kinema train`, registered by name (`--rl.method`). Adding one is a new module with an `RLMethod`
subclass (and its options dataclass, if it has options) plus one line here."""

from kinema.train.methods.awr import AWR
from kinema.train.methods.base import Learner, RLMethod, Rollouts
from kinema.train.methods.dsrl import DSRL
from kinema.train.methods.flow_ppo import FlowPPO
from kinema.train.methods.habc import HABC
from kinema.train.methods.hg_dagger import HGDAgger
from kinema.train.methods.nft import NFT
from kinema.train.methods.none import SFTOnly
from kinema.train.methods.pa_rl import PARL
from kinema.train.methods.recap import Recap
from kinema.train.methods.residual import Residual
from kinema.train.methods.sft_continued import ContinuedSFT

METHODS: dict[str, type[RLMethod]] = {
    cls.name: cls for cls in (HABC, ContinuedSFT, AWR, FlowPPO, NFT, PARL, DSRL, Residual, HGDAgger, Recap, SFTOnly)
}

__all__ = ["METHODS", "Learner", "RLMethod", "Rollouts"]
