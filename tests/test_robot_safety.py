"""The safety layer on its own: each rule alone, with numbers."""

import numpy as np
import pytest

from robot.config import load_robot_config
from robot.safety import SafetyLayer, SafetyLimits, SafetyStatus


def limits(**overrides) -> SafetyLimits:
    base = dict(
        lower=np.array([-1.0, -1.0, 0.0]), upper=np.array([1.0, 1.0, 0.04]), max_step=np.array([0.1, 0.1, 0.04]),
        state_timeout_s=0.1, image_timeout_s=0.1, max_rate_hz=40.0,
    )
    return SafetyLimits(**{**base, **overrides})


def ready(layer: SafetyLayer, q=(0.0, 0.0, 0.02), now: float = 0.0) -> SafetyLayer:
    assert layer.observe_state(np.array(q), now)
    for cam in layer.cameras:
        layer.observe_image(cam, now)
    return layer


def test_passes_a_command_inside_every_limit_unchanged():
    layer = ready(SafetyLayer(limits()))
    d = layer.filter(np.array([0.05, -0.05, 0.03]), 0.0)
    assert d.status is SafetyStatus.OK
    np.testing.assert_array_equal(d.command, [0.05, -0.05, 0.03])


def test_no_motion_before_the_first_valid_state():
    layer = SafetyLayer(limits())
    d = layer.filter(np.array([0.0, 0.0, 0.0]), 0.0)
    assert d.status is SafetyStatus.BLOCKED_NO_STATE and d.command is None
    # An invalid state (NaN, wrong length) does not count as the first state.
    assert not layer.observe_state(np.array([np.nan, 0.0, 0.0]), 0.0)
    assert not layer.observe_state(np.array([0.0, 0.0]), 0.0)
    assert layer.filter(np.zeros(3), 0.1).status is SafetyStatus.BLOCKED_NO_STATE
    assert layer.counters["invalid_state"] == 2


def test_joint_position_limits_clip():
    layer = ready(SafetyLayer(limits(max_step=np.array([5.0, 5.0, 5.0]))))
    d = layer.filter(np.array([1.7, -3.0, 0.5]), 0.0)
    assert d.status is SafetyStatus.CLIPPED and "joint limits" in d.reason
    np.testing.assert_allclose(d.command, [1.0, -1.0, 0.04])


def test_max_step_per_tick_from_the_measured_state_then_from_the_last_command():
    layer = ready(SafetyLayer(limits()), q=(0.2, 0.0, 0.0))
    d = layer.filter(np.array([0.9, -0.5, 0.0]), 0.0)
    assert d.status is SafetyStatus.CLIPPED and "step bound" in d.reason
    np.testing.assert_allclose(d.command, [0.3, -0.1, 0.0])
    layer.observe_state(np.array([0.2, 0.0, 0.0]), 0.05)  # the arm lags; the bound follows the command stream
    d = layer.filter(np.array([0.9, -0.5, 0.0]), 0.05)
    np.testing.assert_allclose(d.command, [0.4, -0.2, 0.0])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_commands_hold_the_last_safe_command_and_raise_the_fault_flag(bad):
    layer = ready(SafetyLayer(limits()))
    first = layer.filter(np.array([0.05, 0.0, 0.02]), 0.0).command
    d = layer.filter(np.array([0.1, bad, 0.02]), 0.05)
    assert d.status is SafetyStatus.HOLD_NONFINITE and d.holding
    np.testing.assert_array_equal(d.command, first)
    assert layer.fault and "joints [1]" in layer.fault_reason
    # A wrong-length command is a fault too, and never reaches the wire.
    d = layer.filter(np.array([0.1, 0.1]), 0.1)
    assert d.status is SafetyStatus.HOLD_NONFINITE and d.command.shape == (3,)
    layer.clear_fault()
    assert not layer.fault


def test_non_finite_before_any_command_holds_the_measured_position():
    layer = ready(SafetyLayer(limits()), q=(0.3, -0.2, 0.01))
    d = layer.filter(np.full(3, np.nan), 0.0)
    np.testing.assert_array_equal(d.command, [0.3, -0.2, 0.01])


