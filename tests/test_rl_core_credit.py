"""Episode batching and intervention-aware credit, on constructed Episodes with exact expected masks."""

import math

import numpy as np
import pytest
import torch

from diffusion_rl import batching, credit, habc
from diffusion_rl.credit import SampleKind
from diffusion_rl.data import Episode, ExecutedBy, Segment

torch.set_num_threads(1)

P, H = ExecutedBy.POLICY, ExecutedBy.HUMAN


def make_episode(controllers: str, outcome: bool, *, seed: int = 0, task_id: str = "pick", version: str = "round-1"):
    """controllers: one char per step, 'p' policy or 'h' human. Success (if any) at the last step."""
    t = len(controllers)
    ex = np.array([P if c == "p" else H for c in controllers], np.int8)
    success = np.zeros(t, bool)
    success[-1] = outcome
    return Episode(
        observations={"observation.state": np.arange(t, dtype=np.float32)[:, None].repeat(2, 1)},
        action=np.ones((t, 3), np.float32),
        task="pick the cube",
        executed_by=ex,
        success=success,
        outcome=outcome,
        task_id=task_id,
        seed=seed,
        policy_version=version,
    )


def mask(bits: str, t_max: int) -> torch.Tensor:
    return torch.tensor([c == "1" for c in bits.ljust(t_max, "0")])


EPISODES = [
    ("pppphhhppp", True),  # one takeover: only the last 3 policy steps take the outcome
    ("ppphhpphh", True),  # ends under human control: no policy step takes the outcome
    ("pppppp", False),  # autonomous failure: every step labelled (and weight 0)
    ("pphhpphppp", False),  # two takeovers, failure: only the suffix after the last one
    ("pppp", True),  # autonomous success
]


@pytest.fixture(scope="module")
def batch():
    eps = [make_episode(c, o, seed=i % 2) for i, (c, o) in enumerate(EPISODES)]
    eps.append(make_episode("hhhh", True, version="expert"))  # a demonstration
    return batching.collate_episodes(eps)


