"""Which recorded steps the VLA imitates: HELP's exclusion of failure-inducing and idle steps."""

import numpy as np
import torch

from diffusion_rl.data import Episode, ExecutedBy, Segment, mark_failure_inducing
from kinema.train.buffer import StepBuffer


def _episode(executed_by: np.ndarray, segment: np.ndarray) -> Episode:
    T = len(executed_by)
    return Episode(
        observations={"observation.state": np.zeros((T, 8)), "observation.images.agentview": np.zeros((T, 8, 8, 3), np.uint8)},
        action=np.zeros((T, 7)),
        task="open the drawer",
        executed_by=executed_by,
        segment=segment,
        outcome=True,
    )


def test_mark_failure_inducing_labels_the_window_before_a_takeover_only():
    seg = np.array([Segment.PROGRESS] * 6 + [Segment.HUMAN] * 2, np.int8)
    seg[1] = Segment.RECOVERY
    out = mark_failure_inducing(seg, takeover=6, window=4)
    assert out.tolist() == [0, 3, 2, 2, 2, 2, 4, 4]  # recovery at 1 kept; steps 2-5 led to the takeover
    assert mark_failure_inducing(seg, takeover=1, window=4).tolist()[:2] == [2, 3]


def test_step_buffer_skips_failure_inducing_and_idle_steps_when_imitating():
    executed_by = np.array([0, 0, 0, 0, 1, 1, 0, 0], np.int8)
    segment = np.where(executed_by == ExecutedBy.HUMAN, Segment.HUMAN, Segment.PROGRESS).astype(np.int8)
    segment = mark_failure_inducing(segment, takeover=4, window=2)
    segment[7] = Segment.IDLE
    buffer = StepBuffer.from_episodes([_episode(executed_by, segment)], ["agentview"])
    assert buffer.imitable_index().tolist() == [0, 1, 4, 5, 6]


def test_step_buffer_resizes_demo_frames_to_the_policy_size():
    """A dataset recorded at another size (robomimic's 84x84) must match the rollouts HABC concatenates it with."""
    ep = _episode(np.full(3, ExecutedBy.POLICY), np.full(3, Segment.PROGRESS))
    ep.observations["observation.images.agentview"][:, :4] = 200  # top half bright
    buffer = StepBuffer.from_episodes([ep], ["agentview"], image_size=4)
    assert buffer.images["agentview"].shape == (3, 4, 4, 3)
    assert (buffer.images["agentview"][:, :2] == 200).all() and (buffer.images["agentview"][:, 2:] == 0).all()
    assert StepBuffer.from_episodes([ep], ["agentview"], image_size=8).images["agentview"].shape == (3, 8, 8, 3)


def test_the_buffer_carries_each_cameras_pixel_labels_and_none_for_a_recording_without_them():
    """where_target: per step, camera and role (target, goal), the simulator's pixel labels as recorded under the
    camera's name, in the policy's camera order whatever order the episode holds them in; NaN for an episode that
    has none (a recording), beside one that has."""
    from kinema.train.buffer import where_targets
    from sim.rollout import collect_demos

    demo = collect_demos("pick_place", 1, seeds=[3], num_envs=1, image_size=32)[0]
    cameras = ("wrist", "agentview")
    recording = Episode(observations=demo.observations, action=demo.action, task=demo.task)
    buffer = StepBuffer.from_episodes([demo, recording], cameras)
    assert buffer.where.shape == (2 * len(demo), 2, 2, 2)
    labels = where_targets(demo, cameras)
    for c, cam in enumerate(cameras):
        for r, role in enumerate(("target", "goal")):
            recorded = demo.privileged[f"privileged.{role}_pixels.{cam}"]
            in_view = (np.abs(recorded) <= 1).all(-1)
            np.testing.assert_array_equal(labels[in_view, c, r], recorded[in_view])
            assert np.isnan(labels[~in_view, c, r]).all()
    assert (np.abs(labels[0, 1]) <= 1).all()  # the agentview sees both at the start
    batch = buffer.batch(np.array([0, len(demo)]), chunk_size=4)
    np.testing.assert_array_equal(batch["where_target"][0].numpy(), labels[0])
    assert torch.isnan(batch["where_target"][1]).all()
    stats = buffer.stats()  # per camera, over the steps the label is in view (the recording's NaNs left out)
    for c, cam in enumerate(cameras):
        if np.isfinite(labels[:, c]).all(-1).any(0).all():
            np.testing.assert_allclose(stats[f"where_target.{cam}"]["mean"], np.nanmean(labels[:, c], 0), rtol=1e-6)
            assert np.isfinite(stats[f"where_target.{cam}"]["std"]).all()
    assert "where_target.agentview" in stats
