"""Success-probability model: TD convergence on a chain MDP, dense chunk rewards, calibration metrics."""

import numpy as np
import pytest
import torch

from diffusion_rl import batching
from diffusion_rl import success_model as sm
from diffusion_rl.data import Episode

torch.set_num_threads(1)

Q = [0.9, 0.7, 0.8, 0.6, 0.9]  # chance to advance from state i; otherwise the episode fails there
GOAL = len(Q)
TRUE_P = [float(np.prod(Q[i:])) for i in range(GOAL)] + [1.0]


def chain_episodes(n: int, rng: np.random.Generator) -> list[Episode]:
    """Mixed-quality rollouts: random start, advance with prob Q[i], else fail; the goal frame ends in success."""
    eps = []
    for _ in range(n):
        s = int(rng.integers(0, GOAL))
        states = [s]
        while s < GOAL and rng.random() < Q[s]:
            s += 1
            states.append(s)
        states = np.array(states)
        success = np.zeros(len(states), bool)
        success[-1] = s == GOAL
        eps.append(
            Episode(
                observations={"observation.state": np.eye(GOAL + 1, dtype=np.float32)[states]},
                action=np.zeros((len(states), 1), np.float32),
                task="reach the goal",
                success=success,
                seed=int(rng.integers(0, 1000)),
            )
        )
    return eps


def test_td_success_model_converges_to_true_success_probabilities_on_a_chain():
    rng = np.random.default_rng(0)
    batch = batching.collate_episodes(chain_episodes(3000, rng))
    # Windows of one frame; x⁺ is the next frame (the one-frame-longer window). Train on labelled policy steps.
    x = batch.flatten(batch.state)
    x_next = batch.flatten(batching.shift_next(batch.state))
    data = {
        "x": x,
        "x_next": x_next,
        "outcome": batch.flatten(batch.outcome),
        "terminal": batch.flatten(batch.outcome_terminal),
        "has_next": batch.flatten(batch.credit.bootstrap_ok),
        "mask": batch.flatten(batch.credit.outcome_labelled),
    }
    torch.manual_seed(0)
    head = sm.SuccessHead(GOAL + 1, num_layers=0)
    target = sm.make_target(head)
    opt = torch.optim.Adam(head.parameters(), lr=0.03)
    g = torch.Generator().manual_seed(1)
    m = x.shape[0]

    def batches(k):
        for _ in range(k):
            idx = torch.randint(0, m, (512,), generator=g)
            yield {key: v[idx] for key, v in data.items()}

    # Defaults: τ = 0.1 every 16 steps (the authors' target network).
    step, hist = sm.refit_success_model(head, target, opt, batches(3000))
    assert step == 3000 and np.isfinite(hist[-1]["loss"])
    with torch.no_grad():
        p = torch.sigmoid(head(torch.eye(GOAL + 1)))
    err = (p - torch.tensor(TRUE_P)).abs()
    assert float(err.max()) < 0.05, f"p={p.tolist()} true={TRUE_P}"
    # The estimate is calibrated on the data it was fit to, and ranks states by progress.
    with torch.no_grad():
        p_steps = torch.sigmoid(head(x))
    y = data["outcome"].float()
    assert float(sm.brier_score(p_steps, y)) < float(sm.brier_score(torch.full_like(y, float(y.mean())), y))
    assert float(sm.expected_calibration_error(p_steps, y)) < 0.05
    prog = x.argmax(-1).float()
    assert float(sm.spearman_rank_correlation(p_steps, prog)) > 0.9


def test_monte_carlo_targets_reach_the_far_states_that_a_short_td_round_has_not():
    """Same chain, a 150-step round: with TD the value of the start (5 frames from the goal) is still near the
    initial guess (9 target updates); Monte-Carlo targets (each step's own outcome) are already calibrated there."""
    rng = np.random.default_rng(0)
    batch = batching.collate_episodes(chain_episodes(3000, rng))
    data = {
        "x": batch.flatten(batch.state), "x_next": batch.flatten(batching.shift_next(batch.state)),
        "outcome": batch.flatten(batch.outcome), "terminal": batch.flatten(batch.outcome_terminal),
        "has_next": batch.flatten(batch.credit.bootstrap_ok), "mask": batch.flatten(batch.credit.outcome_labelled),
    }  # fmt: skip
    m = data["x"].shape[0]

    def fit(target: str) -> torch.Tensor:
        torch.manual_seed(0)
        head = sm.SuccessHead(GOAL + 1, num_layers=0)
        opt = torch.optim.Adam(head.parameters(), lr=0.03)
        g = torch.Generator().manual_seed(1)
        batches = ({k: v[idx] for k, v in data.items()} for idx in (torch.randint(0, m, (512,), generator=g) for _ in range(150)))
        sm.refit_success_model(head, sm.make_target(head), opt, batches, target=target)
        with torch.no_grad():
            return torch.sigmoid(head(torch.eye(GOAL + 1)))[:GOAL]

    true = torch.tensor(TRUE_P[:GOAL])
    mc, td = fit("mc"), fit("td")
    assert float((mc - true).abs().max()) < 0.05, f"mc={mc.tolist()} true={TRUE_P}"
    assert float((td - true).abs().max()) > 0.15, f"td={td.tolist()} true={TRUE_P}"
    with pytest.raises(ValueError, match="target must be 'td' or 'mc'"):
        sm.success_model_update(sm.SuccessHead(2, num_layers=0), sm.SuccessHead(2, num_layers=0),
                                torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
                                {"x": torch.zeros(1, 2), "x_next": torch.zeros(1, 2), "outcome": torch.ones(1),
                                 "terminal": torch.ones(1, dtype=torch.bool)}, step=0, target="gae")


