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
        return (s - self.state_mean) / self.state_std * STATE_SCALE

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
        loss), in the model's prediction space. modes: (B,) conditioning modes, default policy mode.

        targets: {"x0": (B, H, A)} replaces the action chunk's target (AWR's x_0*), {"x0": (B, C, S, h, w)} or
        {"velocity": (B, C, S, h, w)} the whole sequence's."""
        ctx = self.encode(batch)[0] if context is None else context
        x0, known, elements = self.target_latents(batch, ctx)
        B = x0.shape[0]
        modes = torch.full((B,), POLICY, device=self.device) if modes is None else modes
        given = self.given_slots(modes)
        t = batch.get("t")
        t = flow.sample_time(B, distribution=self.config.time_distribution, device=self.device) if t is None else torch.as_tensor(t, device=self.device, dtype=torch.float32)
        noise = batch.get("noise")
        noise = torch.randn_like(x0) if noise is None else noise.to(x0)
        g = given[:, None, :, None, None]
        x_t = torch.where(g, x0, flow.interpolate(x0, noise, t))
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
        if self.generator.config.prediction == "x0":
            pred = self.generator.x0_pred(x_t, t, ctx.prompt)
            target = flow.x0_from_velocity(x_t, targets["velocity"].to(x_t), t) if "velocity" in targets else target_x0
        else:
            pred = self.generator.velocity(x_t, t, ctx.prompt)
            target = targets["velocity"].to(x_t) if "velocity" in targets else flow.velocity_target(target_x0, noise)
        mask = (~g & known[:, None, :, None, None]) & elements
        return flow.flow_matching_loss(pred, target.detach(), weights=weights, mask=mask)

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
            v = self.generator.velocity(torch.where(g, known, x), t, prompt)
            return torch.where(g, torch.zeros_like(v), v)

        return fn

    def sample(self, ctx: Context, known: Tensor, mode: int, noise: Tensor) -> Tensor:
        """Denoise the slots `mode` generates, the given ones held at `known`: (B, C, S, h, w)."""
        given = self.given_slots(torch.full((noise.shape[0],), mode, device=self.device))
        g = given[:, None, :, None, None]
        schedule = flow.time_schedule(self.config.num_flow_steps, shift=self.generator.config.flow_shift, device=self.device)
        return flow.euler_sample(self._velocity_fn(known, given, ctx.prompt), torch.where(g, known, noise), schedule=schedule)

    def _noise(self, rows: int, seeds: list[int] | None) -> Tensor:
        """(rows, C, S, h, w) standard normal; each row drawn from its own seed when given (paired evaluations)."""
        shape = (self.frame_shape[0], len(self.config.slots), *self.frame_shape[1:])
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

        Returns "chunks" (B, N, H, A), "values" (B, N), "best" (B,), "latents" (B, N, C, S, h, w)."""
        cfg = self.config
        n = int(candidates or cfg.planning_candidates)
        ctx = self.encode(batch)[0]
        B = ctx.state.shape[0]
        rep = self._repeat(ctx, n)
        known, _, _ = self.target_latents({}, rep)
        latents = self.sample(rep, known, POLICY, self._noise(B * n, self._row_seeds(noise, n, 0)))
        values = self.decode_values(latents[:, :, self.slot_index["value"]])
        if n > 1 and cfg.planning_value == "world":
            values = self._world_values(rep, latents, noise, n)
        values = values.view(B, n)
        best = values.argmax(dim=1)
        chunks = self.decode_actions(latents[:, :, self.slot_index["action"]]).view(B, n, cfg.chunk_size, cfg.action_dim)
        return {"chunks": chunks.clamp(-1.0, 1.0), "values": values, "best": best, "latents": latents.view(B, n, *latents.shape[1:])}

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
        self.last_prediction = {
            "value": out["values"][rows, out["best"]],
            "values": out["values"],
            "future": {c: chosen[:, :, self.slot_index[f"future.{c}"]] for c in self.config.cameras},
        }
        return out["chunks"][rows, out["best"]]

    def predicted_future_images(self) -> dict[str, Tensor]:
        """The last chunk's predicted future frame per camera, (B, 3, video_size, video_size) in [0, 1]."""
        if self.last_prediction is None:
            raise RuntimeError("no prediction yet: call predict_action_chunk first")
        return {c: self.decode_images(z) for c, z in self.last_prediction["future"].items()}

    def sde_log_prob(self, batch: Mapping[str, Any], *, noise_level: float = 0.7, context: Context | None = None) -> SDEStep:
        """Flow-SDE log-prob (B,) of a recorded policy-mode step x_t -> x_next over the whole latent sequence
        (batch "x_t", "t", "t_next", "x_next" of shape (B, C, S, h, w)); the given slots do not move."""
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