def test_workspace_box_holds_a_command_leaving_it():
    # FK of this toy arm: the EE is at (q0, q1, 0.5).
    fk = lambda q: np.array([q[0], q[1], 0.5])  # noqa: E731
    layer = ready(SafetyLayer(limits(workspace_min=np.array([-0.5, -0.5, 0.0]), workspace_max=np.array([0.5, 0.5, 1.0])), ee_position=fk), q=(0.45, 0.0, 0.0))
    d = layer.filter(np.array([0.55, 0.0, 0.0]), 0.0)
    assert d.status is SafetyStatus.HOLD_WORKSPACE and "5.0 cm outside" in d.reason
    np.testing.assert_allclose(d.command, [0.45, 0.0, 0.0])
    assert layer.filter(np.array([0.5, 0.0, 0.0]), 0.05).status is SafetyStatus.OK


def test_workspace_box_lets_an_arm_outside_it_move_back_in():
    fk = lambda q: np.array([q[0], 0.0, 0.5])  # noqa: E731
    layer = ready(SafetyLayer(limits(workspace_min=np.array([-0.5, -0.5, 0.0]), workspace_max=np.array([0.5, 0.5, 1.0])), ee_position=fk), q=(0.8, 0.0, 0.0))
    assert layer.filter(np.array([0.75, 0.0, 0.0]), 0.0).status is SafetyStatus.OK  # closer: allowed
    assert layer.filter(np.array([0.8, 0.0, 0.0]), 0.05).status is SafetyStatus.HOLD_WORKSPACE  # farther: held


def test_stale_state_holds_and_says_how_old():
    layer = ready(SafetyLayer(limits()))
    assert layer.filter(np.array([0.05, 0.0, 0.02]), 0.1).status is SafetyStatus.OK  # exactly at the timeout: fresh
    d = layer.filter(np.array([0.1, 0.0, 0.02]), 0.15)
    assert d.status is SafetyStatus.HOLD_STALE_STATE and "150 ms old (limit 100 ms)" in d.reason
    np.testing.assert_allclose(d.command, [0.05, 0.0, 0.02])
    layer.observe_state(np.array([0.05, 0.0, 0.02]), 0.2)
    assert layer.filter(np.array([0.1, 0.0, 0.02]), 0.2).status is SafetyStatus.OK


def test_stale_or_missing_camera_frames_hold():
    layer = SafetyLayer(limits(), cameras=("agentview", "wrist"))
    layer.observe_state(np.zeros(3), 0.0)
    layer.observe_image("agentview", 0.0)
    d = layer.filter(np.zeros(3), 0.0)
    assert d.status is SafetyStatus.HOLD_STALE_IMAGE and "no frame from camera 'wrist'" in d.reason
    layer.observe_image("wrist", 0.0)
    layer.observe_state(np.zeros(3), 0.12)
    layer.observe_image("agentview", 0.12)
    d = layer.filter(np.zeros(3), 0.12)
    assert d.status is SafetyStatus.HOLD_STALE_IMAGE and "'wrist' frame is 120 ms old" in d.reason


def test_estop_latches_until_reset():
    layer = ready(SafetyLayer(limits()))
    layer.filter(np.array([0.05, 0.0, 0.02]), 0.0)
    layer.estop(True)
    layer.estop(False)  # releasing the button does not release the stop
    for i in range(1, 4):
        layer.observe_state(np.zeros(3), 0.05 * i)
        d = layer.filter(np.array([0.1, 0.0, 0.02]), 0.05 * i)
        assert d.status is SafetyStatus.HOLD_ESTOP
        np.testing.assert_allclose(d.command, [0.05, 0.0, 0.02])
    assert layer.counters["estop_engaged"] == 1 and layer.counters["hold_estop"] == 3
    layer.reset_estop()
    assert layer.filter(np.array([0.1, 0.0, 0.02]), 0.2).status is SafetyStatus.OK


def test_bounded_command_rate():
    layer = ready(SafetyLayer(limits(max_rate_hz=40.0, state_timeout_s=1.0)))
    assert layer.filter(np.zeros(3), 0.0).command is not None
    d = layer.filter(np.zeros(3), 0.01)  # 10 ms < 25 ms
    assert d.status is SafetyStatus.BLOCKED_RATE and d.command is None
    assert layer.filter(np.zeros(3), 0.025).command is not None  # exactly 1/40 s later
    published = sum(layer.filter(np.zeros(3), 0.025 + 0.005 * k).command is not None for k in range(1, 201))
    assert published == 40  # one second at 200 Hz requests -> 40 commands


