"""DSRL (Wagenmaker et al. 2025, diffusion steering): SAC in the initial-noise space of a frozen flow/diffusion policy.

A small Gaussian actor π_w(w | φ(s)) outputs the noise w the frozen sampler starts from; the chunk the sampler
returns for w is executed. The environment as the actor sees it: state s, action w, the executed chunk's reward.
SAC on that MDP: twin Q(φ, w) with Polyak target networks, the actor maximising min Q − α log π, α tuned to a
target entropy (−dim w, SAC's default). The noise is tanh-squashed to [−bound, bound]: the base sampler was trained
on N(0, I) noise, and far-out noise leaves its training support.

Our choices: the critics' target leaves out the entropy bonus by default (`backup_entropy`, as jaxrl's SAC allows):
with a noise of 50+ dimensions, α·entropy per chunk outweighs a sparse reward of at most 1 by orders of magnitude
and the soft Q would rank noises by entropy, not success; the actor keeps SAC's entropy term. Transitions are per executed chunk with discount γ^h (h executed env steps) and the sparse outcome
reward of `chunk_q` (1 at the succeeding step, discounted within the chunk); the critics read the base policy's
observation features (DSRL reads its own encoder's or the base's).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from diffusion_rl.success_model import soft_update_

LOG_STD_RANGE = (-5.0, 2.0)


def _mlp(inp: int, out: int, hidden: int, layers: int, *, layer_norm: bool = False) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(inp, hidden), *([nn.LayerNorm(hidden)] if layer_norm else []), nn.SiLU()]
        inp = hidden
    return nn.Sequential(*mods, nn.Linear(inp, out))


class NoiseActor(nn.Module):
    """π_w(w | φ): a tanh-squashed Gaussian over the flattened noise (noise_dim,), scaled to [−bound, bound]."""

    def __init__(self, feature_dim: int, noise_dim: int, *, hidden_dim: int = 256, num_layers: int = 2, bound: float = 1.5):
        super().__init__()
        if bound <= 0:
            raise ValueError(f"the noise bound must be > 0; got {bound}")
        self.noise_dim, self.bound = noise_dim, bound
        self.net = _mlp(feature_dim, 2 * noise_dim, hidden_dim, num_layers)

    def forward(self, features: Tensor, *, deterministic: bool = False, eps: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(noise (B, noise_dim), log π (B,)); deterministic: the squashed mean (log π of the mean's density). `eps`
        (B, noise_dim): the standard normal draw to reparameterise with (drawn here when None)."""
        mean, log_std = self.net(features).chunk(2, dim=-1)
        std = log_std.clamp(*LOG_STD_RANGE).exp()
        eps = torch.randn_like(mean) if eps is None else eps.to(mean)
        u = mean if deterministic else mean + std * eps
        log_prob = (-0.5 * ((u - mean) / std).pow(2) - std.log() - 0.5 * math.log(2 * math.pi)).sum(-1)
        # tanh and the scale: change of variables, in the numerically stable form of log(1 − tanh²u)
        log_prob = log_prob - (2 * (math.log(2) - u - nn.functional.softplus(-2 * u))).sum(-1) - self.noise_dim * math.log(self.bound)
        return self.bound * torch.tanh(u), log_prob