def test_target_network_soft_update_rule():
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    t = sm.make_target(a)
    assert not any(p.requires_grad for p in t.parameters())
    before = t.weight.clone()
    sm.soft_update_(t, b, tau=0.1)
    torch.testing.assert_close(t.weight, 0.9 * before + 0.1 * b.weight.detach())
    with pytest.raises(ValueError, match="tau"):
        sm.soft_update_(t, b, tau=0.0)


def test_td_targets_terminal_outcome_soft_failure_and_bootstrap():
    p_next = torch.tensor([0.7, 0.7, 0.7, 0.7])
    y, m = sm.success_td_targets(
        p_next,
        outcome=torch.tensor([1, 0, 0, 1]),
        terminal=torch.tensor([True, True, False, False]),
        has_next=torch.tensor([False, False, True, False]),
        failure_value=torch.tensor([0.0, 0.3, 0.0, 0.0]),
    )
    torch.testing.assert_close(y[:3], torch.tensor([1.0, 0.3, 0.7]))
    assert m.tolist() == [True, True, True, False]
    assert float(sm.soft_failure_value(torch.tensor(0.5))) == pytest.approx(0.3)


def test_dense_chunk_rewards_authors_form():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95], [0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0, 0, 0, 0]])
    valid = torch.tensor([[True] * 10, [True] * 6 + [False] * 4])
    success = torch.zeros(2, 10, dtype=torch.bool)
    success[0, 5:] = True  # first success at step 5: chunk 1 of length 4 holds it
    r, cv = sm.chunk_rewards(p, valid=valid, success=success, chunk_len=4)
    # Episode 0: chunk 0 ends at p[4] = 0.5 -> −0.5; chunk 1 holds the first success -> 1; chunk 2 after -> 0.
    torch.testing.assert_close(r[0], torch.tensor([-0.5, 1.0, 0.0]))
    # Episode 1 (failure, 6 steps): chunk 0 -> p[4] − 1; chunk 1 is the last -> p[last] − 1; chunk 2 padding.
    torch.testing.assert_close(r[1], torch.tensor([0.1 - 1, 0.1 - 1, 0.0]))
    assert cv.tolist() == [[True] * 3, [True, True, False]]
    r_fail, _ = sm.chunk_rewards(p, valid=valid, success=success, chunk_len=4, failure_terminal_reward=-1.0)
    assert float(r_fail[1, 1]) == -1.0


def test_dense_chunk_rewards_potential_form_telescopes():
    p = torch.tensor([[0.2, 0.3, 0.5, 0.6, 0.9, 0.9]])
    valid = torch.ones(1, 6, dtype=torch.bool)
    success = torch.tensor([[False, False, False, False, False, True]])
    r, _ = sm.chunk_rewards(p, valid=valid, success=success, chunk_len=2, form="potential", gamma=1.0)
    # γ = 1: the shaping telescopes, so the return is outcome − Φ(s_0).
    torch.testing.assert_close(r.sum(), torch.tensor(1.0 - 0.2))
    torch.testing.assert_close(r[0, 0], torch.tensor(0.5 - 0.2))


def test_calibration_metrics_on_known_values():
    p = torch.tensor([0.0, 1.0, 0.5, 0.5])
    y = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert float(sm.brier_score(p, y)) == pytest.approx(0.125)
    assert float(sm.expected_calibration_error(p, y, n_bins=10)) == pytest.approx(0.0)
    assert float(sm.expected_calibration_error(torch.full((4,), 0.9), torch.tensor([1.0, 0, 0, 0]))) == pytest.approx(
        0.65
    )
    x = torch.tensor([1.0, 2.0, 2.0, 3.0])
    assert float(sm.spearman_rank_correlation(x, -x)) == pytest.approx(-1.0)
    p_demo = torch.tensor([[0.1, 0.2, 0.4, 0.8], [0.5, 0.4, 0.3, 0.0]])
    voc = sm.value_order_correlation(p_demo, torch.ones(2, 4, dtype=torch.bool))
    assert float(voc) == pytest.approx(0.0)  # one rising, one falling


def test_success_head_checks_its_inputs():
    head = sm.SuccessHead(4, task_dim=2)
    assert head(torch.zeros(3, 4), torch.zeros(3, 2)).shape == (3,)
    with pytest.raises(ValueError, match="task features"):
        head(torch.zeros(3, 4))
    with pytest.raises(KeyError, match="x_next"):
        sm.success_model_update(
            head, sm.make_target(head), torch.optim.SGD(head.parameters(), 0.1), {"x": torch.zeros(1, 4)}, step=0
        )
