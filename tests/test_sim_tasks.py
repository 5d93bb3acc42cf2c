"""Every registered task: interface, determinism, bad input, splits, difficulty, and its scripted expert."""

from __future__ import annotations

import mujoco
import numpy as np
import pytest

from sim.experts import ExpertConfig, TeleopConfig, make_expert
from sim.tasks import TASKS, make
from sim.tasks.objects import HELDOUT_COMBOS

ALL_TASKS = sorted(TASKS)


def run_expert(env, seed: int, expert: ExpertConfig | None = None) -> tuple[bool, int]:
    obs, _ = env.reset(seed=seed)
    policy = make_expert(env, expert, seed=seed)
    for t in range(env.config.horizon):
        obs, reward, terminated, truncated, info = env.step(policy(obs))
        if terminated or truncated:
            return info["is_success"], t + 1
    raise AssertionError("episode neither terminated nor truncated at the horizon")


@pytest.mark.parametrize("task", ALL_TASKS)
def test_reset_step_interface(task):
    env = make(task, image_size=64)
    obs, info = env.reset(seed=0)
    assert set(obs) == {"observation.images.agentview", "observation.images.wrist", "observation.state", "task"}
    for cam in ("agentview", "wrist"):
        img = obs[f"observation.images.{cam}"]
        assert img.dtype == np.uint8 and img.shape == (64, 64, 3)
        assert img.std() > 5, f"{cam} image of {task} is blank"
    assert obs["observation.state"].dtype == np.float32 and obs["observation.state"].shape == (8,)
    assert env.observation_space.contains(obs)
    assert isinstance(obs["task"], str) and len(obs["task"]) > 5
    assert env.action_space.shape == (7,)
    # Privileged state is offered in info, never in the observation.
    assert all(k.startswith("privileged.") for k in info["privileged"])
    assert not any(k.startswith("privileged") for k in obs)
    for _ in range(5):
        obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
        assert np.isfinite(obs["observation.state"]).all()
        assert reward == float(info["is_success"])
        assert 0.0 <= info["progress"] <= 1.0
    env.close()


@pytest.mark.parametrize("task", ALL_TASKS)
def test_seeded_episodes_are_exactly_reproducible(task):
    def trajectory(seed):
        env = make(task, image_size=32)
        obs, _ = env.reset(seed=seed)
        expert = make_expert(env, ExpertConfig(noise=0.2), seed=seed)
        states, images = [], []
        for _ in range(15):
            obs, *_ = env.step(expert(obs))
            states.append(obs["observation.state"])
            images.append(obs["observation.images.agentview"])
        return obs["task"], np.stack(states), np.stack(images)

    task_a, states_a, images_a = trajectory(3)
    task_b, states_b, images_b = trajectory(3)
    task_c, states_c, _ = trajectory(4)
    assert task_a == task_b
    np.testing.assert_array_equal(states_a, states_b)
    np.testing.assert_array_equal(images_a, images_b)
    assert not np.array_equal(states_a, states_c)


@pytest.mark.parametrize("task", ALL_TASKS)
def test_scripted_expert_succeeds_at_zero_noise(task):
    env = make(task, cameras=())
    results = [run_expert(env, seed)[0] for seed in range(50)]
    assert np.mean(results) >= 0.95, f"{task}: expert succeeded in {np.mean(results):.0%} of 50 seeds"


def test_expert_competence_is_tunable():
    env = make("pick_place", cameras=())
    clean = [run_expert(env, s) for s in range(12)]
    sloppy = [run_expert(env, s, ExpertConfig(noise=0.6, hesitation=0.1, wrong_grasp=1.0)) for s in range(12)]
    # Sloppier experts are slower (mis-aimed grasps are retried, pauses cost steps) or fail outright.
    mean_len = lambda rs: np.mean([n if ok else 200 for ok, n in rs])  # noqa: E731
    assert mean_len(sloppy) > mean_len(clean) + 10


TELEOP_SEEDS = 20


