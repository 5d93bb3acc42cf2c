"""Vectorised rollouts, chunked policies, demonstrations, and the simulated human's intervention structure."""

from __future__ import annotations

import numpy as np
import pytest

from diffusion_rl.data import ExecutedBy, Segment
from sim.experts import ExpertConfig
from sim.monitor import MonitorConfig
from sim.rollout import collect, collect_demos, make_vector
from sim.tasks import make
from sim.vector import InProcessVector


def random_policy(seed: int, scale: float = 0.5):
    rng = np.random.default_rng(seed)

    def policy(obs):
        return rng.normal(0.0, scale, (len(obs["task"]), 7)).astype(np.float32)

    return policy


def test_demos_are_labelled_human_and_succeed():
    episodes = collect_demos("stack", 4, num_envs=2, image_size=32)
    assert sorted(ep.seed for ep in episodes) == [0, 1, 2, 3]
    for ep in episodes:
        assert ep.outcome and ep.success[-1] and ep.steps_to_success == len(ep)
        assert (ep.executed_by == ExecutedBy.HUMAN).all() and (ep.segment == Segment.HUMAN).all()
        assert ep.policy_version == "expert" and ep.task_id == "stack"
        assert ep.observations["observation.images.agentview"].shape == (len(ep), 32, 32, 3)
        assert ep.privileged["privileged.objects"].shape[0] == len(ep)
        # Observation t is what the expert saw before action t: the first state is the reset state.
        assert ep.reward.sum() == 1.0 and ep.reward[-1] == 1.0


def test_dart_demos_record_the_clean_command_not_the_executed_one():
    """demos with ExpertConfig.perturb: each step's recorded action is the expert's clean command at the state the
    perturbed run reached. From the same reset the first label equals the unperturbed demo's; the states part after."""
    plain = collect_demos("pick_place", 1, seeds=[5], num_envs=1, image_size=32)[0]
    dart = collect_demos("pick_place", 1, seeds=[5], num_envs=1, image_size=32, expert=ExpertConfig(perturb=0.3))[0]
    np.testing.assert_array_equal(dart.action[0], plain.action[0])
    state = "observation.state"
    assert not np.allclose(dart.observations[state][1:6], plain.observations[state][1:6])
    # The recorded label is not what moved the arm: replaying the labels from the same reset reaches other states.
    env = make("pick_place", image_size=32)
    env.reset(seed=5)
    for action in dart.action[:10]:
        obs, *_ = env.step(action)
    assert not np.allclose(obs[state], dart.observations[state][10], atol=1e-4)
    env.close()


def test_process_vector_matches_in_process_vector():
    """Same seeds, same episodes, whether the envs live here or in two worker processes."""
    kwargs = dict(actor="expert", expert=ExpertConfig(noise=0.3), image_size=32)
    local = make_vector("push", 3, num_workers=0, **kwargs)
    remote = make_vector("push", 3, num_workers=2, **kwargs)
    try:
        a = {ep.seed: ep for ep in collect(local, random_policy(0), range(5), task_id="push")}
        b = {ep.seed: ep for ep in collect(remote, random_policy(0), range(5), task_id="push")}
    finally:
        local.close()
        remote.close()
    assert sorted(a) == sorted(b) == list(range(5))
    for seed in a:
        np.testing.assert_array_equal(a[seed].action, b[seed].action)
        np.testing.assert_array_equal(a[seed].observations["observation.state"], b[seed].observations["observation.state"])
        np.testing.assert_array_equal(
            a[seed].observations["observation.images.wrist"], b[seed].observations["observation.images.wrist"]
        )


def test_action_chunks_are_executed_in_order():
    horizon = 4
    calls = []

    def chunk_policy(obs):
        calls.append(1)
        n = len(obs["task"])
        chunk = np.zeros((n, horizon, 7), np.float32)
        chunk[:, :, 0] = np.linspace(0.1, 0.4, horizon)  # a recognisable per-step x command
        return chunk

    vector = make_vector("pick_place", 2, cameras=(), config={"horizon": 12})
    episodes = collect(vector, chunk_policy, [0, 1], task_id="pick_place")
    for ep in episodes:
        assert len(ep) == 12
        np.testing.assert_allclose(ep.action[:, 0], np.tile(np.linspace(0.1, 0.4, horizon), 3), atol=1e-6)
    assert len(calls) == 3  # one chunk of 4 per 4 steps, for both envs at once


def test_bad_policy_output_is_a_clear_error():
    vector = make_vector("push", 2, cameras=())
    with pytest.raises(ValueError, match="policy must return \\(B, 7\\) or \\(B, H, 7\\) with B=2; got shape \\(2, 6\\)"):
        collect(vector, lambda obs: np.zeros((2, 6)), [0], task_id="push")


