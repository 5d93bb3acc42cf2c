"""Group-relative advantages, VideoAWR energies and GAE."""

import pytest
import torch

from diffusion_rl import advantages as A

torch.set_num_threads(1)


def test_grpo_zero_for_equal_reward_groups_and_counted():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 7.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3])  # group 0 and 2 all-equal; group 3 a single sample
    out = A.grpo_advantages(r, gid)
    assert torch.equal(out.advantages[[0, 1, 2, 6, 7, 8]], torch.zeros(6))
    assert out.stats["n_groups"] == 4 and out.stats["n_degenerate_groups"] == 3
    assert torch.equal(out.weights, torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 0.0]))
    # Group 1: mean 1/3, population std sqrt(2)/3.
    expect = (torch.tensor([0.0, 1.0, 0.0]) - 1 / 3) / ((2**0.5) / 3 + 1e-4)
    torch.testing.assert_close(out.advantages[3:6], expect)
    down = A.grpo_advantages(r, gid, degenerate="downweight", degenerate_weight=0.25)
    assert torch.equal(down.weights, torch.tensor([0.25, 0.25, 0.25, 1, 1, 1, 0.25, 0.25, 0.25]))
    assert torch.equal(down.advantages, out.advantages)
    assert A.grpo_advantages(r, gid, degenerate="keep").weights.eq(1).all()


def test_grpo_groups_need_not_be_contiguous():
    r = torch.tensor([3.0, 10.0, 1.0, 20.0])
    gid = torch.tensor([5, 9, 5, 9])
    out = A.grpo_advantages(r, gid, eps=0.0)
    torch.testing.assert_close(out.advantages, torch.tensor([1.0, -1.0, -1.0, 1.0]))


def test_mc_grpo_is_robust_to_one_outlier_where_the_mean_baseline_flips_signs():
    # Small group (G + 1 = 5): four decent rollouts and one catastrophic outlier.
    r = torch.tensor([0.6, 0.7, 0.8, 0.9, -10.0])
    gid = torch.zeros(5, dtype=torch.long)
    mean_adv = A.grpo_advantages(r, gid).advantages
    med = A.mc_grpo_advantages(r, gid)
    # The mean baseline (−1.4) makes every decent rollout look good, even the worst of them (0.6)...
    assert bool((mean_adv[:4] > 0).all())
    # ...the median baseline (0.7) ranks them correctly: 0.6 is below, 0.8/0.9 above.
    assert float(med.advantages[0]) < 0 < float(med.advantages[2]) < float(med.advantages[3])
    assert float(med.advantages[4]) < float(med.advantages[0])
    # The pivot (the median rollout itself, 0.7) has A = 0 and is excluded from the update.
    assert float(med.advantages[1]) == 0.0 and float(med.weights[1]) == 0.0 and int((med.weights == 0).sum()) == 1
    # MAD scale: median |r − 0.7| over {0.1, 0, 0.1, 0.2, 10.7} is 0.1.
    torch.testing.assert_close(med.advantages[3], torch.tensor(0.2 / (0.1 + 1e-3)))


def test_mc_grpo_vectorised_matches_torch_median_per_group():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(60, generator=g)
    gid = torch.randint(0, 7, (60,), generator=g)
    out = A.mc_grpo_advantages(r, gid, scale="none", exclude_pivot=False)
    for k in gid.unique():
        sel = gid == k
        torch.testing.assert_close(out.advantages[sel], r[sel] - r[sel].median())


def test_gdpo_keeps_reward_profiles_apart_that_grpo_merges():
    # Two rewards; rollouts 0 and 1 have different profiles but the same sum.
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    gid = torch.zeros(4, dtype=torch.long)
    grpo = A.grpo_advantages(r.sum(-1), gid).advantages
    assert float(grpo[0]) == float(grpo[1])
    # With a sparse second reward the decoupled normalisation separates them.
    r2 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    gdpo = A.gdpo_advantages(r2, gid, batch_normalize=False).advantages
    assert float(gdpo[1]) > float(gdpo[0])  # the rare reward counts more after its own normalisation
    z = (r2 - r2.mean(0)) / (r2.std(0) + 1e-6)
    torch.testing.assert_close(gdpo, z.sum(-1))
    wn = A.gdpo_advantages(r2, gid)
    torch.testing.assert_close(wn.advantages.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)