@pytest.mark.parametrize("task", ALL_TASKS)
def test_teleop_operator_is_slower_than_the_expert_and_still_succeeds(task):
    """Teleoperator-quality demonstrations (demos.source teleop): pauses, hesitation, slow approaches and detours
    take clearly more steps than the scripted expert's on the same seeds, and still succeed in >= 90 %."""
    env = make(task, cameras=())
    clean = [run_expert(env, s) for s in range(TELEOP_SEEDS)]
    teleop = [run_expert(env, s, ExpertConfig(operator="teleop")) for s in range(TELEOP_SEEDS)]
    success = np.mean([ok for ok, _ in teleop])
    assert success >= 0.9, f"{task}: the teleoperator succeeded in {success:.0%} of {TELEOP_SEEDS} seeds"
    steps = lambda rs: np.mean([n for ok, n in rs if ok])  # noqa: E731
    ratio = steps(teleop) / steps(clean)
    assert ratio > 1.4, f"{task}: teleoperator steps to success only {ratio:.2f}x the expert's"
    # Deterministic per seed, different across seeds.
    assert run_expert(env, 3, ExpertConfig(operator="teleop")) == teleop[3]
    assert len({n for _, n in teleop}) > TELEOP_SEEDS // 3


def test_dart_perturbation_moves_the_arm_and_keeps_the_clean_label():
    """ExpertConfig.perturb (DART): the executed command carries slowly varying noise, the label is what the same
    expert without it commands at every state the noise led to; the perturbed expert still succeeds."""
    env = make("pick_place", cameras=())
    obs, _ = env.reset(seed=2)
    perturbed = make_expert(env, ExpertConfig(perturb=0.3), seed=2)
    clean = make_expert(env, ExpertConfig(), seed=2)  # follows the same states, commands without noise
    gaps = []
    for _ in range(20):
        executed = perturbed(obs)
        np.testing.assert_array_equal(perturbed.label, clean(obs))
        gaps.append(np.abs(executed[:6] - perturbed.label[:6]).max())
        assert executed[6] == perturbed.label[6]  # the gripper is never perturbed
        obs, *_ = env.step(executed)
    assert min(gaps) > 0 and np.mean(gaps) > 0.1
    # Correlated over steps: the arm drifts off the path rather than jittering about it.
    drift = perturbed.perturbation
    assert np.abs(drift).max() > 0
    results = [run_expert(env, seed, ExpertConfig(perturb=0.05)) for seed in range(10)]
    assert np.mean([ok for ok, _ in results]) >= 0.9


def test_funnel_approach_succeeds_and_recovers_from_low_off_to_one_side():
    """approach="funnel": the height allowed over the object grows with the distance in the plane. The expert
    succeeds as the gate expert does, and a gripper found low and 5 cm to one side of its object is told to rise
    (the gate expert's demos never reach that state)."""
    env = make("pick_place", cameras=())
    results = [run_expert(env, seed, ExpertConfig(approach="funnel")) for seed in range(20)]
    assert np.mean([ok for ok, _ in results]) >= 0.95
    env.reset(seed=1)
    expert = make_expert(env, ExpertConfig(approach="funnel"), seed=1)
    u = env.unwrapped
    obj = u.body_pos(u.target.body)
    ee = u.ee_pos()
    # Drive the gripper down beside the object (P-control on the end effector, as the expert's `move` does).
    side = obj[:2] + np.array([0.0, 0.05]) if obj[1] < 0.1 else obj[:2] - np.array([0.0, 0.05])
    for _ in range(60):
        action = expert.move(np.array([side[0], side[1], obj[2] + 0.02]), expert.home_yaw(), -1.0)
        env.step(action)
    ee = u.ee_pos()
    assert ee[2] - obj[2] < 0.04 and np.linalg.norm(ee[:2] - obj[:2]) > 0.03
    command = expert()
    assert command[2] > 0.5 and np.abs(command[:2]).max() < 0.2, f"not straight up: {command[:3]}"
    # Far above, it comes down toward the object and the object at once (a cone, not a hold-then-drop).
    env.reset(seed=1)
    expert.reset()
    command = expert()
    assert command[2] < -0.3 and np.linalg.norm(command[:2]) > 0.1


def test_teleop_settings_are_checked():
    with pytest.raises(ValueError, match="ExpertConfig.operator must be one of scripted, teleop; got 'human'"):
        ExpertConfig(operator="human")
    with pytest.raises(ValueError, match="ExpertConfig.approach must be one of gate, funnel; got 'dive'"):
        ExpertConfig(approach="dive")
    with pytest.raises(ValueError, match="ExpertConfig.perturb must be a finite number >= 0"):
        ExpertConfig(perturb=-0.1)
    with pytest.raises(ValueError, match=r"TeleopConfig.speed must be a range \(low, high\)"):
        TeleopConfig(speed=(0.6, 0.3))
    with pytest.raises(ValueError, match="TeleopConfig.detour is a probability"):
        TeleopConfig(detour=1.5)


def test_unknown_task_lists_valid_ones():
    with pytest.raises(ValueError, match="valid tasks: drawer, drawer_hard, pick_place, .*Did you mean .pick_place."):
        make("pick_plce")