@pytest.mark.parametrize("rewind", ["drive", "teleport", "none"])
def test_simulated_human_intervention_structure(rewind):
    config = MonitorConfig(rewind=rewind, stall_steps=15, failure_window=5)
    vector = make_vector("pick_place", 2, cameras=(), actor="monitored", monitor=config)
    episodes = collect(vector, random_policy(1), range(4), task_id="pick_place")
    takeovers = 0
    for ep in episodes:
        human = ep.executed_by == ExecutedBy.HUMAN
        # Who acted and what the step is labelled agree exactly.
        assert np.isin(ep.segment[human], [Segment.RECOVERY, Segment.HUMAN]).all()
        assert np.isin(ep.segment[~human], [Segment.PROGRESS, Segment.IDLE, Segment.FAILURE_INDUCING]).all()
        policy_since = 0
        for start, stop, who in ep.segments():
            if who == ExecutedBy.POLICY:
                policy_since = start
            elif start > 0:
                takeovers += 1
                # The policy steps right before a takeover led to it: they are failure_inducing.
                before = ep.segment[max(policy_since, start - config.failure_window) : start]
                assert len(before) > 0
                assert (before == Segment.FAILURE_INDUCING).all()
                # A recovery (drive-back) comes first, and only when rewinding by driving.
                has_recovery = (ep.segment[start:stop] == Segment.RECOVERY).any()
                assert has_recovery == (rewind == "drive")
                if has_recovery:
                    assert ep.segment[start] == Segment.RECOVERY
    assert takeovers >= 4  # a random policy stalls; the human must have stepped in repeatedly


def test_monitor_leaves_a_competent_policy_alone():
    vector = make_vector(
        "drawer", 2, cameras=(), actor="monitored", monitor=MonitorConfig(), autopilot=ExpertConfig()
    )
    episodes = collect(vector, random_policy(0), range(4), task_id="drawer")
    for ep in episodes:
        assert ep.outcome
        assert (ep.executed_by == ExecutedBy.POLICY).all()


def test_last_takeover_finishes_the_task():
    config = MonitorConfig(rewind="teleport", stall_steps=10, max_takeovers=1)
    vector = make_vector("push", 2, cameras=(), actor="monitored", monitor=config)
    episodes = collect(vector, random_policy(2, scale=0.05), range(4), task_id="push")
    for ep in episodes:
        runs = ep.segments()
        assert runs[-1][2] == ExecutedBy.HUMAN, "the final takeover never hands back"
        assert ep.outcome


def test_worker_errors_keep_their_type_and_message():
    vector = make_vector("push", 2, num_workers=2, cameras=())
    try:
        for i in range(2):
            vector.reset_at(i, i)
        bad = np.zeros((2, 7))
        bad[1, 3] = np.nan
        with pytest.raises(ValueError, match="NaN or inf at indices \\[3\\]"):
            vector.step(bad)
        # The other worker's reply was consumed: the vector still works.
        vector.reset_at(1, 5)
        _, rewards, *_ = vector.step(np.zeros((2, 7)))
        assert rewards.shape == (2,)
    finally:
        vector.close()


def test_privileged_state_is_aligned_with_observations():
    """privileged[t] describes the scene at observation t (what an auxiliary head sees), not after action t."""
    from sim.rollout import make_env

    episodes = collect_demos("pick_place", 2, num_envs=2, cameras=())
    env = make_env("pick_place", cameras=(), actor="expert")
    for ep in episodes:
        obs, info = env.reset(seed=ep.seed)
        np.testing.assert_allclose(ep.privileged["privileged.target_pos"][0], info["privileged"]["privileged.target_pos"])
        np.testing.assert_array_equal(ep.observations["observation.state"][0], obs["observation.state"])
        for t in range(len(ep) - 1):
            obs, _, _, _, info = env.step(np.zeros(7))
            np.testing.assert_allclose(ep.privileged["privileged.target_pos"][t + 1], info["privileged"]["privileged.target_pos"], atol=1e-6)
            np.testing.assert_allclose(ep.observations["observation.state"][t + 1], obs["observation.state"], atol=1e-6)
            np.testing.assert_allclose(ep.action[t], info["action"], atol=1e-6)


def test_teleport_rewind_returns_the_rewound_observation():
    from sim.rollout import make_env

    env = make_env("push", cameras=(), actor="monitored", monitor=MonitorConfig(rewind="teleport", stall_steps=5))
    obs, _ = env.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(60):
        obs, _, terminated, truncated, info = env.step(rng.normal(0, 0.5, 7))
        # Whatever happened inside the step, the returned observation is the live simulator state.
        np.testing.assert_allclose(obs["observation.state"], env.unwrapped.state_vector(), atol=1e-6)
        if terminated or truncated:
            break
    assert env.takeovers >= 1


def test_an_episode_that_reached_a_wrong_target_is_a_failure_and_says_so():
    """The drawer's other drawer left open (as a policy that pulled both would leave it): the named one opened as
    well, the episode fails and is marked `wrong_target`; the evaluation reports the share. With the named drawer
    alone it succeeds, not marked."""
    from kinema.train.evaluate import summarize
    from sim.tasks.drawer import DrawerEnv

    class Opened(DrawerEnv):
        both = True

        def sample_episode(self, rng):
            instruction = super().sample_episode(rng)
            self.data.qpos[self.joint_adr[self.which]] = 0.15
            if self.both:
                self.data.qpos[self.joint_adr["bottom" if self.which == "top" else "top"]] = 0.15
            return instruction

    class NamedOnly(Opened):
        both = False

    still = lambda obs: np.zeros((len(obs["task"]), 7), np.float32)  # noqa: E731
    for env_class, wrong in ((Opened, True), (NamedOnly, False)):
        vector = InProcessVector([lambda: env_class(image_size=32)] * 2)
        episodes = collect(vector, still, [0, 1, 2], task_id="drawer")
        assert [ep.wrong_target for ep in episodes] == [wrong] * 3
        assert [ep.outcome for ep in episodes] == [not wrong] * 3
        result = summarize(episodes)
        assert (result.success, result.wrong_target) == ((0.0, 1.0) if wrong else (1.0, 0.0))
        assert result.as_dict("train/")["train/wrong_target"] == result.wrong_target