def test_limits_from_the_shipped_robot_config():
    robot = load_robot_config("sim_panda")
    lim = SafetyLimits.from_robot(robot)
    assert lim.lower.shape == (9,) and lim.upper[3] == pytest.approx(-0.0698) and lim.max_step[7] == pytest.approx(0.04)
    assert lim.image_timeout_s == pytest.approx(0.09) and lim.max_rate_hz == 40.0
    with pytest.raises(ValueError, match="lower < upper"):
        SafetyLimits(lower=np.zeros(2), upper=np.zeros(2), max_step=np.ones(2))


def test_a_copy_of_the_shipped_robot_file_finds_the_shipped_mjcf(tmp_path):
    """The shipped file's header says to copy it; its relative `kinematics.mjcf` then resolved next to the copy only."""
    import shutil

    from robot.paths import assets_dir

    copy = tmp_path / "my_arm.yaml"
    shutil.copy(assets_dir() / "robots" / "sim_panda.yaml", copy)
    assert load_robot_config(copy).mjcf_path() == assets_dir() / "robots" / "sim_panda.xml"
    (tmp_path / "sim_panda.xml").write_text((assets_dir() / "robots" / "sim_panda.xml").read_text())
    assert load_robot_config(copy).mjcf_path() == tmp_path / "sim_panda.xml"  # the user's own, next to the YAML, wins
    copy.write_text(copy.read_text().replace("mjcf: sim_panda.xml", "mjcf: nowhere.xml"))
    with pytest.raises(FileNotFoundError, match="kinematics.mjcf nowhere.xml is in none of"):
        load_robot_config(copy).mjcf_path()
    with pytest.raises(FileNotFoundError, match="is a folder, not a YAML file"):
        load_robot_config(tmp_path)
    copy.write_text("joints: [\n")
    with pytest.raises(ValueError, match="my_arm.yaml is not valid YAML"):
        load_robot_config(copy)


# ----- nothing outside the joint limits is ever published (the reviewer's cases, limits [0, 1]) -----------------------
def unit_limits() -> SafetyLimits:
    return SafetyLimits(lower=np.zeros(2), upper=np.ones(2), max_step=np.full(2, 0.1), state_timeout_s=1.0,
                        image_timeout_s=1.0, max_rate_hz=1000.0)


@pytest.mark.parametrize("command, status", [(None, SafetyStatus.HOLD_NO_COMMAND),
                                             (np.array([np.nan, 0.5]), SafetyStatus.HOLD_NONFINITE)])
def test_a_hold_before_the_first_command_clips_a_measured_state_outside_the_limits(command, status):
    layer = ready(SafetyLayer(unit_limits()), q=(-0.01, 1.02))
    d = layer.filter(command, 0.0)
    assert d.status is status
    np.testing.assert_allclose(d.command, [0.0, 1.0])  # the measured [-0.01, 1.02] itself is never published


def test_the_step_bound_from_a_reference_outside_the_limits_still_publishes_inside_them():
    layer = ready(SafetyLayer(unit_limits()), q=(-0.5, 0.5))
    d = layer.filter(np.array([0.5, 0.5]), 0.0)
    assert d.status is SafetyStatus.CLIPPED
    np.testing.assert_allclose(d.command, [0.0, 0.5])  # not -0.4: the limits are the last word
    assert (d.command >= 0).all() and (d.command <= 1).all()


def test_random_states_and_commands_never_publish_outside_the_limits():
    rng = np.random.default_rng(0)
    layer = SafetyLayer(unit_limits())
    for k in range(500):
        now = k * 0.01
        if k % 7 == 0:
            layer.forget_command()
        layer.observe_state(rng.uniform(-0.5, 1.5, 2), now)
        command = None if k % 5 == 0 else rng.uniform(-2, 3, 2)
        if k % 11 == 0 and command is not None:
            command[0] = np.nan
        d = layer.filter(command, now)
        if d.command is not None:
            assert (d.command >= 0).all() and (d.command <= 1).all(), (k, d)


def test_preview_applies_the_limit_and_step_rules_without_changing_state():
    layer = ready(SafetyLayer(unit_limits()), q=(0.5, 0.5))
    np.testing.assert_allclose(layer.preview(np.array([-0.3, 0.5]), np.array([0.9, 2.0])), [0.0, 0.6])
    assert layer.preview(np.array([0.5, 0.5]), np.array([np.inf, 0.5])) is None
    assert layer.preview(np.array([0.5, 0.5]), np.array([0.5])) is None
    assert layer.last_command is None and sum(layer.counters.values()) == 0
