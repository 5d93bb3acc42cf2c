"""Robot in the loop over real DDS on loopback: `kinema sim-robot --person` (the sim arm, and a simulated person who
sees the scene only through the privileged-state topic and acts only through the takeover and Joy topics) against
`kinema deploy` and `kinema train --robot`, each in its own process (tests/robot_processes.py)."""

import json
import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("cyclonedds")

from diffusion_rl.data import ExecutedBy, LeRobotDatasetReader, Segment  # noqa: E402
from robot_processes import procs  # noqa: E402,F401 (the fixture)


def _person(procs, sim) -> dict:
    os.kill(sim.pid, signal.SIGTERM)
    assert procs.wait(sim, 30) == 0, procs.logs()
    stopped = procs.records("sim")[-1]
    assert stopped["event"] == "stopped", procs.logs()
    return stopped["person"]


def test_the_simulated_person_takes_over_an_arm_that_does_nothing_and_finishes_the_task(procs, tmp_path):
    sim = procs.start("sim", "sim-robot", "--task", "drawer", "--backend", "dds", "--person")
    deploy = procs.start("deploy", "deploy", "--policy", "scripted:zero", "--backend", "dds", "--episodes", "1",
                         "--duration", "40", "--record", str(tmp_path / "rec"))  # fmt: skip
    assert procs.wait(deploy, 120) == 0, procs.logs()
    episode = next(r for r in procs.records("deploy") if r["event"] == "episode")
    person = _person(procs, sim)
    # The arm holds still, progress stalls, the person takes over; its last allowed takeover finishes the task.
    assert episode["success"] is True and episode["taken_over"] is True, (episode, person)
    assert person["takeovers"] >= 1 and person["handbacks"] == person["takeovers"] and person["commands"] > 10, person
    (recorded,) = list(LeRobotDatasetReader(tmp_path / "rec" / "dataset"))
    human = recorded.executed_by == ExecutedBy.HUMAN
    assert recorded.outcome and human.any() and (~human).any()
    assert (recorded.segment[human] == Segment.HUMAN).all()
    first = int(np.argmax(human))  # the policy's steps just before the first takeover led there
    assert (recorded.segment[max(0, first - 8) : first] == Segment.FAILURE_INDUCING).all()


@pytest.mark.slow  # two rounds of episodes on a real-time robot, a kill and a resume: about a minute and a half
def test_rounds_on_the_robot_survive_a_kill_swap_each_rounds_checkpoint_and_keep_every_episode_once(procs, tmp_path):
    from policies.checkpoint import checkpoint_fingerprint

    run = tmp_path / "run"
    sim = procs.start("sim", "sim-robot", "--task", "drawer", "--backend", "dds", "--person")
    train = procs.start(
        "train", "train", "--robot", "sim_panda", "--robot.backend", "dds", "--robot.episode_seconds", "6",
        "--robot.sim_eval", "false", "--rl.method", "habc", "--rl.interventions", "true", "--rl.rounds", "2",
        "--rl.episodes_per_round", "2", "--rl.updates_per_round", "5", "--demos.episodes", "4", "--sft.steps", "20",
        "--workers", "0", "--num_envs", "2", "--out", str(run),
    )  # fmt: skip
    info = run / "robot" / "dataset" / "meta" / "info.json"
    deadline = time.monotonic() + 240
    while not (info.exists() and json.loads(info.read_text())["total_episodes"] >= 1):
        assert train.poll() is None and time.monotonic() < deadline, procs.logs()
        time.sleep(0.2)
    time.sleep(1.0)  # into the next episode
    os.kill(train.pid, signal.SIGKILL)  # no cleanup at all
    train.wait(10)
    resumed = procs.start("resumed", "train", "--resume", str(run))
    assert procs.wait(resumed, 300) == 0, procs.logs()
    person = _person(procs, sim)

    rows = LeRobotDatasetReader(run / "robot" / "dataset").meta.episodes
    complete = {v: [i for i, r in enumerate(rows) if r["policy_version"] == v and r["complete"]] for v in ("round-1", "round-2")}
    assert [len(complete["round-1"]), len(complete["round-2"])] == [2, 2], rows
    cut = [r for r in rows if not r["complete"]]  # the episode the kill cut short, kept and marked, never trained on
    assert len(cut) <= 1 and all(r["policy_version"] == "round-1" for r in cut), rows
    # The round trained on exactly its finished episodes, each once.
    robot = LeRobotDatasetReader(run / "robot" / "dataset")
    trained = list(LeRobotDatasetReader(run / "rollouts" / "round-001"))
    assert len(trained) == 2
    for i, ep in zip(complete["round-1"], trained):
        np.testing.assert_array_equal(robot[i].action, ep.action)
    # Round 1 acted with the SFT checkpoint, round 2 with the checkpoint round 1 wrote, swapped into the running node.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    acted = {r["round"]: r["robot/policy"] for r in records if r.get("kind") == "round"}
    assert acted == {1: checkpoint_fingerprint(run / "checkpoints" / "sft"), 2: checkpoint_fingerprint(run / "checkpoints" / "round-001")}
    assert acted[1] != acted[2]
    taken = {r["round"]: r["robot/episodes_taken_over"] for r in records if r.get("kind") == "round"}
    assert taken == {n: sum(bool((robot[i].executed_by == ExecutedBy.HUMAN).any()) for i in complete[f"round-{n}"]) for n in (1, 2)}
    # How the node computed the chunks (robot.inference auto): recorded per round, with the inference time it measured.
    rounds = [r for r in records if r.get("kind") == "round"]
    assert all(0 <= r["robot/sync_chunk_share"] <= 1 and r["robot/inference_ms"] > 0 for r in rounds), rounds
    assert person["takeovers"] >= 1 and any((robot[i].executed_by == ExecutedBy.HUMAN).any() for i in complete["round-1"] + complete["round-2"])
    assert (run / "checkpoints" / "final" / "model.safetensors").exists()
    assert "on the robot `sim_panda`" in (run / "report.md").read_text()


def test_an_estop_mid_episode_ends_it_as_a_recorded_failure_and_holds_until_released(tmp_path):
    import threading

    from robot import messages as msg
    from robot.config import load_robot_config
    from robot.policy_node import ConstantPolicy
    from robot.session import RobotSession
    from robot.sim_robot import SimRobotNode
    from robot.transport.inproc import InprocBus, InprocTransport

    robot, bus = load_robot_config("sim_panda"), InprocBus()
    sim = SimRobotNode(InprocTransport(bus), robot, "drawer").start()
    estop = InprocTransport(bus).publisher(robot.topics.estop, msg.Bool)
    try:
        with RobotSession(InprocTransport(bus), robot, ConstantPolicy(np.zeros(7)), record=str(tmp_path / "rec")) as session:
            session.wait_ready(10)
            press = threading.Timer(1.0, lambda: estop.publish(msg.Bool(data=True)))
            press.start()
            result = session.run_episode(duration=30, reset=False)
            press.join()
            assert result["estopped"] is True and result["success"] is False and result["seconds"] < 10, result
            estop.publish(msg.Bool(data=False))  # a message does not release it: a person does
            assert session.node.estopped
            session.node.release_estop()
            assert not session.node.estopped
            session.recorder.flush(30)
        (episode,) = list(LeRobotDatasetReader(tmp_path / "rec" / "dataset"))
        assert episode.complete and not episode.outcome and len(episode) > 5
    finally:
        sim.close()