class ImagePolicy:
    """Chunks of 3 that depend on the wrist frame it decides from; keeps each decision's (env, step, frame)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, np.ndarray]] = []
        self.steps: list[int | None] = []

    def about_to_act(self, seeds, steps) -> None:
        self.steps = steps

    def __call__(self, obs):
        frames = obs["observation.images.wrist"].astype(np.float32) / 255.0
        chunk = np.zeros((len(obs["task"]), 3, 7), np.float32)
        chunk[:, :, 0] = (frames.mean(axis=(1, 2, 3)) - 0.4)[:, None] * 4
        chunk[:, :, 1] = np.array([0.3, -0.2, 0.1])
        for i, step in enumerate(self.steps):
            if step is not None:
                self.seen.append((i, step, obs["observation.images.wrist"][i].copy()))
        return chunk


def _collect_counting_renders(frames: str, monkeypatch, workers: int = 0, **kwargs):
    import mujoco

    renders = [0]
    render = mujoco.Renderer.render

    def counted(self, *args, **kw):
        renders[0] += 1
        return render(self, *args, **kw)

    monkeypatch.setattr(mujoco.Renderer, "render", counted)
    policy = ImagePolicy()
    vector = make_vector("push", 2, num_workers=workers, image_size=24, config={"horizon": 14}, **kwargs)
    try:
        episodes = sorted(collect(vector, policy, range(3), task_id="push", frames=frames), key=lambda ep: ep.seed)
    finally:
        vector.close()
    monkeypatch.setattr(mujoco.Renderer, "render", render)
    return episodes, policy.seen, renders[0]


def test_frames_when_acting_render_only_what_the_policy_decides_from(monkeypatch):
    """`frames="when_acting"` (evaluations): the policy decides from the same fresh frames as when every step renders,
    so the episodes play the same; the cameras render about once a chunk, and the episodes carry no frames."""
    full, full_seen, full_renders = _collect_counting_renders("every_step", monkeypatch)
    lean, lean_seen, lean_renders = _collect_counting_renders("when_acting", monkeypatch)
    assert [(i, s) for i, s, _ in lean_seen] == [(i, s) for i, s, _ in full_seen]
    for (_, _, a), (_, _, b) in zip(full_seen, lean_seen, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(full, lean, strict=True):
        np.testing.assert_array_equal(a.action, b.action)
        np.testing.assert_array_equal(a.observations["observation.state"], b.observations["observation.state"])
        assert "observation.images.wrist" in a.observations and "observation.images.wrist" not in b.observations
    assert full_renders == 2 * (3 + 3 * 14)  # two cameras at each reset and after each step
    assert lean_renders == 2 * len(lean_seen)  # only the observations a chunk was decided from
    with pytest.raises(ValueError, match="frames must be 'every_step' or 'when_acting'; got 'sometimes'"):
        collect(make_vector("push", 1, cameras=()), ImagePolicy(), [0], task_id="push", frames="sometimes")


def test_frames_when_acting_render_afresh_where_a_human_cut_the_chunk_short(monkeypatch):
    """A takeover empties the policy's chunk midway, after steps that rendered nothing: the env renders again before
    the policy decides, so it decides from what it sees, as when every step renders."""
    monitor = dict(actor="monitored", monitor=MonitorConfig(rewind="teleport", stall_steps=4, failure_window=2))
    full, full_seen, _ = _collect_counting_renders("every_step", monkeypatch, **monitor)
    refreshed = []
    observe_at = InProcessVector.observe_at
    monkeypatch.setattr(InProcessVector, "observe_at", lambda self, indices: refreshed.extend(indices) or observe_at(self, indices))
    lean, lean_seen, _ = _collect_counting_renders("when_acting", monkeypatch, **monitor)
    assert any((ep.executed_by == ExecutedBy.HUMAN).any() for ep in full) and refreshed
    assert [(i, s) for i, s, _ in lean_seen] == [(i, s) for i, s, _ in full_seen]
    for (_, _, a), (_, _, b) in zip(full_seen, lean_seen, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(full, lean, strict=True):
        np.testing.assert_array_equal(a.action, b.action)
        np.testing.assert_array_equal(a.executed_by, b.executed_by)
    in_workers, _, _ = _collect_counting_renders("when_acting", monkeypatch, workers=2, **monitor)
    for a, b in zip(full, in_workers, strict=True):
        np.testing.assert_array_equal(a.action, b.action)