def test_unknown_config_key_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown task config keys \\['distractors'\\].*num_distractors"):
        make("stack", {"distractors": 3})


@pytest.mark.parametrize(
    "action, message",
    [
        (np.zeros(6), "shape \\(7,\\)"),
        (np.zeros((1, 7)), "shape \\(7,\\)"),
        (np.array([0, 0, np.nan, 0, 0, 0, 0]), "NaN or inf at indices \\[2\\]"),
        (np.array([0, 0, 0, 0, np.inf, 0, 0]), "NaN or inf at indices \\[4\\]"),
    ],
)
def test_bad_action_raises_and_leaves_state_unchanged(action, message):
    env = make("pick_place", cameras=())
    env.reset(seed=1)
    env.step(np.full(7, 0.3))
    before = env.get_state().copy()
    steps = env.steps
    with pytest.raises(ValueError, match=message):
        env.step(action)
    np.testing.assert_array_equal(env.get_state(), before)
    assert env.steps == steps


@pytest.mark.parametrize("task", ["pick_place", "push", "stack"])
def test_heldout_splits(task):
    cls = TASKS[task]
    train = make(task, cameras=())
    heldout = make(task, cameras=(), instructions="heldout", objects="heldout")
    for seed in range(15):
        train.reset(seed=seed)
        heldout.reset(seed=seed)
        target = train.descriptions[0] if hasattr(train, "descriptions") else None
        assert any(_matches(t, train.task) for t in cls.instructions.train)
        assert any(_matches(t, heldout.task) for t in cls.instructions.heldout)
        assert not any(_matches(t, heldout.task) for t in cls.instructions.train)
        slot = train.target
        color = _color_of(train, slot.geom)
        assert (color, slot.shape) not in HELDOUT_COMBOS, target
        assert (_color_of(heldout, heldout.target.geom), heldout.target.shape) in HELDOUT_COMBOS


def _matches(template: str, text: str) -> bool:
    prefix = template.split("{")[0]
    return text.startswith(prefix) and text.endswith(template.split("}")[-1])


def _color_of(env, geom: str) -> str:
    from sim.env import COLORS

    rgb = env.model.geom_rgba[env.model.geom(geom).id, :3]
    return min(COLORS, key=lambda c: np.abs(np.array(COLORS[c]) - rgb).sum())


def test_difficulty_is_configurable():
    few = make("pick_place", {"num_distractors": 0}, cameras=())
    many = make("pick_place", {"num_distractors": 3}, cameras=())
    with pytest.raises(ValueError, match="num_distractors=4 exceeds the 3"):
        make("pick_place", {"num_distractors": 4})
    with pytest.raises(ValueError, match="num_distractors must be >= 0; got -1"):
        make("push", {"num_distractors": -1})
    few.reset(seed=0)
    many.reset(seed=0)
    assert len(few.active) == 1 and len(many.active) == 4
    narrow = make("push", {"x_range": [0.5, 0.5], "y_range": [0.0, 0.0], "num_distractors": 0}, cameras=())
    with pytest.raises(ValueError, match="cannot place"):
        narrow.reset(seed=0)
    only_red_blue = make("stack", {"colors": ["red", "blue"], "num_distractors": 0}, cameras=())
    only_red_blue.reset(seed=0)
    assert {_color_of(only_red_blue, s.geom) for s in only_red_blue.active} == {"red", "blue"}
    with pytest.raises(ValueError, match="unknown colours \\['teal'\\]"):
        make("stack", {"colors": ["teal"]})


def test_layouts_do_not_overlap():
    env = make("pick_place", {"num_distractors": 3}, cameras=())
    for seed in range(20):
        env.reset(seed=seed)
        xy = np.array([env.body_pos(s.body)[:2] for s in env.active])
        d = np.linalg.norm(xy[:, None] - xy[None], axis=-1) + np.eye(len(xy))
        assert d.min() > 0.08


def test_drawer_heldout_objects_name_a_heldout_colour():
    from sim.tasks.drawer import HELDOUT_DRAWER_COLORS

    env = make("drawer", cameras=(), objects="heldout")
    for seed in range(10):
        env.reset(seed=seed)
        assert env.target_color in HELDOUT_DRAWER_COLORS and env.target_color in env.task
    train = make("drawer", cameras=())
    for seed in range(10):
        train.reset(seed=seed)
        assert train.target_color not in HELDOUT_DRAWER_COLORS