def test_dara_upweights_the_sparsely_active_reward():
    g = torch.Generator().manual_seed(1)
    n_groups, k = 16, 4
    gid = torch.arange(n_groups).repeat_interleave(k)
    dense = torch.rand(n_groups * k, generator=g)  # active in every group
    sparse = torch.zeros(n_groups * k)
    sparse[:k] = torch.tensor([1.0, 0.0, 0.0, 1.0])  # active in 1 of 16 groups
    out = A.dara_advantages(torch.stack([dense, sparse], -1), gid)
    assert out.stats["density_0"] == 1.0 and out.stats["density_1"] == 1 / 16
    assert out.stats["weight_0"] == 1.0 and out.stats["weight_1"] == pytest.approx(4.0)  # sqrt(1 / (1/16))
    capped = A.dara_advantages(torch.stack([dense, sparse], -1), gid, w_max=2.0)
    assert capped.stats["weight_1"] == 2.0


def test_awr_energies_sum_to_zero_per_group_and_are_clipped():
    r = torch.tensor([0.0, 1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 5.0])
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    out = A.awr_energies(r, gid)
    e = out.advantages
    torch.testing.assert_close(e[:4].sum(), torch.tensor(0.0), atol=1e-6, rtol=0)
    assert bool((e[:4].diff() > 0).all())
    assert torch.equal(e[4:], torch.zeros(4)) and out.stats["n_degenerate_groups"] == 1
    big = A.awr_energies(torch.tensor([0.0] * 15 + [1.0]), torch.zeros(16, dtype=torch.long), temperature=0.1)
    assert float(big.advantages.max()) == 3.0


def test_gae_keeps_terminated_and_truncated_apart():
    # One step each: a terminated step does not bootstrap, a truncated one does.
    r = torch.tensor([[1.0], [1.0]])
    v = torch.tensor([[0.5], [0.5]])
    nv = torch.tensor([[10.0], [10.0]])
    term = torch.tensor([[True], [False]])
    trunc = torch.tensor([[False], [True]])
    adv, vt = A.gae(r, v, nv, terminated=term, truncated=trunc, gamma=0.9, lam=0.95)
    torch.testing.assert_close(adv, torch.tensor([[0.5], [1.0 + 9.0 - 0.5]]))
    torch.testing.assert_close(vt, adv + v)


def test_gae_matches_a_reference_loop_with_padding():
    g = torch.Generator().manual_seed(2)
    n, t = 3, 6
    r, v, nv = (torch.randn(n, t, generator=g) for _ in range(3))
    valid = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0]], dtype=torch.bool)
    term = torch.zeros(n, t, dtype=torch.bool)
    trunc = torch.zeros(n, t, dtype=torch.bool)
    term[0, 5] = True
    trunc[1, 3] = True
    term[2, 2] = True  # an episode boundary inside a row (auto-reset)
    trunc[2, 4] = True
    adv, _ = A.gae(r, v, nv, terminated=term, truncated=trunc, valid=valid, gamma=0.9, lam=0.8)
    ref = torch.zeros(n, t)
    for i in range(n):
        run = 0.0
        for k in reversed(range(t)):
            if not valid[i, k]:
                run = 0.0
                continue
            delta = r[i, k] + (0.0 if term[i, k] else 0.9 * nv[i, k]) - v[i, k]
            done = bool(term[i, k] or trunc[i, k])
            run = delta + (0.0 if done else 0.9 * 0.8 * run)
            ref[i, k] = run
    torch.testing.assert_close(adv, ref)
    assert bool((adv[~valid] == 0).all())


def test_shape_errors_name_the_field():
    with pytest.raises(ValueError, match="group_ids"):
        A.grpo_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="rewards"):
        A.gdpo_advantages(torch.zeros(4), torch.zeros(4, dtype=torch.long))
