"""kinema's video-diffusion policy: Cosmos Policy's recipe on the generator stack's Wan transformer.

One flow-matching video model (a `policies.video.VideoGenerator`: its Wan transformer, UMT5 text encoder, VAE or
exact pixel space, LoRA adapters) denoises one latent sequence whose frames are slots (`VideoPolicyConfig.slots`):

    current.<camera>...  current.state  action  future.<camera>...  future.state  value

Images are encoded by the generator's VAE, one latent frame each; the state, the action chunk and the value are
vectors tiled over a latent frame ("encode a blank image, overwrite the latent with the vector, tiled"), decoded
by averaging the tiles. A conditioning mask says which slots are given (kept clean) and which are generated:

    policy        given current                      -> action, future, value   (demonstrations; the acting mode)
    world model   given current + action             -> future, value           (rollouts)
    value         given current + action + future    -> value                   (rollouts)

Test-time planning samples N chunks and executes the one with the highest predicted value. Implements the RL core's
`FlowPolicy` protocol and the VLA's interface (select_action, predict_action_chunk, save/from_pretrained, features).

Batch convention: the VLA's (`policies.vla.modeling_vla`), plus, when the trainer's buffer is asked for the future
(`reads_future`): future.images.<camera> uint8 (B, H, W, 3) and future.state (B, state_dim) at step t + chunk_size
(the chunk's end, clamped to the episode's last step), outcome (B,) in [0, 1] and steps_to_end (B,).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffusion_rl import flow
from diffusion_rl.flow import SDEStep
from policies.acting import ChunkedActing, camera_images
from policies.video_policy.configuration_video_policy import VideoPolicyConfig

POLICY, WORLD, VALUE = 0, 1, 2  # conditioning modes
MODE_NAMES = {"policy": POLICY, "world": WORLD, "value": VALUE}
STATE_SCALE = 0.5  # z-scored states are halved to sit in the latents' [-1, 1] range mostly


@dataclass
class Context:
    """What one observation contributes: clean current-image latents (B, C, n_cameras, h, w), the normalised
    state (B, state_dim) and the instruction's embeddings (B, L, D)."""

    images: Tensor
    state: Tensor
    prompt: Tensor


class _TrunkRead(Exception):
    """Ends the trunk's pass once the block the expert head reads has run (`VideoPolicy.trunk_features`)."""


def mean_text_embedding(prompt: Tensor) -> Tensor:
    """(B, L, D) prompt embeddings -> (B, D): the mean over the instruction's tokens (the pipeline zeroes the
    padding after them, which is left out so that a short instruction is not scaled down)."""
    prompt = prompt.float()
    tokens = (prompt.abs().sum(-1, keepdim=True) > 0).float()
    return (prompt * tokens).sum(1) / tokens.sum(1).clamp(min=1.0)


def tile(vectors: Tensor, shape: tuple[int, int, int]) -> Tensor:
    """(B, D) -> (B, C, h, w): the vector repeated to fill a latent frame, the remainder zero."""
    B, D = vectors.shape
    n = shape[0] * shape[1] * shape[2]
    reps = n // D
    if reps < 1:
        raise ValueError(f"a latent frame {shape} holds {n} values, fewer than the {D} to encode; use a larger video_size")
    flat = vectors.repeat(1, reps)
    return torch.cat([flat, flat.new_zeros(B, n - reps * D)], dim=1).view(B, *shape)


def untile(frames: Tensor, dim: int) -> Tensor:
    """(B, C, h, w) -> (B, dim): the mean of the tiled copies (denoising errors average out)."""
    B = frames.shape[0]
    reps = frames[0].numel() // dim
    return frames.reshape(B, -1)[:, : reps * dim].reshape(B, reps, dim).mean(1)


