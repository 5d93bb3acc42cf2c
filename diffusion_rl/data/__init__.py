"""The Episode contract and its on-disk format (LeRobotDataset v3). numpy, pyarrow and av only: no torch."""

from diffusion_rl.data.episode import (
    FORMAT_VERSION,
    IMAGE_PREFIX,
    PRIVILEGED_PREFIX,
    SEGMENT_NAMES,
    STATE_KEY,
    Episode,
    ExecutedBy,
    Segment,
    mark_failure_inducing,
)
from diffusion_rl.data.lerobot_v3 import (
    CODEBASE_VERSION,
    DatasetMeta,
    IncompleteDatasetError,
    LeRobotDatasetReader,
    LeRobotDatasetWriter,
    VideoEncoding,
    load_info,
    load_stats,
    read_episodes,
    write_episodes,
)

__all__ = [
    "CODEBASE_VERSION",
    "FORMAT_VERSION",
    "IMAGE_PREFIX",
    "PRIVILEGED_PREFIX",
    "SEGMENT_NAMES",
    "STATE_KEY",
    "DatasetMeta",
    "Episode",
    "ExecutedBy",
    "IncompleteDatasetError",
    "LeRobotDatasetReader",
    "LeRobotDatasetWriter",
    "Segment",
    "VideoEncoding",
    "load_info",
    "mark_failure_inducing",
    "load_stats",
    "read_episodes",
    "write_episodes",
]
