"""The chunk-level Q (Q-chunking), PA-RL's critic-guided choice and DSRL's noise actor, on problems with a known answer:
a chain MDP with chunks (closed-form Q) and the bimodal toy (only one mode succeeds)."""

import itertools

import numpy as np
import pytest
import torch

from diffusion_rl import flow, toy
from diffusion_rl.chunk_q import (
    ChunkQ,
    chunk_backup,
    chunk_q_update,
    chunk_transitions,
    discounted_returns,
    outcome_rewards,
    refine_chunks,
    select_chunks,
)
from diffusion_rl.dsrl import DSRLAgent, TwinQ

torch.set_num_threads(1)

GOAL, H, GAMMA = 9, 3, 0.9


def chain_episode(start: int, move: int, horizon: int = 14) -> tuple[np.ndarray, np.ndarray, int]:
    """Positions visited and actions (±1) of a walk that always moves `move` from `start` on the chain 0..GOAL
    (floored at 0); it succeeds on reaching GOAL, else times out. Returns (positions (T,), actions (T, 1), outcome)."""
    pos, positions, actions = start, [], []
    for _ in range(horizon):
        positions.append(pos)
        actions.append([float(move)])
        pos = max(0, pos + move)
        if pos == GOAL:
            return np.array(positions), np.array(actions, np.float32), 1
    return np.array(positions), np.array(actions, np.float32), 0