class VideoPolicy(ChunkedActing, nn.Module):
    """Video-diffusion policy (Cosmos Policy family, CPU-sized by default). See the module docstring."""

    plans = predicts_frames = learns_from_experience = True

    reads_future = True  # the trainer's buffer adds future frames, states and outcomes to this policy's batches

    def __init__(self, config: VideoPolicyConfig, *, generator_path: str | None = None) -> None:
        super().__init__()
        if generator_path:
            config = dataclasses.replace(config, generator_path=generator_path)
        self.config = config
        self.generator = build_generator(config)
        if config.generator_path:
            if self.generator.active_adapter is not None:  # a post-trained generator (`kinema video train`'s final)
                config.extra["generator_fused_adapter"] = self.generator.active_adapter
                self.generator.fuse_adapter(self.generator.active_adapter)
            size = (self.generator.config.height, self.generator.config.width)
            if self.generator.config.latent_space == "pixel" and size != (config.video_size, config.video_size):
                raise ValueError(f"the generator at {config.generator_path} makes {size[0]}x{size[1]} frames; set "
                                 f"policy.video_size to {size[0]} (got {config.video_size})")  # fmt: skip
            self.generator.add_adapter("default", rank=config.lora_rank, alpha=config.lora_alpha)
            config.extra["latent_channels"] = int(self.generator.transformer.config.in_channels)
            config.extra["generator_text_dim"] = int(self.generator.transformer.config.text_dim)
        vae = self.generator.vae.config
        self.generator.check_shape(1, config.video_size, config.video_size)
        side = config.video_size // vae.scale_factor_spatial
        self.frame_shape = (int(self.generator.transformer.config.in_channels), side, side)
        self.slot_index = {name: i for i, name in enumerate(config.slots)}
        self.expert: nn.Module | None = None
        if config.action_head == "expert":  # the VLA's flow MLP, reading the trunk's features of the current slots
            from policies.vla.configuration_vla import VLAConfig
            from policies.vla.modeling_vla import ActionExpert

            wan = self.generator.transformer.config
            if not -wan.num_layers <= config.expert_layer < wan.num_layers:
                raise ValueError(f"policy.expert_layer names one of the transformer's {wan.num_layers} blocks "
                                 f"({-wan.num_layers}..{wan.num_layers - 1}); got {config.expert_layer}")  # fmt: skip
            tokens = (side // wan.patch_size[1]) * (side // wan.patch_size[2]) * config.current_slots
            text = int(wan.text_dim) if config.expert_text else 0
            self.token_proj = nn.Linear(wan.num_attention_heads * wan.attention_head_dim, config.expert_token_dim)
            self.expert = ActionExpert(VLAConfig(
                chunk_size=config.chunk_size, action_dim=config.action_dim,
                hidden_dim=tokens * config.expert_token_dim + config.state_dim + text,
                expert_hidden=config.expert_hidden, expert_layers=config.expert_layers,
            ))  # fmt: skip
        self.register_buffer("state_mean", torch.zeros(config.state_dim))
        self.register_buffer("state_std", torch.ones(config.state_dim))
        self._queue: deque[np.ndarray] = deque()
        self.last_prediction: dict[str, Any] | None = None  # the chosen candidates' predicted future and values

    # ----- normalisation and encoders ---------------------------------------------------------------------------
    def set_normalization(self, stats: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        state = stats["observation.state"]
        self.state_mean.copy_(torch.as_tensor(np.asarray(state["mean"]).reshape(-1), dtype=torch.float32))
        self.state_std.copy_(torch.as_tensor(np.asarray(state["std"]).reshape(-1), dtype=torch.float32).clamp(min=1e-3))

    @property
    def device(self) -> torch.device:
        return self.state_mean.device

    def _images(self, batch: Mapping[str, Any], key: str) -> Tensor:
        return camera_images(batch, key, self.config.video_size, self.device, self.config.cameras)

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) in [0, 1] -> one latent frame each, (B, C, h, w), through the generator's VAE."""
        return self.generator.encode_video(images[:, None]).float()[:, :, 0]

    @torch.no_grad()
    def decode_images(self, frames: Tensor) -> Tensor:
        """(B, C, h, w) latent frames -> images (B, 3, H, W) in [0, 1]."""
        return self.generator.decode_latents(frames[:, :, None])[:, 0].float()

    def _state(self, state: Any) -> Tensor:
        s = torch.as_tensor(state, device=self.device, dtype=torch.float32)
        z = (s - self.state_mean) / self.state_std
        if self.config.state_clip:  # why: VideoPolicyConfig.state_clip
            z = z.clamp(-self.config.state_clip, self.config.state_clip)
        return z * STATE_SCALE

    def encode(self, batch: Mapping[str, Any]) -> tuple[Context, Context]:
        """(context, what an aux head would read): the trainer computes it once per minibatch."""
        images = torch.stack([self.encode_images(self._images(batch, f"observation.images.{c}")) for c in self.config.cameras], 2)
        ctx = Context(images, self._state(batch["observation.state"]), self.generator.encode_prompts(list(batch["task"])))
        return ctx, ctx

    @torch.no_grad()
    def features(self, batch: Mapping[str, Any]) -> Tensor:
        """(B, hidden_dim): current latents pooled to 2x2 per camera, the state and the mean instruction embedding."""
        ctx = self.encode(batch)[0]
        B, C, n, h, w = ctx.images.shape
        pooled = F.adaptive_avg_pool2d(ctx.images.permute(0, 2, 1, 3, 4).reshape(B * n, C, h, w), 2).reshape(B, -1)
        return torch.cat([pooled, ctx.state, ctx.prompt.float().mean(1)], dim=1)

    # ----- the latent layout ----------------------------------------------------------------------------------------
    def encode_vector(self, vectors: Tensor) -> Tensor:
        return tile(vectors.float(), self.frame_shape)

    def encode_actions(self, actions: Tensor) -> Tensor:
        """(B, H, A) in [-1, 1] -> a latent frame (B, C, h, w)."""
        return self.encode_vector(actions.reshape(actions.shape[0], -1))

    def decode_actions(self, frames: Tensor) -> Tensor:
        return untile(frames, self.config.chunk_size * self.config.action_dim).view(-1, self.config.chunk_size, self.config.action_dim)

    def encode_values(self, values: Tensor) -> Tensor:
        """(B,) in [0, 1] -> a latent frame of 2v − 1."""
        return self.encode_vector(values.float()[:, None] * 2.0 - 1.0)

    def decode_values(self, frames: Tensor) -> Tensor:
        return ((untile(frames, 1)[:, 0] + 1.0) / 2.0).clamp(0.0, 1.0)

    def decode_states(self, frames: Tensor) -> Tensor:
        return untile(frames, self.config.state_dim) / STATE_SCALE * self.state_std + self.state_mean

    def value_target(self, batch: Mapping[str, Any]) -> Tensor:
        """Discounted sparse return from the chunk's end: outcome · γ^steps_to_end."""
        outcome = torch.as_tensor(batch["outcome"], device=self.device, dtype=torch.float32)
        steps = torch.as_tensor(batch["steps_to_end"], device=self.device, dtype=torch.float32)
        return outcome * self.config.value_discount**steps

    def target_latents(self, batch: Mapping[str, Any], ctx: Context) -> tuple[Tensor, Tensor, Tensor]:
        """The clean sequence (B, C, S, h, w), which slots the batch knows (B, S) and the element mask (B, C, S, h, w)
        that leaves out padded actions (past the episode's end)."""
        cfg, B = self.config, ctx.state.shape[0]
        C, h, w = self.frame_shape
        x0 = ctx.images.new_zeros(B, C, len(cfg.slots), h, w)
        known = torch.zeros(B, len(cfg.slots), dtype=torch.bool, device=self.device)
        elements = torch.ones(B, C, len(cfg.slots), h, w, dtype=torch.bool, device=self.device)
        n = len(cfg.cameras)
        x0[:, :, :n] = ctx.images
        x0[:, :, n] = self.encode_vector(ctx.state)
        known[:, : n + 1] = True
        if "action" in batch:
            actions = torch.as_tensor(batch["action"], device=self.device, dtype=torch.float32)
            x0[:, :, self.slot_index["action"]] = self.encode_actions(actions)
            known[:, self.slot_index["action"]] = True
            if (pad := batch.get("action_is_pad")) is not None:
                pad = torch.as_tensor(pad, device=self.device)[..., None].expand(actions.shape).reshape(B, -1)
                elements[:, :, self.slot_index["action"]] = ~tile(pad.float(), self.frame_shape).bool()
        if all(f"future.images.{c}" in batch for c in cfg.cameras) and "future.state" in batch:
            for c in cfg.cameras:
                x0[:, :, self.slot_index[f"future.{c}"]] = self.encode_images(self._images(batch, f"future.images.{c}"))
                known[:, self.slot_index[f"future.{c}"]] = True
            x0[:, :, self.slot_index["future.state"]] = self.encode_vector(self._state(batch["future.state"]))
            known[:, self.slot_index["future.state"]] = True
        if "outcome" in batch and "steps_to_end" in batch:
            x0[:, :, self.slot_index["value"]] = self.encode_values(self.value_target(batch))
            known[:, self.slot_index["value"]] = True
        return x0, known, elements

    def given_slots(self, modes: Tensor) -> Tensor:
        """(B,) mode ids -> (B, S): the slots each sample is conditioned on (kept clean)."""
        names = self.config.slots
        current = torch.tensor([n.startswith("current.") for n in names], device=self.device)
        action = torch.tensor([n == "action" for n in names], device=self.device)
        future = torch.tensor([n.startswith("future.") for n in names], device=self.device)
        m = modes.to(self.device)[:, None]
        return current[None] | ((m >= WORLD) & action[None]) | ((m >= VALUE) & future[None])

    # ----- training ----------------------------------------------------------------------------------------------------
    def flow_loss(
        self,
        batch: Mapping[str, Any],
        *,
        weights: Tensor | None = None,
        targets: Mapping[str, Tensor] | None = None,
        context: Context | None = None,
        modes: Tensor | None = None,
    ) -> Tensor:
        """Per-sample flow-matching loss (B,) over the generated slots the batch knows (`diffusion_rl.flow`'s one
        loss), in the model's prediction space. modes: (B,) conditioning modes, default policy mode. The batch may fix
        the draws: "t" (B,) the flow time (the action slot's), "t_world" (B,) the world slots' (slot_times
        independent), "noise" (B, C, S, h, w), "actions_only" (B,) which policy-mode samples train on [current..., action].

        targets: {"x0": (B, H, A)} replaces the action chunk's target (AWR's x_0*), {"x0": (B, C, S, h, w)} or
        {"velocity": (B, C, S, h, w)} the whole sequence's."""
        ctx = self.encode(batch)[0] if context is None else context
        x0, known, elements = self.target_latents(batch, ctx)
        B = x0.shape[0]
        modes = torch.full((B,), POLICY, device=self.device) if modes is None else modes
        given = self.given_slots(modes)
        t = self._batch_time(batch.get("t"), B)
        t_world = None
        if self.config.slot_times == "independent":  # UWM: the world slots' noise level drawn apart from the actions'
            t_world = self._batch_time(batch.get("t_world"), B)
        noise = batch.get("noise")
        noise = torch.randn_like(x0) if noise is None else noise.to(x0)
        targets = dict(targets or {})
        if unknown := set(targets) - {"x0", "velocity"}:
            raise ValueError(f"targets takes 'x0' or 'velocity'; got {sorted(unknown)}")
        target_x0 = x0
        if "x0" in targets:
            tx = targets["x0"].to(x0)
            if tx.shape == x0.shape:
                target_x0 = tx
            else:
                target_x0 = x0.clone()
                target_x0[:, :, self.slot_index["action"]] = self.encode_actions(tx)
        velocity = targets["velocity"].to(x0) if "velocity" in targets else None
        policy_rows = modes.to(self.device) == POLICY
        t_sequence = t
        if self.expert is not None:  # in policy mode the chunk is the expert's: its slot stays noise, out of the loss
            if velocity is not None or ("x0" in targets and targets["x0"].dim() != 3):
                raise ValueError("with action_head 'expert' the chunk is the head's: give targets {'x0': (B, H, A)}, the "
                                 "chunk's, not a whole-sequence target")  # fmt: skip
            known[:, self.slot_index["action"]] &= ~policy_rows
            t_sequence = torch.where(policy_rows, torch.ones_like(t), t)
        mask = (~given[:, None, :, None, None] & known[:, None, :, None, None]) & elements
        # Acting "actions" denoises [current..., action] alone: a share of the policy-mode samples learn that sequence.
        short = batch.get("actions_only")
        short = torch.rand(B, device=self.device) < self.config.actions_only_share if short is None else short
        short = torch.as_tensor(short, device=self.device, dtype=torch.bool) & policy_rows
        short &= self.config.acting == "actions" and self.expert is None
        loss = x0.new_zeros(B)
        trained = mask.flatten(1).any(1)  # rows with a slot to learn (an expert's batch without futures has none)
        for rows, length in ((~short & trained, len(self.config.slots)), (short & trained, self.config.action_sequence)):
            if not rows.any():
                continue
            idx = rows.nonzero()[:, 0]
            part = lambda x: None if x is None else x[idx][:, :, :length]  # noqa: E731
            times = self.slot_times(t_sequence[idx], given[idx][:, :length], None if t_world is None else t_world[idx])
            loss = loss.index_copy(0, idx, self._sequence_loss(
                part(x0), part(noise), times, given[idx][:, :length], part(mask), part(target_x0), part(velocity),
                ctx.prompt[idx], None if weights is None else weights[idx],
            ))  # fmt: skip
        if self.expert is not None and "action" in batch and policy_rows.any():
            chunk = targets["x0"].to(x0) if "x0" in targets else batch["action"]
            expert = self._expert_loss(batch, ctx, chunk, t, weights)
            loss = loss + torch.where(policy_rows, expert, torch.zeros_like(expert))
        return loss

    def trunk_features(self, ctx: Context) -> Tensor:
        """What the expert head reads, (B, D): the hidden states of transformer block `expert_layer` over the clean
        current slots (one pass over them alone, stopped after that block), each token projected to expert_token_dim,
        the normalised state, and with `expert_text` the instruction's mean text embedding. With action_gradients
        "stop" the hidden states are detached: the action loss trains the head, not the trunk."""
        current = torch.cat([ctx.images, self.encode_vector(ctx.state)[:, :, None]], dim=2)  # the leading slots' latents
        seen: list[Tensor] = []

        def keep(module: nn.Module, args: Any, output: Tensor) -> None:
            seen.append(output)
            raise _TrunkRead  # the blocks after it (and the output head) would compute what nothing reads

        hook = self.generator.transformer.blocks[self.config.expert_layer].register_forward_hook(keep)
        try:
            self.generator.x0_pred(current, current.new_zeros(current.shape[0], current.shape[2]), ctx.prompt)
        except _TrunkRead:
            pass
        finally:
            hook.remove()
        hidden = seen[-1].float()
        if self.config.action_gradients == "stop":
            hidden = hidden.detach()
        parts = [self.token_proj(hidden).flatten(1), ctx.state]
        if self.config.expert_text:
            parts.append(mean_text_embedding(ctx.prompt))
        return torch.cat(parts, dim=1)

    def _expert_loss(self, batch: Mapping[str, Any], ctx: Context, chunk: Any, t: Tensor, weights: Tensor | None) -> Tensor:
        """The expert head's per-sample flow-matching loss (B,) on the chunk (B, H, A), padded actions left out."""
        actions = torch.as_tensor(chunk, device=self.device, dtype=torch.float32)
        noise = batch.get("action_noise")
        noise = torch.randn_like(actions) if noise is None else torch.as_tensor(noise, device=self.device, dtype=torch.float32)
        v = self.expert(flow.interpolate(actions, noise, t), t, self.trunk_features(ctx))
        mask = None
        if (pad := batch.get("action_is_pad")) is not None:
            mask = ~torch.as_tensor(pad, device=self.device, dtype=torch.bool)[..., None].expand(actions.shape)
        return flow.flow_matching_loss(v, flow.velocity_target(actions, noise).detach(), weights=weights, mask=mask)

    def _batch_time(self, t: Any, B: int) -> Tensor:
        """A batch's flow time as (B,): drawn from the configured distribution when not given, a scalar broadcast."""
        if t is None:
            return flow.sample_time(B, distribution=self.config.time_distribution, device=self.device)
        return torch.as_tensor(t, device=self.device, dtype=torch.float32).expand(B)

    def _sequence_loss(self, x0: Tensor, noise: Tensor, times: Tensor, given: Tensor, mask: Tensor, target_x0: Tensor,
                       velocity: Tensor | None, prompt: Tensor, weights: Tensor | None) -> Tensor:  # fmt: skip
        """The per-sample loss (B,) of one sequence layout: the generated slots noised at `times`, the given kept."""
        g = given[:, None, :, None, None]
        tt = self.generator.frame_times(times)
        x_t = torch.where(g, x0, flow.interpolate(x0, noise, tt))
        if self.generator.config.prediction == "x0":
            pred = self.generator.x0_pred(x_t, times, prompt)
            target = flow.x0_from_velocity(x_t, velocity, tt) if velocity is not None else target_x0
        else:
            pred = self.generator.velocity(x_t, times, prompt)
            target = velocity if velocity is not None else flow.velocity_target(target_x0, noise)
        return flow.flow_matching_loss(pred, target.detach(), weights=weights, mask=mask)

    def slot_times(self, t: Tensor, given: Tensor, t_world: Tensor | None = None) -> Tensor:
        """The flow time the transformer is told for each slot: t (B,) for slot_times "shared" (every slot, the given
        ones too); (B, S) for "independent": the given slots 0 (they are clean), the action slot t, the world slots
        t_world (default t). given: (B, S) for a sequence of the first S slots."""
        if self.config.slot_times == "shared":
            return t
        t = t.expand(given.shape[0])
        names = self.config.slots[: given.shape[1]]
        world = torch.tensor([n.startswith("future.") or n == "value" for n in names], device=self.device)
        t_world = t if t_world is None else t_world
        return torch.where(world[None], t_world[:, None], t[:, None]).masked_fill(given, 0.0)

    def experience_loss(self, batch: Mapping[str, Any], *, context: Context | None = None) -> Tensor:
        """Rollouts refine the world model and the value (Cosmos Policy's experience modes), per sample (B,): each
        sample is trained in world-model or value mode with equal probability, whatever its credit weight."""
        B = len(batch["task"])
        modes = torch.where(torch.rand(B, device=self.device) < 0.5, WORLD, VALUE)
        return self.flow_loss(batch, context=context, modes=modes)

    def aux_loss(self, batch: Mapping[str, Any], aux_features: Any) -> Tensor:
        """No privileged head: zeros (B,)."""
        return torch.zeros(len(batch["task"]), device=self.device)

    def nft_loss(self, *args: Any, **kwargs: Any) -> Tensor:
        raise NotImplementedError("rl.method nft trains the VLA's action expert; the video policy supports the imitation-style methods (habc, awr, sft_continued)")

    # ----- sampling ------------------------------------------------------------------------------------------------------
    def _velocity_fn(self, known: Tensor, given: Tensor, prompt: Tensor):
        g = given[:, None, :, None, None]

        def fn(x: Tensor, t: Tensor) -> Tensor:
            v = self.generator.velocity(torch.where(g, known, x), self.slot_times(t, given), prompt)
            return torch.where(g, torch.zeros_like(v), v)

        return fn

    def sample(self, ctx: Context, known: Tensor, mode: int, noise: Tensor, *, length: int | None = None) -> Tensor:
        """Denoise the slots `mode` generates, the given ones held at `known`: (B, C, S, h, w). length: denoise the
        sequence of the first `length` slots only (acting "actions": [current..., action]); (B, C, length, h, w)."""
        length = length or len(self.config.slots)
        known, noise = known[:, :, :length], noise[:, :, :length]
        given = self.given_slots(torch.full((noise.shape[0],), mode, device=self.device))[:, :length]
        g = given[:, None, :, None, None]
        schedule = flow.time_schedule(self.config.num_flow_steps, shift=self.generator.config.flow_shift, device=self.device)
        return flow.euler_sample(self._velocity_fn(known, given, ctx.prompt), torch.where(g, known, noise), schedule=schedule)

    def _noise(self, rows: int, seeds: list[int] | None) -> Tensor:
        """(rows, C, S, h, w) standard normal for the latent sequence; each row drawn from its own seed when given."""
        return self._seeded_normal(rows, (self.frame_shape[0], len(self.config.slots), *self.frame_shape[1:]), seeds)

    def _seeded_normal(self, rows: int, shape: tuple[int, ...], seeds: list[int] | None) -> Tensor:
        """(rows, *shape) standard normal; each row drawn from its own seed when given (paired evaluations)."""
        if seeds is None:
            return torch.randn(rows, *shape, device=self.device)
        return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds]).to(self.device)

    @staticmethod
    def _row_seeds(noise: Tensor | None, candidates: int, draw: int) -> list[int] | None:
        # The trainer's evaluator passes action-shaped noise drawn per (episode seed, step): a stable seed per row,
        # candidate and draw, so that two evaluations on the same seeds are paired.
        if noise is None:
            return None
        rows = [zlib.crc32(row.detach().cpu().numpy().tobytes()) for row in noise]
        return [int(np.random.SeedSequence([r, j, draw]).generate_state(1)[0]) for r in rows for j in range(candidates)]

    def _repeat(self, ctx: Context, n: int) -> Context:
        return Context(*(x.repeat_interleave(n, dim=0) for x in (ctx.images, ctx.state, ctx.prompt)))

    @torch.no_grad()
    def plan(self, batch: Mapping[str, Any], *, candidates: int | None = None, noise: Tensor | None = None) -> dict[str, Tensor]:
        """N candidate chunks per observation, each with its predicted value; "best" (B,) the highest-valued.

        Returns "chunks" (B, N, H, A), "values" (B, N) (NaN where nothing predicted one: acting "actions" with N = 1),
        "best" (B,), "latents" (B, N, C, S, h, w) (the slots acting did not generate are zero), "futures" (whether
        the latents hold generated future slots)."""
        cfg = self.config
        n = int(candidates or cfg.planning_candidates)
        ctx = self.encode(batch)[0]
        B = ctx.state.shape[0]
        rep = self._repeat(ctx, n)
        known, _, _ = self.target_latents({}, rep)
        # Acting "actions" denoises the chunks alone; a candidate's value then comes from the world model's pass.
        joint = cfg.acting == "joint" or (n > 1 and cfg.planning_value == "joint")
        seeds = self._row_seeds(noise, n, 0)
        chunks = None
        if self.expert is not None:  # one trunk pass per observation, the candidates from the head
            features = self.trunk_features(ctx).repeat_interleave(n, dim=0)
            action_noise = self._seeded_normal(B * n, (cfg.chunk_size, cfg.action_dim), seeds)
            chunks = flow.euler_sample(lambda x, t: self.expert(x, t, features), action_noise, num_steps=cfg.num_flow_steps)
            latents = known.clone()
            latents[:, :, self.slot_index["action"]] = self.encode_actions(chunks.clamp(-1.0, 1.0))
        else:
            length = len(cfg.slots) if joint else cfg.action_sequence
            latents = self.sample(rep, known, POLICY, self._noise(B * n, seeds), length=length)
            latents = torch.cat([latents, known[:, :, length:]], dim=2)  # slots not generated stay zero
        values = self.decode_values(latents[:, :, self.slot_index["value"]]) if joint else latents.new_full((B * n,), float("nan"))
        if n > 1 and cfg.planning_value == "world":
            values = self._world_values(rep, latents, noise, n)
        values = values.view(B, n)
        best = values.argmax(dim=1)
        chunks = self.decode_actions(latents[:, :, self.slot_index["action"]]) if chunks is None else chunks
        chunks = chunks.view(B, n, cfg.chunk_size, cfg.action_dim)
        return {"chunks": chunks.clamp(-1.0, 1.0), "values": values, "best": best, "latents": latents.view(B, n, *latents.shape[1:]),
                "futures": joint}  # fmt: skip

    def _world_values(self, ctx: Context, latents: Tensor, noise: Tensor | None, n: int) -> Tensor:
        """Each candidate's value re-predicted in world-model mode (given its chunk), `planning_value_samples` times:
        majority vote on success (value > 0.5), then the mean value of the majority (Cosmos Policy's aggregation)."""
        samples = []
        for k in range(self.config.planning_value_samples):
            out = self.sample(ctx, latents, WORLD, self._noise(latents.shape[0], self._row_seeds(noise, n, k + 1)))
            samples.append(self.decode_values(out[:, :, self.slot_index["value"]]))
        vals = torch.stack(samples)  # (draws, rows)
        success = vals > 0.5
        majority = success.float().mean(0) >= 0.5
        pick = torch.where(majority[None], success, ~success).float()
        return (vals * pick).sum(0) / pick.sum(0).clamp_min(1.0)

    @torch.no_grad()
    def predict_action_chunk(self, batch: Mapping[str, Any], *, noise: Tensor | None = None) -> Tensor:
        """A chunk (B, chunk_size, action_dim): the best of `planning_candidates` sampled chunks (1: the only one).
        Keeps the chosen candidates' predicted future frames and values in `last_prediction`."""
        out = self.plan(batch, noise=noise)
        rows = torch.arange(out["best"].shape[0], device=out["best"].device)
        chosen = out["latents"][rows, out["best"]]
        self.last_prediction = {"value": out["values"][rows, out["best"]], "values": out["values"], "latents": chosen, "batch": batch}
        if out["futures"]:
            self.last_prediction["future"] = chosen
        return out["chunks"][rows, out["best"]]

    @torch.no_grad()
    def predicted_future_images(self) -> dict[str, Tensor]:
        """The last chunk's predicted future frame per camera, (B, 3, video_size, video_size) in [0, 1]. Where acting
        generated no future (acting "actions"), the world model predicts it now, given the chunk."""
        if self.last_prediction is None:
            raise RuntimeError("no prediction yet: call predict_action_chunk first")
        latents = self.last_prediction["latents"]
        if "future" not in self.last_prediction:
            ctx = self.encode(self.last_prediction["batch"])[0]
            latents = self.sample(ctx, latents, WORLD, torch.randn_like(latents))
            self.last_prediction["future"] = latents
        latents = self.last_prediction["future"]
        return {c: self.decode_images(latents[:, :, self.slot_index[f"future.{c}"]]) for c in self.config.cameras}

    def sde_log_prob(self, batch: Mapping[str, Any], *, noise_level: float = 0.7, context: Context | None = None) -> SDEStep:
        """Flow-SDE log-prob (B,) of a recorded policy-mode step x_t -> x_next over the whole latent sequence
        (batch "x_t", "t", "t_next", "x_next" of shape (B, C, S, h, w)); the given slots do not move."""
        if self.expert is not None:
            raise NotImplementedError("sde_log_prob is over the denoised sequence; with action_head 'expert' the chunk is the head's")
        ctx = self.encode(batch)[0] if context is None else context
        known, _, _ = self.target_latents({}, ctx)
        given = self.given_slots(torch.full((known.shape[0],), POLICY, device=self.device))
        v = self._velocity_fn(known, given, ctx.prompt)(batch["x_t"], torch.as_tensor(batch["t"], device=self.device))
        return flow.sde_step_with_logprob(v, batch["x_t"], batch["t"], batch["t_next"], noise_level=noise_level, prev_sample=batch["x_next"])

    # ----- persistence -----------------------------------------------------------------------------------------------
    def _saved_state(self) -> dict[str, Tensor]:
        state, seen = {}, set()
        for k, v in self.state_dict().items():  # tied weights (UMT5's shared/embed_tokens) are saved once
            if v.data_ptr() not in seen or v.numel() == 0:
                seen.add(v.data_ptr())
                state[k] = v
        if self.config.generator_path:  # the pretrained weights are referenced, not copied: LoRA and buffers only
            state = {k: v for k, v in state.items() if "lora_" in k or not k.startswith("generator.")}
        return state

    def save_pretrained(self, directory: str, *, extra_files: Mapping[str, bytes] | None = None) -> None:
        """Atomic (`policies.checkpoint.save_checkpoint`): config.json + model.safetensors (+ extra files)."""
        from policies.checkpoint import save_checkpoint

        save_checkpoint(directory, self.config.to_dict(), self._saved_state(), extra_files=extra_files)

    @classmethod
    def from_pretrained(cls, directory: str, *, map_location: str = "cpu", generator_path: str | None = None) -> VideoPolicy:
        """Load a checkpoint; with a `generator_path` checkpoint the base Wan folder is read from there (or the
        path in config.json) and only the LoRA weights and buffers come from the checkpoint."""
        from policies.checkpoint import load_checkpoint

        config_dict, state = load_checkpoint(directory, map_location=map_location)
        model = cls(VideoPolicyConfig.from_dict(config_dict), generator_path=generator_path)
        own = model._saved_state()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        wrong = [k for k in own if k in state and state[k].shape != own[k].shape]
        if missing or unexpected or wrong:
            raise ValueError(
                f"checkpoint {directory} does not match this video-policy architecture: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}, wrong shapes {wrong[:5]}"
            )
        model.load_state_dict(state, strict=False)  # checked above: what is left out is the referenced base or a tied alias
        return model


def build_generator(config: VideoPolicyConfig):
    """The generator stack's model: a tiny random Wan stack in exact pixel space, or a local checkpoint folder."""
    from policies.video.configuration_video import preset_config
    from policies.video.generator import VideoGenerator

    if config.generator_path:
        dtype = getattr(torch, config.generator_dtype)
        return VideoGenerator.from_pretrained(config.generator_path, torch_dtype=dtype if dtype != torch.float32 else None)
    gen_config = preset_config(
        "tiny", num_frames=1, height=config.video_size, width=config.video_size, pixel_scale_temporal=1,
        pixel_scale_spatial=config.pixel_scale_spatial, num_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, attention_head_dim=config.attention_head_dim,
        ffn_dim=config.ffn_dim, text_dim=config.text_dim, max_sequence_length=config.max_text_tokens,
        time_distribution=config.time_distribution, rope_max_seq_len=max(64, len(config.slots)),
    )  # fmt: skip
    return VideoGenerator.from_config(gen_config, seed=config.seed)