def test_equivalent_instructions_name_the_same_targets_in_every_training_template():
    """A drawer is named by its place or its colour: both, in each training template, and nothing else; a task with one naming gets each template once. A seed that does not give the episode's instruction
    (other settings) is refused."""
    from diffusion_rl.data import Episode
    from sim.rollout import equivalent_instructions
    from sim.tasks.drawer import DrawerEnv

    env = make("drawer", cameras=())
    for seed in range(6):
        env.reset(seed=seed)
        same = env.equivalent_instructions()
        assert env.task in same and len(same) == 2 * len(DrawerEnv.instructions.train) == len(set(same))
        for template in DrawerEnv.instructions.train:
            assert {template.format(which=env.which), template.format(which=env.target_color)} <= set(same)
        assert all(env.which in text or env.target_color in text for text in same)  # no other word in the name's place
    pick = make("pick_place", cameras=())
    pick.reset(seed=3)
    assert pick.task in pick.equivalent_instructions() and len(pick.equivalent_instructions()) == 3

    def demo(seed: int, task: str) -> Episode:
        return Episode(observations={"observation.state": np.zeros((2, 8), np.float32)}, action=np.zeros((2, 7)), task=task, seed=seed)

    env.reset(seed=4)
    assert equivalent_instructions("drawer", [demo(4, env.task)]) == [env.equivalent_instructions()]
    with pytest.raises(ValueError, match=r"episode 0 \(seed 4\) was instructed 'open the door'.*recorded with other settings"):
        equivalent_instructions("drawer", [demo(4, "open the door")])
    with pytest.raises(ValueError, match="episode 0 has no seed"):
        equivalent_instructions("drawer", [demo(None, env.task)])


@pytest.mark.parametrize("variant", ["pick_place_hard", "stack_hard", "push_hard", "drawer_hard"])
def test_hard_variants_are_harder_and_still_solvable(variant):
    from sim.tasks import VARIANTS

    env = make(variant, cameras=())
    assert env.config.num_distractors == VARIANTS[variant][1]["num_distractors"]
    assert np.mean([run_expert(env, seed)[0] for seed in range(10)]) >= 0.8


@pytest.mark.parametrize("task", ALL_TASKS)
def test_an_episode_is_its_seeds_alone_whatever_the_env_played_before(task):
    """Colours and placements an earlier episode gave an object slot the next one leaves idle are reset: the push
    task's wrist camera saw such a slot, so the same seed rendered differently in a used env and a fresh one."""
    used, fresh = make(task, image_size=32), make(task, image_size=32)
    for seed in range(6):
        used.reset(seed=seed)
    obs_used, _ = used.reset(seed=7)
    obs_fresh, _ = fresh.reset(seed=7)
    np.testing.assert_array_equal(used.model.geom_rgba, fresh.model.geom_rgba)
    np.testing.assert_array_equal(used.model.body_pos, fresh.model.body_pos)
    for key in obs_fresh:
        if key != "task":
            np.testing.assert_array_equal(obs_used[key], obs_fresh[key])
    used.close()
    fresh.close()


def test_success_is_strict_another_target_reached_fails_the_episode():
    """Success means what the instruction asks: the named target reached and nothing else the instruction did not ask
    for (RL learned to pull both drawers when the lenient test paid for it). `info["wrong_target"]` says which."""

    def place(env, slot, xy, z):
        env.set_free_body(slot.body, np.array([*xy, z]))
        mujoco.mj_forward(env.model, env.data)

    def outcome(env):  # one step of a zero action: what the episode reports
        _, reward, terminated, _, info = env.step(np.zeros(7, np.float32))
        return info["is_success"], info["wrong_target"], terminated, reward

    env = make("drawer")
    env.reset(seed=0)
    other = "bottom" if env.which == "top" else "top"
    env.data.qpos[env.joint_adr[env.which]] = 0.15
    mujoco.mj_forward(env.model, env.data)
    assert outcome(env) == (True, False, True, 1.0)
    env.data.qpos[env.joint_adr[other]] = 0.15
    mujoco.mj_forward(env.model, env.data)
    assert env.target_reached() and outcome(env) == (False, True, False, 0.0)

    env = make("pick_place")
    env.reset(seed=0)
    plate, other_plate = env.goal_pos(), env.model.body_pos[env.model.body("plate1").id].copy()
    target, distractor = env.active[0], env.active[1]
    place(env, target, plate[:2] - [0.022, 0], env.place_height())
    assert outcome(env)[:2] == (True, False)
    env.reset(seed=0)
    place(env, target, plate[:2] - [0.022, 0], env.place_height())
    place(env, distractor, plate[:2] + [0.022, 0], env.place_height())
    assert env.target_reached() and outcome(env)[:2] == (False, True)
    env.reset(seed=0)
    place(env, target, other_plate[:2], env.place_height())
    assert outcome(env)[:2] == (False, True)
    env.reset(seed=0)
    place(env, target, other_plate[:2], 0.15)  # carried over the other plate, not left on it
    assert not env.wrong_target()

    env = make("push")
    env.reset(seed=0)
    region = env.goal_pos()
    place(env, env.active[0], region[:2] - [0.03, 0], 0.02)
    assert outcome(env)[:2] == (True, False)
    env.reset(seed=0)
    place(env, env.active[0], region[:2] - [0.03, 0], 0.02)
    place(env, env.active[1], region[:2] + [0.03, 0], 0.02)
    assert env.target_reached() and outcome(env)[:2] == (False, True)

    env = make("stack")
    env.reset(seed=0)
    base, distractor = env.body_pos(env.base.body), env.active[2]
    place(env, distractor, base[:2], base[2] + 0.04)
    assert not env.target_reached() and outcome(env)[:2] == (False, True)
    env.reset(seed=0)
    below = env.body_pos(distractor.body)
    place(env, env.target, below[:2], below[2] + 0.04)
    assert outcome(env)[:2] == (False, True)
    env.reset(seed=0)
    place(env, env.target, base[:2], base[2] + 0.04)
    assert outcome(env)[:2] == (True, False)