def test_padding_shapes_and_per_episode_facts(batch):
    assert batch.state.shape == (6, 10, 2) and batch.action.shape == (6, 10, 3)
    assert batch.length.tolist() == [10, 9, 6, 10, 4, 4]
    assert batch.outcome.tolist() == [True, True, False, False, True, True]
    assert batch.steps_to_success.tolist() == [10, 9, -1, -1, 4, 4]
    assert batch.is_demo.tolist() == [False] * 5 + [True]
    # Groups: same task_id and seed.
    assert batch.group_id.tolist() == [0, 1, 0, 1, 0, 0]  # the demo has seed 0
    assert batch.steps_to_go[0].tolist() == list(range(10, 0, -1))
    assert batch.steps_to_go[2].tolist() == [-1] * 10
    assert batch.steps_to_go[4, :5].tolist() == [4, 3, 2, 1, -1]
    assert batch.segment_id[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert batch.segment_id[4].tolist() == [0] * 4 + [-1] * 6
    ep, t = batch.flat_index()
    assert ep.numel() == int(batch.valid.sum()) == 43
    assert batch.flatten(batch.action).shape == (43, 3) and batch.flatten(batch.outcome).shape == (43,)


def test_terminated_and_truncated_are_kept_apart(batch):
    assert torch.equal(batch.terminated[0], mask("0000000001", 10))
    assert not bool(batch.truncated[0].any())
    assert torch.equal(batch.truncated[2], mask("000001", 10))
    assert not bool(batch.terminated[2].any())
    assert torch.equal(batch.outcome_terminal[2], mask("000001", 10))


def test_only_the_suffix_after_the_last_takeover_carries_the_outcome(batch):
    c = batch.credit
    t = 10
    assert torch.equal(c.outcome_labelled[0], mask("0000000111", t))
    assert torch.equal(c.outcome_labelled[1], mask("", t))  # ends in a human segment: no policy label at all
    assert torch.equal(c.outcome_labelled[2], mask("111111", t))
    assert torch.equal(c.outcome_labelled[3], mask("0000000111", t))
    assert torch.equal(c.outcome_labelled[4], mask("1111", t))
    assert torch.equal(c.outcome_labelled[5], mask("", t))  # demonstrations are not policy data


def test_earlier_policy_segments_are_unlabelled_and_get_zero_actor_weight(batch):
    c = batch.credit
    t = 10
    assert torch.equal(c.unlabelled_policy[0], mask("1111", t))
    assert torch.equal(c.unlabelled_policy[1], mask("111001100", t))
    assert torch.equal(c.unlabelled_policy[3], mask("1100110", t))
    assert torch.equal(c.human[0], mask("0000111", t))
    assert torch.equal(c.demo[5], mask("1111", t))
    kind = c.kind
    assert kind[0].tolist() == [2, 2, 2, 2, 3, 3, 3, 1, 1, 1]
    assert kind[4].tolist() == [1, 1, 1, 1] + [-1] * 6
    w = habc.habc_actor_weights(
        torch.full((6, 10), 1.5), kind=kind, outcome=batch.outcome[:, None].expand(6, 10), normalize=False
    )
    assert bool((w[c.unlabelled_policy] == 0).all())  # the actor does not imitate them
    assert bool((w[c.human] == 1).all()) and bool((w[c.demo] == 1).all())
    assert torch.equal(w[2], torch.zeros(10))  # failed autonomous episode
    assert torch.equal(w[3, 7:], torch.zeros(3))  # failed suffix
    assert torch.equal(w[0, 7:], torch.full((3,), 1.5))  # successful suffix: g


def test_nothing_is_derived_across_a_takeover_boundary(batch):
    c = batch.credit
    t = 10
    # The policy step right before each takeover does not bootstrap from the human state after it.
    assert torch.equal(c.takeover[0], mask("00001", t))
    assert torch.equal(c.takeover[3], mask("0010001", t))
    assert not bool(c.bootstrap_ok[0, 3]) and not bool(c.bootstrap_ok[3, 1]) and not bool(c.bootstrap_ok[3, 5])
    assert bool(c.bootstrap_ok[0, 6])  # handback human -> policy: the steps-to-go chain continues
    # Functional check: garbage (NaN) in the value of every state right after a takeover, and in every
    # unlabelled policy step's critic output, cannot reach the critic loss or the labelled steps' weights.
    g = torch.Generator().manual_seed(0)
    z_v, v_e = torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g)
    z_v[c.unlabelled_policy] = float("nan")
    v_e_next = batching.shift_next(v_e)
    v_e_next[~c.bootstrap_ok & batch.valid] = float("nan")
    outcome = batch.outcome[:, None].expand(6, 10)
    loss, parts = habc.habc_critic_loss(
        z_v,
        v_e,
        v_e_next,
        outcome=outcome,
        viability_mask=c.outcome_labelled,
        efficiency_mask=c.efficiency,
        terminal_success=batch.first_success,
        bootstrap_ok=c.bootstrap_ok,
    )
    assert torch.isfinite(loss)
    # Human steps train the efficiency head in successful episodes, never the viability head.
    assert torch.equal(c.efficiency[0], mask("0000111111", t))
    assert torch.equal(c.efficiency[1], mask("000110011", t))
    assert not bool((c.outcome_labelled & c.human).any())


def test_naive_credit_ablation_labels_every_policy_step(batch):
    c = credit.intervention_credit(batch.executed_by, batch.valid, batch.outcome, enabled=False)
    assert torch.equal(c.outcome_labelled[0], mask("1111000111", 10))
    assert not bool(c.unlabelled_policy.any())


def test_cut_at_handback_option():
    c = credit.intervention_credit(
        torch.tensor([[P, H, H, P, P]]),
        torch.ones(1, 5, dtype=torch.bool),
        torch.tensor([True]),
        cut_at_handback=True,
    )
    assert c.bootstrap_ok[0].tolist() == [False, True, False, True, False]


