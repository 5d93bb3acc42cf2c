"""Checks of incoming robot data, one implementation each, shared by the policy node, the recorder and teleop:
- `joint_positions`: the positions of the wanted joints from a `JointState`, matched by name (never by index);
- `decode_image`: an `Image` or `CompressedImage` as (H, W, 3) uint8 RGB, with its size checked.

Each raises `InputRejected(reason, detail)`: `reason` is a short key callers count by, `detail` says it in words.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from robot import messages as msg

# A compressed frame larger than this is refused before decoding (a 640x480 PNG of noise is ~0.9 MB).
MAX_COMPRESSED_BYTES = 8 * 1024 * 1024
# More joints than any robot has: a joint state naming more is refused before it is indexed.
MAX_JOINT_NAMES = 1024


class InputRejected(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def joint_positions(
    names: Sequence[str], positions: Sequence[float] | np.ndarray, wanted: Sequence[str], *, allow_extra: bool = True
) -> np.ndarray:
    """The positions of `wanted` (in that order, float64) from a joint state's `names`/`positions`.

    Reasons: `too_many_joints` (over MAX_JOINT_NAMES), `length` (names and positions differ in length),
    `duplicate_names`, `missing_joints` (a wanted joint is absent, or, with allow_extra=False, an unknown one is
    present), `nonfinite`.
    """
    if len(names) > MAX_JOINT_NAMES:
        raise InputRejected("too_many_joints", f"{len(names)} joint names (at most {MAX_JOINT_NAMES})")
    names = list(names)
    if len(names) != len(positions):
        raise InputRejected("length", f"{len(names)} names but {len(positions)} positions")
    index = {n: i for i, n in enumerate(names)}
    if len(index) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise InputRejected("duplicate_names", f"duplicate joint names {dup} in {names[:20]}")
    missing = [n for n in wanted if n not in index]
    wanted_set = set(wanted)
    unknown = [n for n in names if n not in wanted_set]
    if missing or (unknown and not allow_extra):
        raise InputRejected("missing_joints", f"unknown joint names {unknown[:20]}, missing {missing}; expected "
                                              f"{list(wanted)}, got {names[:20]}")
    q = np.array([positions[index[n]] for n in wanted], np.float64)
    if not np.isfinite(q).all():
        bad = [wanted[i] for i in np.flatnonzero(~np.isfinite(q))]
        raise InputRejected("nonfinite", f"non-finite joint positions {q.tolist()} (joints {bad})")
    return q


def decode_image(
    m: msg.Image | msg.CompressedImage, expected_hw: tuple[int, int] | None,
    *, max_compressed_bytes: int = MAX_COMPRESSED_BYTES,
) -> np.ndarray:
    """The frame as (H, W, 3) uint8 RGB; `expected_hw` (None: any) is checked before a raw payload is copied.

    Reasons: `size` (not `expected_hw`), `malformed` (a raw payload that does not match its header, an unsupported
    encoding), `oversized` (a compressed payload over `max_compressed_bytes`), `undecodable`.
    """
    if isinstance(m, msg.Image):
        if expected_hw is not None and (m.height, m.width) != tuple(expected_hw):
            raise InputRejected("size", f"image size {m.height}x{m.width}, expected {expected_hw[0]}x{expected_hw[1]}")
        try:
            return m.to_array()
        except ValueError as err:
            raise InputRejected("malformed", str(err)) from None
    if len(m.data) > max_compressed_bytes:
        raise InputRejected("oversized", f"compressed image of {len(m.data)} bytes (at most {max_compressed_bytes})")
    import cv2  # here: the recorder and the policy node load OpenCV only for compressed cameras

    bgr = cv2.imdecode(np.frombuffer(m.data, np.uint8), cv2.IMREAD_COLOR) if m.data else None
    if bgr is None:
        raise InputRejected("undecodable", f"undecodable {m.format or 'compressed'} image of {len(m.data)} bytes")
    if expected_hw is not None and bgr.shape[:2] != tuple(expected_hw):
        raise InputRejected("size", f"image size {bgr.shape[0]}x{bgr.shape[1]}, expected "
                                    f"{expected_hw[0]}x{expected_hw[1]}")
    return np.ascontiguousarray(bgr[..., ::-1])


__all__ = ["MAX_COMPRESSED_BYTES", "MAX_JOINT_NAMES", "InputRejected", "decode_image", "joint_positions"]