def test_the_ablated_split_names_no_target_in_the_scenes_the_training_split_shows():
    """instructions="ablated": the training templates with nonsense words where the targets' names were. A seed's
    scene is the training split's (evaluations pair by seed), and the instruction no longer tells targets apart:
    named instructions of different targets become one ablated instruction, at most one per training template."""
    for task in ("drawer", "pick_place", "push", "stack"):
        named, ablated = make(task, image_size=32), make(task, image_size=32, instructions="ablated")
        named_by_ablated: dict[str, set[str]] = {}
        for seed in range(12):
            a, _ = named.reset(seed=seed)
            b, _ = ablated.reset(seed=seed)
            np.testing.assert_array_equal(named.data.qpos, ablated.data.qpos)
            np.testing.assert_array_equal(named.model.geom_rgba, ablated.model.geom_rgba)
            np.testing.assert_array_equal(a["observation.images.agentview"], b["observation.images.agentview"])
            names = {*named.config.colors, "cube", "brick", "block", *(("top", "bottom") if task == "drawer" else ())}
            assert not set(b["task"].split()) & names, b["task"]
            named_by_ablated.setdefault(b["task"], set()).add(a["task"])
        assert len(named_by_ablated) <= len(named.instructions.train), (task, named_by_ablated)
        assert max(len(v) for v in named_by_ablated.values()) > 1, (task, named_by_ablated)
    with pytest.raises(ValueError, match="instructions must be one of"):
        make("drawer", instructions="none")


def test_the_pixel_labels_land_on_the_named_object_and_on_the_plate():
    """privileged.target_pixels.<camera> / goal_pixels.<camera>: where the named object and the named plate are in each camera's image
    (the labels a locator learns from). Known answer: MuJoCo's segmentation render at those pixels shows those geoms,
    in the agentview and, where they are in its view, in the wrist camera; the drawer has a target and no place."""
    env = make("pick_place", image_size=96)
    renderer = mujoco.Renderer(env.model, 96, 96)
    renderer.enable_segmentation_rendering()
    checked = {cam: 0 for cam in env.cameras}
    for seed in range(6):
        _, info = env.reset(seed=seed)
        privileged = info["privileged"]
        for cam in env.cameras:
            renderer.update_scene(env.data, camera=cam)
            segments = renderer.render()[..., 0]
            for key, geom in (("privileged.target_pixels", env.target.geom), ("privileged.goal_pixels", "plate0")):
                x, y = privileged[f"{key}.{cam}"]
                if max(abs(x), abs(y)) > 0.95:  # out of this camera's view
                    continue
                column, row = int((x + 1) / 2 * 96), int((y + 1) / 2 * 96)
                assert segments[row, column] == env.model.geom(geom).id, (seed, cam, key, (row, column))
                checked[cam] += 1
    assert checked["agentview"] == 12 and checked["wrist"] >= 2, checked
    renderer.close()
    drawer = make("drawer", image_size=64)
    _, info = drawer.reset(seed=0)
    labels = sorted(k for k in info["privileged"] if "_pixels" in k)
    assert labels == [f"privileged.target_pixels.{cam}" for cam in sorted(drawer.cameras)], labels