def test_frame_windows_are_causal_and_zero_padded():
    x = torch.arange(1, 7, dtype=torch.float32).reshape(1, 6, 1)
    valid = torch.ones(1, 6, dtype=torch.bool)
    w, m = batching.frame_windows(x, valid, length=3, stride=2)
    assert w.shape == (1, 6, 3, 1)
    assert w[0, 5, :, 0].tolist() == [2.0, 4.0, 6.0]
    assert w[0, 1, :, 0].tolist() == [0.0, 0.0, 2.0] and m[0, 1].tolist() == [False, False, True]


def test_help_segment_labels_from_progress():
    prog = torch.tensor([[0.0, 0.1, 0.2, 0.2, 0.2, 0.1, 0.0, 0.1, 0.2, 0.3, 0.4]])
    valid = torch.ones_like(prog, dtype=torch.bool)
    fs = torch.zeros_like(valid)
    fs[0, -1] = True
    lab = credit.segment_labels_from_progress(prog, valid, first_success=fs)
    S = Segment
    expect = [
        S.PROGRESS,
        S.PROGRESS,
        S.IDLE,
        S.IDLE,
        S.FAILURE_INDUCING,
        S.FAILURE_INDUCING,
        S.RECOVERY,
        S.RECOVERY,
        S.PROGRESS,
        S.PROGRESS,
        S.PROGRESS,
    ]
    assert lab[0].tolist() == [int(s) for s in expect]
    w = credit.segment_imitation_weights(lab)
    assert w[0].tolist() == [1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    neg = credit.segment_imitation_weights(lab, variant="negative", negative_weight=-0.5)
    assert neg[0, 4] == -0.5 and neg[0, 2] == 0
    ex = torch.zeros_like(prog, dtype=torch.long)
    ex[0, 3] = H
    assert credit.segment_labels_from_progress(prog, valid, executed_by=ex)[0, 3] == S.HUMAN


def test_idle_and_failure_inducing_steps_get_zero_habc_weight():
    seg = torch.tensor([[S for S in (0, 1, 2, 3, 0)]])
    sw = credit.segment_imitation_weights(seg)
    kind = torch.full((1, 5), int(SampleKind.AUTONOMOUS))
    w = habc.habc_actor_weights(
        torch.full((1, 5), 1.2), kind=kind, outcome=torch.ones(1, 5, dtype=torch.bool), segment_weight=sw
    )
    assert w[0, 1] == 0 and w[0, 2] == 0
    torch.testing.assert_close(w[0, [0, 3, 4]], torch.ones(3))  # the kept ones average 1


def test_collate_errors_are_clear():
    with pytest.raises(ValueError, match="at least one"):
        batching.collate_episodes([])
    a = make_episode("pp", True)
    b = Episode(observations={"observation.state": np.zeros((2, 5), np.float32)}, action=np.zeros((2, 3)), task="x")
    with pytest.raises(ValueError, match="observation.state"):
        batching.collate_episodes([a, b])


def test_habc_step_honours_the_intervention_credit_switch(batch):
    torch.manual_seed(0)
    critic = habc.HABCCritic(4, hidden_dim=16)
    feats = torch.randn(*batch.valid.shape, 4)
    on = habc.habc_step(critic, feats, batch, step=1000)
    off = habc.habc_step(critic, feats, batch, step=1000, config=habc.HABCConfig(intervention_credit=False))
    assert torch.isfinite(on.critic_loss) and torch.isfinite(off.critic_loss)
    # Episode 0 succeeded after a takeover: its first policy segment is imitated only under naive credit.
    assert torch.equal(on.weights[0, :4], torch.zeros(4))
    assert bool((off.weights[0, :4] > 0).all())
    assert bool((on.weights[~batch.valid] == 0).all())
    kept = (on.weights > 0) & ~on.credit.demo
    torch.testing.assert_close(on.weights[kept].mean(), torch.tensor(1.0))
    on.critic_loss.backward()
    assert critic.viability.weight.grad is not None


def test_return_weights_are_exp_of_minus_the_extra_steps_over_temperature_with_mean_one():
    w = credit.return_weights(torch.tensor([20, 10, 30]), temperature=10.0)
    expected = torch.tensor([math.exp(-1), 1.0, math.exp(-2)])
    torch.testing.assert_close(w, (expected / expected.mean()).float())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        credit.return_weights(torch.tensor([10]), temperature=0.0)
    with pytest.raises(ValueError, match="steps_to_success must be > 0"):
        credit.return_weights(torch.tensor([10, 0]), temperature=1.0)


def test_idle_steps_are_those_after_which_the_arm_neither_moved_turned_nor_changed_its_grip():
    # moves, pauses two steps, closes the gripper in place, moves, pauses, turns the wrist 0.1 rad in place (written
    # as -q: the same rotation's other sign must not count as a turn), stays; the last step is never idle
    position = torch.tensor([[0.0, 0, 0], [0.01, 0, 0], [0.011, 0, 0], [0.011, 0.001, 0], [0.011, 0.001, 0],
                             [0.02, 0.001, 0], [0.02, 0.001, 0], [0.02, 0.001, 0], [0.02, 0.001, 0]])  # fmt: skip
    opening = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5])
    still = torch.tensor([1.0, 0.0, 0.0, 0.0])
    turned = torch.tensor([math.cos(0.05), 0.0, 0.0, math.sin(0.05)])  # 0.1 rad about z
    quaternion = torch.stack([still] * 7 + [-turned, -turned])
    idle = credit.idle_steps(position, quaternion, opening, motion=0.002, turn=0.02, grip=0.02)
    assert idle.tolist() == [False, True, True, False, False, True, False, True, False]
    assert credit.idle_steps(position, quaternion, opening, turn=0.2)[6]  # a 0.1 rad turn under a 0.2 threshold
    assert not credit.idle_steps(position, quaternion, opening, motion=0.0, turn=0.0, grip=0.0).any()  # strict
    with pytest.raises(ValueError, match="opening"):
        credit.idle_steps(position, quaternion, opening[:-1])