def test_chunk_transitions_and_the_backup_are_exact_on_a_chain():
    """h-step SARSA backups over the data's chunks reach the closed form γ^(steps to success − 1), 0 on failure,
    exactly, within ⌈T/h⌉ sweeps."""
    episodes = [chain_episode(s, +1) for s in range(GOAL)] + [chain_episode(s, -1) for s in (2, 5)]
    lengths = [len(p) for p, _, _ in episodes]
    outcomes = [o for _, _, o in episodes]
    tr = chunk_transitions([a for _, a, _ in episodes], outcome_rewards(lengths, outcomes), horizon=H, gamma=GAMMA)
    assert tr["chunk"].shape == (sum(lengths), H, 1)
    # Chunks run past the episode's end padded and masked; the last chunk of each episode is terminal.
    assert not tr["chunk_mask"][lengths[0] - 1, 1:].any() and (tr["chunk"][lengths[0] - 1, 1:] == 0).all()
    assert tr["next_index"][lengths[0] - 1] == -1 and tr["next_index"][0] == (H if lengths[0] > H else -1)
    q = torch.zeros(sum(lengths))
    for _ in range(max(lengths) // H + 1):
        q = chunk_backup(tr["reward"], q[tr["next_index"].clamp_min(0)], tr["next_index"], tr["discount"])
    expected = discounted_returns(lengths, outcomes, GAMMA)
    closed = torch.cat([torch.tensor([GAMMA ** (GOAL - p - 1) * o for p in pos], dtype=torch.float32) for pos, _, o in episodes])
    assert torch.allclose(expected, closed)
    assert torch.allclose(q, closed, atol=1e-6), (q - closed).abs().max()


def test_chunked_q_learning_backup_matches_the_closed_form_optimal_q():
    """Tabular Q* over all 2^h chunks of ±1 moves: after a chunk from s the optimum is γ^(j−1) if the goal is reached at
    its j-th action, else γ^(h + d(s') − 1) with d the distance left; the backup with max over the next chunks hits it."""
    chunks = list(itertools.product((-1, 1), repeat=H))
    outcome = {}
    for s in range(GOAL):
        for c in chunks:
            pos, reward, done = s, 0.0, False
            for j, m in enumerate(c):
                pos = max(0, pos + m)
                if pos == GOAL:
                    reward, done = GAMMA**j, True
                    break
            outcome[s, c] = (reward, pos, done)
    keys = list(outcome)
    reward = torch.tensor([outcome[k][0] for k in keys])
    next_state = [outcome[k][1] for k in keys]
    done_index = torch.tensor([-1 if outcome[k][2] else 0 for k in keys])
    q = torch.zeros(len(keys))
    for _ in range(GOAL + 2):
        table = q.reshape(GOAL, len(chunks))
        v_next = torch.stack([table[s].max() if s < GOAL else torch.tensor(0.0) for s in next_state])
        q = chunk_backup(reward, v_next, done_index, torch.full_like(reward, GAMMA**H))
    closed = torch.tensor([r if d else GAMMA ** (H + GOAL - p - 1) for r, p, d in (outcome[k] for k in keys)])
    assert torch.allclose(q, closed, atol=1e-6)


def test_the_learned_chunk_critic_recovers_the_chain_values():
    """ChunkQ on one-hot positions, trained with the target network: Q(s, right^h) ≈ γ^(GOAL−s−1), Q(s, left^h) ≈ 0."""
    torch.manual_seed(0)
    episodes = [chain_episode(s, +1) for s in range(GOAL)] + [chain_episode(s, -1) for s in range(GOAL)]
    lengths = [len(p) for p, _, _ in episodes]
    tr = chunk_transitions([a for _, a, _ in episodes], outcome_rewards(lengths, [o for _, _, o in episodes]), horizon=H, gamma=GAMMA)
    features = torch.eye(GOAL + 1)[torch.from_numpy(np.concatenate([p for p, _, _ in episodes]))]
    q = ChunkQ(GOAL + 1, H, 1, hidden_dim=64)
    target = ChunkQ(GOAL + 1, H, 1, hidden_dim=64).requires_grad_(False)
    target.load_state_dict(q.state_dict())
    opt = torch.optim.Adam(q.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(700):
        chunk_q_update(q, target, opt, features, tr, torch.randint(0, len(features), (64,), generator=g), tau=0.1)
    with torch.no_grad():
        s = torch.arange(GOAL - H + 1)  # chunks that stay inside the chain (not padded)
        right = q(torch.eye(GOAL + 1)[s], torch.ones(len(s), H, 1))
        left = q(torch.eye(GOAL + 1)[s], -torch.ones(len(s), H, 1))
    assert torch.allclose(right, GAMMA ** (GOAL - s - 1.0), atol=0.05), right
    assert (left < 0.05).all(), left


# -- PA-RL on the bimodal toy ------------------------------------------------------------------------------------------


def toy_critic(seed: int = 0) -> ChunkQ:
    """A chunk critic of the toy's one-step episodes (a 1-action chunk, constant features), fit on its samples."""
    torch.manual_seed(seed)
    q = ChunkQ(1, 1, 1, hidden_dim=64)
    target = ChunkQ(1, 1, 1, hidden_dim=64).requires_grad_(False)
    x = toy.sample_data(2048, generator=torch.Generator().manual_seed(seed))
    tr = chunk_transitions([xi[None].numpy() for xi in x], [r[None].numpy() for r in toy.reward(x)], horizon=1, gamma=0.99)
    opt = torch.optim.Adam(q.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(300):
        chunk_q_update(q, target, opt, torch.zeros(len(x), 1), tr, torch.randint(0, len(x), (256,), generator=g))
    return q


@pytest.fixture(scope="module")
def critic():
    return toy_critic()


def test_selection_picks_the_argmax_of_the_critic(critic):
    g = torch.Generator().manual_seed(1)
    candidates = toy.sample_data(16 * 8, generator=g).reshape(16, 8, 1, 1)
    features = torch.zeros(16, 1)
    chosen, index, values = select_chunks(critic, features, candidates)
    with torch.no_grad():
        direct = torch.stack([critic(torch.zeros(8, 1), candidates[b]) for b in range(16)])
    assert torch.equal(index, direct.argmax(1)) and torch.allclose(values, direct)
    assert torch.equal(chosen, candidates[torch.arange(16), index])
    # The critic knows the toy: wherever a row holds a successful candidate, a successful one is chosen.
    has_good = (candidates[..., 0, 0] > 0).any(1)
    assert (chosen[has_good, 0, 0] > 0).all()
    # Refinement climbs Q and stays in the action range.
    refined = refine_chunks(critic, features, candidates.clamp(-1, 1), steps=5, step_size=0.5)
    with torch.no_grad():
        after = torch.stack([critic(torch.zeros(8, 1), refined[b]) for b in range(16)])
        before = torch.stack([critic(torch.zeros(8, 1), candidates[b].clamp(-1, 1)) for b in range(16)])
    assert (after >= before - 1e-4).all() and after.mean() > before.mean() and refined.abs().max() <= 1


def test_a_selection_margin_keeps_the_first_candidate_unless_another_is_valued_that_much_higher(critic):
    g = torch.Generator().manual_seed(3)
    candidates = toy.sample_data(64 * 8, generator=g).reshape(64, 8, 1, 1)
    _, argmax, values = select_chunks(critic, torch.zeros(64, 1), candidates)
    gap = values.max(1).values - values[:, 0]
    margin = float(gap.median())  # half the rows switch, half keep candidate 0
    chosen, index, _ = select_chunks(critic, torch.zeros(64, 1), candidates, margin=margin)
    switch = gap > margin
    assert 0 < int(switch.sum()) < 64
    assert torch.equal(index[switch], argmax[switch]) and (index[~switch] == 0).all()
    assert torch.equal(chosen, candidates[torch.arange(64), index])
    with pytest.raises(ValueError, match="margin must be >= 0"):
        select_chunks(critic, torch.zeros(64, 1), candidates, margin=-0.1)


def test_pa_rl_distillation_moves_the_toy_policy_to_the_selected_mode(critic):
    """Sample 8 chunks per state from the flow policy, keep the critic's argmax, distil it with the flow loss: the
    high-reward mode's mass goes from ≈ 50 % to over 85 %."""
    torch.manual_seed(0)
    net = toy.make_pretrained(0)
    policy = toy.ToyFlowPolicy(net)
    before = toy.evaluate_mass(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(2)
    for _ in range(40):
        with torch.no_grad():
            samples = flow.euler_sample(net, torch.randn(128 * 8, 1, generator=g), num_steps=10).reshape(128, 8, 1, 1)
        chosen, _, _ = select_chunks(critic, torch.zeros(128, 1), samples)
        for _ in range(4):
            loss = policy.flow_loss({"x0": chosen[:, 0], "generator": g}).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    after = toy.evaluate_mass(net)
    assert 0.4 < before < 0.6 and after > 0.85, (before, after)


# -- DSRL on the bimodal toy ------------------------------------------------------------------------------------------


def test_dsrl_noise_actor_alone_raises_the_frozen_toy_policy_success():
    """The base flow policy is frozen (its weights never change); SAC in its noise space learns to start the sampler
    where it lands on the successful mode."""
    torch.manual_seed(0)
    net = toy.make_pretrained(0).requires_grad_(False)
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    agent = DSRLAgent(1, 1, hidden_dim=64, bound=2.5, lr=1e-3, tau=0.05)
    f = torch.ones(256, 1)

    def success(deterministic: bool = False) -> float:
        with torch.no_grad():
            return toy.high_mode_mass(flow.euler_sample(net, agent.act(f, deterministic=deterministic), num_steps=10))

    before = success()
    for _ in range(60):
        w = agent.act(f)
        with torch.no_grad():
            r = toy.reward(flow.euler_sample(net, w, num_steps=10))
        batch = {"x": f, "noise": w, "reward": r, "x_next": f, "done": torch.ones(256), "discount": torch.full((256,), 0.99)}
        for _ in range(5):
            agent.update(batch)
    after = success()
    assert 0.3 < before < 0.7 and after > 0.9, (before, after)
    assert success(deterministic=True) == 1.0
    assert all(torch.equal(weights[k], v) for k, v in net.state_dict().items())


def test_layer_norm_bounds_the_critics_extrapolation():
    """RLPD's LayerNorm: however far an input lies from the data, each head's output stays within the bound its
    last layer sets (Σ|w| · max SiLU over the normalised range, + |b|); without it, Q grows with the input."""
    torch.manual_seed(0)
    plain, normed = TwinQ(4, 2, hidden_dim=32), TwinQ(4, 2, hidden_dim=32, layer_norm=True)
    x, w = torch.randn(64, 4), torch.randn(64, 2)
    far_plain, far_normed = (torch.stack(q(1000 * x, 1000 * w)).abs().amax(1) for q in (plain, normed))  # per head
    z_max = (32 - 1) ** 0.5  # the largest |entry| of a LayerNorm output of width 32 (affine at its init: 1, 0)
    for head, far in zip((normed.q1, normed.q2), far_normed):
        bound = head[-1].weight.abs().sum() * torch.nn.functional.silu(torch.tensor(z_max)) + head[-1].bias.abs()
        assert far <= bound.item() + 1e-5, (far, bound)
    assert far_plain.min() > 100 * far_normed.max(), (far_plain, far_normed)