class TwinQ(nn.Module):
    """Two independent Q(φ, w) heads; the minimum is SAC's clipped double-Q estimate. `layer_norm`: LayerNorm after
    each hidden layer (RLPD, Ball et al. 2023: it bounds Q's extrapolation to actions far from the data)."""

    def __init__(self, feature_dim: int, noise_dim: int, *, hidden_dim: int = 256, num_layers: int = 2, layer_norm: bool = False):
        super().__init__()
        self.q1 = _mlp(feature_dim + noise_dim, 1, hidden_dim, num_layers, layer_norm=layer_norm)
        self.q2 = _mlp(feature_dim + noise_dim, 1, hidden_dim, num_layers, layer_norm=layer_norm)

    def forward(self, features: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
        x = torch.cat([features, noise], dim=-1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


class DSRLAgent(nn.Module):
    """The actor, the twin critics and their targets, and SAC's temperature, with their optimisers."""

    def __init__(
        self, feature_dim: int, noise_dim: int, *, hidden_dim: int = 256, bound: float = 1.5, lr: float = 3e-4,
        tau: float = 0.005, init_alpha: float = 0.1, target_entropy: float | None = None, backup_entropy: bool = False,
        critic_layer_norm: bool = False, target_range: tuple[float, float] | None = None, bc_weight: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.actor = NoiseActor(feature_dim, noise_dim, hidden_dim=hidden_dim, bound=bound)
        self.critic = TwinQ(feature_dim, noise_dim, hidden_dim=hidden_dim, layer_norm=critic_layer_norm)
        self.target = TwinQ(feature_dim, noise_dim, hidden_dim=hidden_dim, layer_norm=critic_layer_norm)
        self.target.load_state_dict(self.critic.state_dict())
        self.target.requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor(math.log(init_alpha)))
        if target_range is not None and (backup_entropy or not target_range[0] < target_range[1]):
            raise ValueError(f"target_range {target_range}: a (low, high) range of the returns, without backup_entropy "
                             "(entropy in the target leaves the returns' range)")
        if bc_weight < 0:
            raise ValueError(f"bc_weight must be >= 0; got {bc_weight}")
        self.tau, self.backup_entropy, self.target_range, self.bc_weight = tau, backup_entropy, target_range, bc_weight
        self.target_entropy = -float(noise_dim) if target_entropy is None else target_entropy
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=lr)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=lr)

    @torch.no_grad()
    def act(self, features: Tensor, *, deterministic: bool = False) -> Tensor:
        return self.actor(features, deterministic=deterministic)[0]

    def update(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """One SAC step on transitions {x (B, F), noise (B, D), reward (B,), x_next (B, F), done (B,), discount (B,)}:
        critics to r + γ^h (1 − done)·min Q_target(x', w'), w' ~ π (− α log π(w'|x') inside with `backup_entropy`;
        clamped to `target_range`, the returns' range, when given); then the actor (with `bc_weight`, plus that times
        the mean squared distance of its mean action to the stored one: TD3+BC's term, keeping it on the data); then α."""
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            w_next, logp_next = self.actor(batch["x_next"])
            q_next = torch.min(*self.target(batch["x_next"], w_next))
            if self.backup_entropy:
                q_next = q_next - alpha * logp_next
            y = batch["reward"] + batch["discount"] * (1.0 - batch["done"].float()) * q_next
            if self.target_range is not None:  # a bootstrapped value past what any return can be is extrapolation
                y = y.clamp(*self.target_range)
        q1, q2 = self.critic(batch["x"], batch["noise"])
        critic_loss = (q1 - y).pow(2).mean() + (q2 - y).pow(2).mean()
        self.critic_opt.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_opt.step()

        w, logp = self.actor(batch["x"])
        q_pi = torch.min(*self.critic(batch["x"], w))
        actor_loss = (alpha * logp - q_pi).mean()
        if self.bc_weight > 0:  # the mean, not the sample: the entropy term already spreads the samples
            mean_action = self.actor(batch["x"], deterministic=True)[0]
            actor_loss = actor_loss + self.bc_weight * (mean_action - batch["noise"]).pow(2).mean()
        self.actor_opt.zero_grad(set_to_none=True)
        actor_loss.backward()
        self.actor_opt.step()

        alpha_loss = -(self.log_alpha * (logp.detach() + self.target_entropy)).mean()
        self.alpha_opt.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_opt.step()
        soft_update_(self.target, self.critic, tau=self.tau)
        return {"critic_loss": float(critic_loss.detach()), "actor_loss": float(actor_loss.detach()),
                "alpha": float(alpha), "entropy": float(-logp.detach().mean()), "q": float(q_pi.detach().mean())}  # fmt: skip

    def optim_state(self) -> dict:
        return {"actor": self.actor_opt.state_dict(), "critic": self.critic_opt.state_dict(), "alpha": self.alpha_opt.state_dict()}

    def load_optim_state(self, state: dict) -> None:
        self.actor_opt.load_state_dict(state["actor"])
        self.critic_opt.load_state_dict(state["critic"])
        self.alpha_opt.load_state_dict(state["alpha"])