def test_return_weighted_demos_move_a_flow_onto_the_faster_demonstrators_mode():
    """The bimodal toy as demonstrations of uneven speed: episodes at x = +2 take 10 steps to success, those at
    x = −2 take 30. Drawn per step uniformly, the slow mode has 3/4 of the draws and the flow learns it; drawn
    return-weighted (τ = 5 steps), the fast one holds ~95 % of them and the flow's mass moves there."""
    from diffusion_rl import flow, toy

    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([10, 30] * 20)  # 40 episodes, alternating fast (+2) and slow (−2)
    centre = torch.where(lengths == 10, 2.0, -2.0)
    step_episode = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    step_x = centre[step_episode, None] + toy.MODE_STD * torch.randn(len(step_episode), 1, generator=gen)

    def mass_after_imitating(step_weights: torch.Tensor) -> float:
        torch.manual_seed(0)
        net = toy.ToyVelocityNet()
        opt = torch.optim.Adam(net.parameters(), lr=3e-3)
        for _ in range(600):
            x0 = step_x[torch.multinomial(step_weights, 256, replacement=True, generator=gen)]
            noise = torch.randn(x0.shape, generator=gen)
            t = flow.sample_time(256, generator=gen)
            loss = flow.flow_matching_loss(net(flow.interpolate(x0, noise, t), t), flow.velocity_target(x0, noise))
            opt.zero_grad()
            loss.mean().backward()
            opt.step()
        return toy.evaluate_mass(net)

    uniform = mass_after_imitating(torch.ones(len(step_episode)))
    weighted = mass_after_imitating(credit.return_weights(lengths, temperature=5.0)[step_episode])
    assert uniform == pytest.approx(0.25, abs=0.08)
    assert weighted > 0.9
