"""kinema's VLA: per-camera conv encoders conditioned on the instruction (FiLM), a word encoder, the state, and a
flow-matching action expert that denoises action chunks. Implements the RL core's `FlowPolicy` protocol.

Why this shape: a naive tiny policy never learns *where* the objects are (a prototype with per-camera convs,
mean-pooled word embeddings and an MLP flow head reached 0-10 % on pick-and-place from 10-200 demos on a 2-core CPU,
its gripper never within 12 cm of the target). Two things fix that here: the instruction modulates every conv stage
(FiLM), so "the red cube" changes what the encoder extracts, and an auxiliary head regresses privileged object
positions during SFT.

Batch convention (all tensors on the model's device):
    observation.images.<camera>: uint8 (B, H, W, 3) or float (B, 3, H, W) in [0, 1]
    observation.state:           (B, state_dim)
    task:                        list[str] of length B
    action:                      (B, chunk_size, action_dim) in [-1, 1]     (training only)
    action_is_pad:               bool (B, chunk_size), True past the episode end  (optional)
    aux_target:                  (B, aux_dim) privileged targets, already normalised (optional)
    where_target:                (B, cameras, 2, 2) where the named target and goal are in each image, in [-1, 1],
                                 NaN where unknown or out of view (optional; kinema.train.buffer.where_targets)
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffusion_rl.flow import (
    SDEStep,
    euler_sample,
    flow_matching_loss,
    interpolate,
    nft_loss,
    sample_time,
    sde_sample,
    sde_step_with_logprob,
    time_schedule,
    velocity_target,
)
from policies.acting import ChunkedActing, camera_images
from policies.vla.configuration_vla import VLAConfig
from policies.vla.smolvlm import BACKBONE_FILE, SmolVLMPrefix, check_backbone_record
from policies.vla.text import HashTokenizer, TextEncoder


class FiLMConvStack(nn.Module):
    """One camera's convs, each followed by GroupNorm and modulated by the instruction (FiLM, starting as the
    identity), over RGB plus two coordinate channels; `layers`: (kernel, stride, padding) of each conv. The encoders
    below differ in their layers and in how they pool the last feature map."""

    def __init__(self, config: VLAConfig, layers: list[tuple[int, int, int]]) -> None:
        super().__init__()
        chans = config.vision_channels
        convs, films = [], []
        in_ch = 5  # RGB + two coordinate channels: positions stay explicit whatever the pooling
        for out_ch, (kernel, stride, padding) in zip(chans, layers):
            convs.append(nn.Conv2d(in_ch, out_ch, kernel, stride, padding=padding))
            films.append(nn.Linear(config.text_dim, 2 * out_ch))
            in_ch = out_ch
        self.convs = nn.ModuleList(convs)
        self.norms = nn.ModuleList(nn.GroupNorm(min(8, c), c) for c in chans)
        self.films = nn.ModuleList(films)
        for film in self.films:  # start as identity modulation
            nn.init.zeros_(film.weight)
            nn.init.zeros_(film.bias)
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, config.image_size), torch.linspace(-1, 1, config.image_size), indexing="ij")
        self.register_buffer("coords", torch.stack([xs, ys])[None], persistent=False)

    # Trailing coordinate features of `forward`'s output (expected image (x, y) of attention maps), 0: none.
    where_dim = 0

    def inputs(self, image: Tensor) -> Tensor:
        """RGB in [-1, 1] and the two coordinate channels."""
        return torch.cat([image * 2 - 1, self.coords.expand(image.shape[0], -1, -1, -1)], dim=1)

    def feature_map(self, image: Tensor, text: Tensor) -> Tensor:
        x = self.inputs(image)
        for conv, norm, film in zip(self.convs, self.norms, self.films):
            gamma, beta = film(text).chunk(2, dim=-1)
            x = F.gelu(norm(conv(x)) * (1 + gamma[..., None, None]) + beta[..., None, None])
        return x


class FiLMConvEncoder(FiLMConvStack):
    """One camera: a stride-4 patchify conv, then 3x3 convs (stride 2, then 1), the last map flattened and projected."""

    def __init__(self, config: VLAConfig) -> None:
        n = len(config.vision_channels)
        super().__init__(config, [(4, 4, 0), *[(3, 2 if i == 1 else 1, 1) for i in range(1, n)]])
        side = config.image_size // 8
        self.project = nn.Sequential(nn.Flatten(), nn.Linear(config.vision_channels[-1] * side * side, config.vision_dim), nn.GELU())

    def forward(self, image: Tensor, text: Tensor, words: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        return self.project(self.feature_map(image, text))


def expected_coordinates(logits: Tensor, grid: Tensor) -> Tensor:
    """Spatial softmax: attention maps (B, K, H, W) -> each map's expected image coordinates (B, 2K), in [-1, 1]."""
    return (logits.flatten(2).softmax(dim=-1) @ grid).flatten(1)


def coordinate_grid(side: int) -> Tensor:
    """(side * side, 2) cell centres as (x, y) in [-1, 1], row-major as `flatten` lays out a map."""
    line = torch.linspace(-1, 1, side)
    return torch.stack(torch.meshgrid(line, line, indexing="xy"), -1).reshape(-1, 2)


class SpatialSoftmaxEncoder(FiLMConvStack):
    """One camera: overlapping 3x3 convs (the first two at stride 2, the rest at 1), then a spatial softmax
    (robomimic, Diffusion Policy) at image_size / 4: `keypoints` attention maps, each reduced to its expected image
    coordinates. A stride-4 patchify puts a 3-pixel cube inside one patch before any feature sees it; here it spans
    overlapping windows, and the softmax keeps *where* to below a cell."""

    def __init__(self, config: VLAConfig) -> None:
        n = len(config.vision_channels)
        super().__init__(config, [(3, 2 if i < 2 else 1, 1) for i in range(n)])
        self.keypoints = nn.Conv2d(config.vision_channels[-1], config.keypoints, 1)
        self.project = nn.Sequential(nn.Linear(2 * config.keypoints, config.vision_dim), nn.GELU())
        self.register_buffer("grid", coordinate_grid(config.image_size // 2 ** min(2, n)), persistent=False)

    def forward(self, image: Tensor, text: Tensor, words: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        return self.project(expected_coordinates(self.keypoints(self.feature_map(image, text)), self.grid))


class InstructionLocator(nn.Module):
    """Where the instruction's objects are in one camera's image. Each of `keypoints` learned role vectors attends
    over the instruction's words (the words naming the object, or the plate), the attended words become a query that
    scores every cell of a small conv map at image_size / `locator_stride` (overlapping 3x3 convs, so a 3-pixel cube
    is not cut by a patch border), and the softmax over cells gives the query's expected (x, y). Scoring cells against
    words is what grounds: trained as a classification of the cells around the named object (`cell_distribution`), it
    finds it among two to under 2 px within a few hundred steps, where FiLM-modulated keypoints never did; regressing
    its coordinates plateaus, and through a learned head it does not learn (benchmarks/localisation_probe.py --named)."""

    def __init__(self, config: VLAConfig) -> None:
        super().__init__()
        width = config.vision_channels[0]
        self.stem = nn.Sequential(
            nn.Conv2d(5, width, 3, 2, 1), nn.GroupNorm(min(8, width), width), nn.GELU(),
            nn.Conv2d(width, width, 3, config.locator_stride // 2, 1), nn.GroupNorm(min(8, width), width), nn.GELU(),
        )  # fmt: skip
        self.keys = nn.Conv2d(width, width, 1)
        self.roles = nn.Parameter(torch.randn(config.keypoints, config.text_dim) * 0.1)
        self.query = nn.Linear(config.text_dim, width)
        self.temperature = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("grid", coordinate_grid(config.image_size // config.locator_stride), persistent=False)

    def logits(self, inputs: Tensor, words: Tensor, mask: Tensor) -> Tensor:
        """`inputs` (B, 5, H, W): RGB and coordinates; `words` (B, W, D) and `mask` (B, W) from the word encoder.
        Returns each keypoint's score of every cell (B, keypoints, cells), cells row-major at image_size / locator_stride."""
        keys = self.keys(self.stem(inputs)).flatten(2)  # (B, width, cells)
        reading = torch.einsum("qd,bwd->bqw", self.roles, words).masked_fill(~mask[:, None], float("-inf")).softmax(-1)
        queries = self.query(reading @ words)  # (B, keypoints, width)
        return (queries @ keys) * (self.temperature * 4 / math.sqrt(keys.shape[1]))

    def cell_distribution(self, positions: Tensor) -> Tensor:
        """Each image position (x, y) in [-1, 1] (the convention of the coordinates and of the simulator's
        `privileged.*_pixels`) as weights (..., cells) on the four cells around it, bilinear in the grid's own
        coordinates: the distribution whose expected coordinates are the position itself, a keypoint's soft class
        label. A one-hot label on the cell holding the position trains the expected (x, y) to that cell's grid point:
        up to 2 px off at 64 px inside the image, 4 px at its borders (benchmarks/RESULTS.md)."""
        side = int(math.isqrt(self.grid.shape[0]))
        index = (positions.clamp(-1, 1) + 1) / 2 * (side - 1)  # continuous (column, row) on the grid
        low = index.floor().clamp(max=side - 2)
        frac, low = index - low, low.long()
        weights = torch.zeros(*positions.shape[:-1], side * side, device=positions.device, dtype=positions.dtype)
        for dy in (0, 1):
            for dx in (0, 1):
                cell = (low[..., 1] + dy) * side + low[..., 0] + dx
                w = (frac[..., 0] if dx else 1 - frac[..., 0]) * (frac[..., 1] if dy else 1 - frac[..., 1])
                weights.scatter_add_(-1, cell[..., None], w[..., None])
        return weights

    def cell_loss(self, logits: Tensor, positions: Tensor) -> Tensor:
        """Cross-entropy (...) of cell scores (..., cells) on the soft labels of `positions` (..., 2): what teaches
        a keypoint to point (the policy's `where_loss`, benchmarks/localisation_probe.py)."""
        return F.cross_entropy(logits.flatten(0, -2), self.cell_distribution(positions).flatten(0, -2), reduction="none").view(positions.shape[:-1])


class GroundedPatchifyEncoder(FiLMConvEncoder):
    """The patchify encoder's features (*what*), followed by an `InstructionLocator`'s coordinates (*where* the
    named things are). The coordinates stay raw at the end of the output (`where_dim` of them), so that
    `aux_input="keypoints"` can make the privileged-position head read them alone. The locator learns to point from
    the simulator's pixel labels (`VLAPolicy.where_loss`); through that head alone it did not (benchmarks/RESULTS.md)."""

    def __init__(self, config: VLAConfig) -> None:
        super().__init__(config)
        self.locator = InstructionLocator(config)
        self.where_dim = 2 * config.keypoints

    def forward(self, image: Tensor, text: Tensor, words: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        return self.forward_with_logits(image, text, words, mask)[0]

    def forward_with_logits(self, image: Tensor, text: Tensor, words: Tensor | None, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """The features and the locator's cell scores (B, keypoints, cells), what its cell classification trains."""
        if words is None or mask is None:
            raise ValueError("the patchify_grounded encoder reads the instruction's words: pass words and mask")
        logits = self.locator.logits(self.inputs(image), words, mask)
        where = expected_coordinates(logits, self.locator.grid)
        return torch.cat([self.project(self.feature_map(image, text)), where], dim=-1), logits


class AuxFeatures(NamedTuple):
    """What `VLAPolicy.encode` hands its auxiliary losses: the privileged head's input, and for cameras with an
    `InstructionLocator` its cell scores and how far augmentation moved that camera's image (B, 2) in [-1, 1] units,
    by which the pixel labels move too."""

    head: Tensor
    where_logits: dict[str, Tensor]
    shift: dict[str, Tensor]


POINT_DIM = 4  # what a camera's `state_points` add to the state: the target's (x, y), then the goal's

VISION_ENCODERS = {"patchify": FiLMConvEncoder, "spatial_softmax": SpatialSoftmaxEncoder, "patchify_grounded": GroundedPatchifyEncoder}


class SinusoidalTime(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, t: Tensor) -> Tensor:
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=t.dtype) / half)
        angles = (t[:, None] * 1000.0) * freqs[None]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ActionExpert(nn.Module):
    """v_θ(x_t, t | context): an MLP over the flattened noisy chunk, the time embedding and the observation feature."""

    def __init__(self, config: VLAConfig) -> None:
        super().__init__()
        flat = config.chunk_size * config.action_dim
        self.time = nn.Sequential(SinusoidalTime(64), nn.Linear(64, 128), nn.GELU())
        self.inp = nn.Linear(flat + 128 + config.hidden_dim, config.expert_hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(config.expert_hidden),
                nn.Linear(config.expert_hidden, config.expert_hidden),
                nn.GELU(),
                nn.Linear(config.expert_hidden, config.expert_hidden),
            )
            for _ in range(config.expert_layers - 1)
        )
        self.out = nn.Sequential(nn.LayerNorm(config.expert_hidden), nn.Linear(config.expert_hidden, flat))
        self.shape = (config.chunk_size, config.action_dim)
        self.config = config
        self.advantage: nn.Embedding | None = None
        if config.advantage_input:
            self.add_advantage_input()

    def add_advantage_input(self) -> None:
        """Recap's improvement indicator as an embedding added to the context, zero at first: the expert acts as
        before until it learns what the indicator means."""
        self.advantage = nn.Embedding(3, self.config.hidden_dim)
        nn.init.zeros_(self.advantage.weight)

    def forward(self, x_t: Tensor, t: Tensor, context: Tensor, advantage: Tensor | None = None) -> Tensor:
        """`advantage`: (B,) indicator per sample (diffusion_rl.recap: 0 unconditioned, 1 improvement, 2 not one);
        None: `config.advantage_condition`. Ignored by an expert without the indicator input."""
        if self.advantage is not None:
            if advantage is None:
                advantage = torch.full((x_t.shape[0],), self.config.advantage_condition, dtype=torch.long, device=x_t.device)
            context = context + self.config.advantage_scale * self.advantage(advantage.to(x_t.device).long())
        h = self.inp(torch.cat([x_t.flatten(1), self.time(t), context], dim=-1))
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).view(-1, *self.shape)


class VLAPolicy(ChunkedActing, nn.Module):
    """Vision-language-action policy with a flow-matching action expert (π0/SmolVLA family, CPU-sized).

    The observation prefix comes from one of two backbones, both ending in the same (B, hidden_dim) context:
    - "tiny": FiLM conv per camera + hashed-trigram words + state MLP, trained from scratch (the CPU default);
    - "smolvlm": a local SmolVLM/Idefics3 checkpoint with LoRA on its text model (`policies/vla/smolvlm.py`); its
      frozen base weights are referenced by `backbone_path`, never saved into our checkpoints.

    Normalisation statistics live in buffers, so they travel inside `model.safetensors` with the weights.
    """

    scales_initial_noise = True

    def __init__(self, config: VLAConfig, *, backbone_path: str | None = None) -> None:
        """`backbone_path` overrides `config.backbone_path` (a checkpoint moved to a machine where the backbone
        lives elsewhere); the checkpoint's backbone fingerprint is still checked against it on load."""
        super().__init__()
        if backbone_path and config.backbone == "smolvlm":
            config = dataclasses.replace(config, backbone_path=backbone_path)
        self.config = config
        self.prefix: SmolVLMPrefix | None = None
        if config.backbone == "smolvlm":
            self.prefix = SmolVLMPrefix(config)
        else:
            self.tokenizer = HashTokenizer(config.ngram_buckets, config.max_words)
            self.text = TextEncoder(config.ngram_buckets, config.text_dim, config.text_layers, config.max_words, positions=config.text_positions)
            self.vision = nn.ModuleDict({cam: VISION_ENCODERS[config.vision_encoder](config) for cam in config.cameras})
            points = POINT_DIM * len(config.state_points)
            self.state_mlp = nn.Sequential(nn.Linear(config.state_dim + points, config.state_hidden), nn.GELU())
            self.where_dim = sum(encoder.where_dim for encoder in self.vision.values())
            # the coordinates among the camera features: all but those of the cameras whose points go to the state
            self.fused_where_dim = sum(encoder.where_dim for cam, encoder in self.vision.items() if cam not in config.state_points)
            fused = config.vision_dim * len(config.cameras) + self.fused_where_dim + config.text_dim + config.state_hidden
            self.fuse = nn.Sequential(
                nn.Linear(fused, config.hidden_dim), nn.GELU(), nn.Linear(config.hidden_dim, config.hidden_dim), nn.GELU()
            )
        self.expert = ActionExpert(config)
        aux_in = config.hidden_dim
        if self.prefix is None and config.aux_input == "perception":
            aux_in = config.vision_dim * len(config.cameras) + self.fused_where_dim + config.text_dim
        elif self.prefix is None and config.aux_input == "keypoints":
            aux_in = self.where_dim
        self.aux_head = (
            nn.Sequential(nn.Linear(aux_in, config.hidden_dim), nn.GELU(), nn.Linear(config.hidden_dim, config.aux_dim))
            if config.aux_dim
            else None
        )
        self.register_buffer("state_mean", torch.zeros(config.state_dim))
        self.register_buffer("state_std", torch.ones(config.state_dim))
        self.register_buffer("aux_mean", torch.zeros(max(config.aux_dim, 1)))
        self.register_buffer("aux_std", torch.ones(max(config.aux_dim, 1)))
        if config.state_points:  # the pixel labels' statistics normalise the points the state carries
            self.register_buffer("points_mean", torch.zeros(POINT_DIM * len(config.state_points)))
            self.register_buffer("points_std", torch.ones(POINT_DIM * len(config.state_points)))
        self._queue: deque[np.ndarray] = deque()

    # ----- normalisation ----------------------------------------------------------------------------------------
    def set_normalization(self, stats: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        """Take mean/std of `observation.state` (and `aux`) from dataset stats (`load_stats` or computed)."""
        state = stats["observation.state"]
        self.state_mean.copy_(torch.as_tensor(np.asarray(state["mean"]).reshape(-1), dtype=torch.float32))
        self.state_std.copy_(torch.as_tensor(np.asarray(state["std"]).reshape(-1), dtype=torch.float32).clamp(min=1e-3))
        if self.config.aux_dim and "aux" in stats:
            self.aux_mean.copy_(torch.as_tensor(np.asarray(stats["aux"]["mean"]).reshape(-1), dtype=torch.float32))
            self.aux_std.copy_(torch.as_tensor(np.asarray(stats["aux"]["std"]).reshape(-1), dtype=torch.float32).clamp(min=1e-3))
        for c, cam in enumerate(self.config.state_points):
            if (labels := stats.get(f"where_target.{cam}")) is not None:
                self.points_mean[c * POINT_DIM : (c + 1) * POINT_DIM] = torch.as_tensor(np.asarray(labels["mean"]).reshape(-1), dtype=torch.float32)
                self.points_std[c * POINT_DIM : (c + 1) * POINT_DIM] = torch.as_tensor(np.asarray(labels["std"]).reshape(-1), dtype=torch.float32).clamp(min=1e-3)

    # ----- encoders ----------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.state_mean.device

    def _image(self, batch: Mapping[str, Any], cam: str) -> tuple[Tensor, Tensor]:
        """The camera's images (B, 3, H, W), randomly shifted in training, and the shift (B, 2) of their content."""
        img = camera_images(batch, f"observation.images.{cam}", self.config.image_size, self.device, self.config.cameras)
        if self.training and self.config.augment_shift:
            return random_shift(img, self.config.augment_shift)
        return img, img.new_zeros(img.shape[0], 2)

    def features(self, batch: Mapping[str, Any]) -> Tensor:
        """The fused observation feature (B, hidden_dim): what the action expert, the critics and the success model read."""
        return self.encode(batch)[0]

    def encode(self, batch: Mapping[str, Any]) -> tuple[Tensor, AuxFeatures]:
        """(fused feature, what the auxiliary losses read): the aux head reads the camera + instruction features
        without the state (`aux_input="perception"`), the cameras' keypoint coordinates alone ("keypoints"), or the
        fused feature itself ("fused", and always with a VLM prefix)."""
        state = (torch.as_tensor(batch["observation.state"], device=self.device, dtype=torch.float32) - self.state_mean) / self.state_std
        if self.training and self.config.state_dropout:
            # Hide the end-effector pose (keep the gripper): the action head must find the target in the images
            # instead of continuing the arm's current heading.
            drop = torch.rand(state.shape[0], 1, device=self.device) < self.config.state_dropout
            pose = torch.zeros_like(state, dtype=torch.bool)
            pose[:, : min(7, state.shape[1] - 1)] = True
            state = state.masked_fill(drop & pose, 0.0)
        images = {cam: self._image(batch, cam) for cam in self.config.cameras}
        if self.prefix is not None:
            context = self.prefix([images[cam][0] for cam in self.config.cameras], list(batch["task"]), state)
            return context, AuxFeatures(context, {}, {})
        # Word-order augmentations of the instruction, in training only (off by default: VLAConfig).
        ids, mask = self.tokenizer(list(batch["task"]), self.device, filler_words=self.config.text_filler_words if self.training else 0.0)
        words, text = self.text(ids, mask, jitter_positions=self.training and self.config.text_position_jitter)
        if self.config.instruction_input == "locator":
            text = torch.zeros_like(text)  # the locators read `words`; FiLM and the fused feature see a constant
        cameras, logits, where, points = [], {}, [], []
        for cam in self.config.cameras:
            encoder, (image, _) = self.vision[cam], images[cam]
            if encoder.where_dim:
                features, logits[cam] = encoder.forward_with_logits(image, text, words, mask)
                where.append(features[:, features.shape[1] - encoder.where_dim :])
                if cam in self.config.state_points:
                    # keypoints 0 and 1 (target, goal) in the unshifted image: the augmentation's shift moves the points
                    # with the image, and would tell the head the object is up to `augment_shift` pixels off
                    points.append((where[-1][:, :POINT_DIM] - images[cam][1].repeat(1, 2)).detach())
                    if self.training and self.config.state_points_training == "labels" and "where_target" in batch:
                        labels = torch.as_tensor(batch["where_target"], device=self.device, dtype=torch.float32)
                        labels = labels[:, self.config.cameras.index(cam), :2].reshape(-1, POINT_DIM)
                        points[-1] = torch.where(torch.isfinite(labels), labels, points[-1])  # located where out of view
                    features = features[:, : features.shape[1] - encoder.where_dim]
            else:
                features = encoder(image, text, words, mask)
            cameras.append(features)
        if points:
            state = torch.cat([state, (torch.cat(points, dim=-1) - self.points_mean) / self.points_std], dim=-1)
        perception = torch.cat([*cameras, text], dim=-1)
        context = self.fuse(torch.cat([perception, self.state_mlp(state)], dim=-1))
        if self.config.aux_input == "keypoints":
            head = torch.cat(where, dim=-1)
        else:
            head = perception if self.config.aux_input == "perception" else context
        return context, AuxFeatures(head, logits, {cam: images[cam][1] for cam in logits})

    # ----- training ------------------------------------------------------------------------------------------------
    def flow_loss(
        self,
        batch: Mapping[str, Any],
        *,
        weights: Tensor | None = None,
        targets: Mapping[str, Tensor] | None = None,
        context: Tensor | None = None,
    ) -> Tensor:
        """Per-sample conditional flow-matching loss (B,) on the action chunk (padded steps masked)."""
        actions = torch.as_tensor(batch["action"], device=self.device, dtype=torch.float32)
        B = actions.shape[0]
        context = self.features(batch) if context is None else context
        t = batch.get("t")
        t = sample_time(B, distribution=self.config.time_distribution, device=self.device) if t is None else t
        noise = batch.get("noise")
        noise = torch.randn_like(actions) if noise is None else noise
        x_t = interpolate(actions, noise, t)
        v = self.expert(x_t, t, context, self._training_indicator(batch))
        target = velocity_target(actions, noise)
        if targets is not None and "velocity" in targets:
            target = targets["velocity"]
        elif targets is not None and "x0" in targets:
            target = velocity_target(targets["x0"], noise)
        pad = batch.get("action_is_pad")
        mask = None if pad is None else ~torch.as_tensor(pad, device=self.device)
        return flow_matching_loss(v, target, weights=weights, mask=mask)

    def _training_indicator(self, batch: Mapping[str, Any]) -> Tensor | None:
        """The batch's Recap indicator (`advantage_indicator`), dropped to unconditioned for `advantage_dropout` of
        the samples in training; None without one (the expert then reads `advantage_condition`)."""
        indicator = batch.get("advantage_indicator")
        if indicator is None or self.expert.advantage is None:
            return None
        indicator = torch.as_tensor(indicator, device=self.device).long()
        if self.training and self.config.advantage_dropout:
            dropped = torch.rand(indicator.shape, device=self.device) < self.config.advantage_dropout
            indicator = indicator.masked_fill(dropped, 0)
        return indicator

    def add_advantage_input(self) -> None:
        """Give an SFT policy Recap's improvement-indicator input (zero-initialised: it acts as before); its config
        records it, so that its checkpoints load with it."""
        if self.expert.advantage is None:
            self.config.advantage_input = True
            self.expert.add_advantage_input()
            self.expert.advantage.to(self.device)

    def nft_loss(
        self,
        batch: Mapping[str, Any],
        *,
        old: VLAPolicy,
        r: Tensor,
        beta: float = 1.0,
        adv_clip_max: float = 5.0,
        context: Tensor | None = None,
        space: str = "x0_adaptive",
    ) -> Tensor:
        """Per-sample DiffusionNFT loss (B,) on recorded action chunks (`diffusion_rl.flow.nft_loss`): `old` is the
        policy that sampled them, `r` (B,) the positive-branch weight (1: imitate, as a demo; 0: move away from);
        `space` the loss's form (the official x0_adaptive, or the textbook velocity MSE)."""
        actions = torch.as_tensor(batch["action"], device=self.device, dtype=torch.float32)
        context = self.features(batch) if context is None else context
        t = sample_time(actions.shape[0], distribution=self.config.time_distribution, device=self.device)
        x_t = interpolate(actions, torch.randn_like(actions), t)
        with torch.no_grad():
            v_old = old.expert(x_t, t, old.features(batch))
        pad = batch.get("action_is_pad")
        mask = None if pad is None else ~torch.as_tensor(pad, device=self.device)
        return nft_loss(
            self.expert(x_t, t, context), v_old, x_t=x_t, x0=actions, t=t, r=r.to(self.device), beta=beta,
            adv_clip_max=adv_clip_max, mask=mask, space=space,
        )  # fmt: skip

    def aux_loss(self, batch: Mapping[str, Any], aux_features: AuxFeatures) -> Tensor:
        """Per-sample auxiliary loss (B,), `aux_features` being `encode(batch)[1]`: the privileged-position head's MSE
        on normalised targets, plus `where_weight` x the locators' cell classification (`where_loss`)."""
        loss = torch.zeros(aux_features.head.shape[0], device=self.device)
        if self.aux_head is not None and "aux_target" in batch:
            target = (torch.as_tensor(batch["aux_target"], device=self.device) - self.aux_mean) / self.aux_std
            loss = loss + (self.aux_head(aux_features.head) - target).pow(2).mean(-1)
        if self.config.where_weight and aux_features.where_logits and "where_target" in batch:
            loss = loss + self.config.where_weight * self.where_loss(batch, aux_features)
        return loss

    def where_loss(self, batch: Mapping[str, Any], aux_features: AuxFeatures) -> Tensor:
        """Per-sample cross-entropy (B,) of each grounded camera's keypoints 0 and 1 on the cells around the named
        target and goal (`where_target`, moved with the image's augmentation shift; soft labels:
        `InstructionLocator.cell_loss`), averaged over the labels in view; 0 for a sample with none. Classifying
        cells is what teaches the locator to point (benchmarks/localisation_probe.py --named): regressing its
        coordinates plateaus."""
        target = torch.as_tensor(batch["where_target"], device=self.device, dtype=torch.float32)
        total = torch.zeros(target.shape[0], device=self.device)
        count = torch.zeros_like(total)
        for c, cam in enumerate(self.config.cameras):
            if cam not in aux_features.where_logits:
                continue
            logits = aux_features.where_logits[cam]
            roles = min(logits.shape[1], target.shape[2])
            xy = target[:, c, :roles] + aux_features.shift[cam][:, None]
            valid = torch.isfinite(xy).all(-1) & (xy.abs() <= 1).all(-1)  # (B, roles)
            ce = self.vision[cam].locator.cell_loss(logits[:, :roles], torch.nan_to_num(xy))
            total = total + (ce * valid).sum(-1)
            count = count + valid.sum(-1)
        return total / count.clamp(min=1)

    # ----- inference -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def predict_action_chunk(self, batch: Mapping[str, Any], *, noise: Tensor | None = None, context: Tensor | None = None) -> Tensor:
        """Denoise a chunk (B, chunk_size, action_dim) with K Euler steps from t = 1 (noise) to 0; without `noise`,
        from a standard normal draw times `config.inference_noise_scale`. `context`: the batch's `features`, when the
        caller has them (several chunks sampled per observation encode it once)."""
        context = self.features(batch) if context is None else context
        B = context.shape[0]
        if noise is None:
            noise = torch.randn(B, self.config.chunk_size, self.config.action_dim, device=self.device) * self.config.inference_noise_scale
        beta = self.config.advantage_guidance
        if self.expert.advantage is not None and beta != 1.0:  # classifier-free guidance on the indicator asked for
            asked = torch.full((B,), self.config.advantage_condition, dtype=torch.long, device=self.device)
            plain = torch.zeros_like(asked)

            def velocity(x: Tensor, t: Tensor) -> Tensor:
                v_plain = self.expert(x, t, context, plain)
                return v_plain + beta * (self.expert(x, t, context, asked) - v_plain)
        else:
            velocity = lambda x, t: self.expert(x, t, context)  # noqa: E731
        chunk = euler_sample(velocity, noise, num_steps=self.config.num_flow_steps)
        return chunk.clamp(-1.0, 1.0)

    def sample_chunk_sde(
        self, batch: Mapping[str, Any], *, noise_level: float = 0.7
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Sample a chunk with Flow-SDE steps (`diffusion_rl.flow.sde_sample`: every step stochastic, the last one
        included, as in Flow-GRPO), recording every step for PPO/GRPO (the πRL baseline).

        Returns the chunk and {"x_t": (B, K, H, A), "t": (K,), "t_next": (K,), "x_next": (B, K, H, A),
        "log_prob": (B, K)}.
        """
        with torch.no_grad():
            context = self.features(batch)
            B = context.shape[0]
            noise = torch.randn(B, self.config.chunk_size, self.config.action_dim, device=self.device)
            sched = time_schedule(self.config.num_flow_steps, device=self.device)
            x, states, nexts, log_probs = sde_sample(
                lambda x, t: self.expert(x, t, context), noise, schedule=sched, noise_level=noise_level
            )
        record = {
            "x_t": states.transpose(0, 1),
            "t": sched[:-1],
            "t_next": sched[1:],
            "x_next": nexts.transpose(0, 1),
            "log_prob": log_probs.transpose(0, 1),
        }
        return x.clamp(-1.0, 1.0), record

    def sde_log_prob(self, batch: Mapping[str, Any], *, noise_level: float = 0.7, context: Tensor | None = None) -> SDEStep:
        """Log-prob (B,) of the recorded step x_t -> x_next at times (t, t_next) under the current model."""
        context = self.features(batch) if context is None else context
        v = self.expert(batch["x_t"], batch["t"], context)
        return sde_step_with_logprob(v, batch["x_t"], batch["t"], batch["t_next"], noise_level=noise_level, prev_sample=batch["x_next"])

    # ----- persistence -----------------------------------------------------------------------------------------------
    def save_pretrained(self, directory: str, *, extra_files: Mapping[str, bytes] | None = None) -> None:
        from policies.checkpoint import save_checkpoint

        extra = dict(extra_files or {})
        config = self.config.to_dict()
        if self.prefix is not None:
            # The backbone is referenced, not copied (state_dict() holds only its LoRA weights): record which one.
            record = self.prefix.describe()
            extra[BACKBONE_FILE] = json.dumps(record, indent=2).encode()
        save_checkpoint(directory, config, self.state_dict(), extra_files=extra)

    @classmethod
    def from_pretrained(cls, directory: str, *, map_location: str = "cpu", backbone_path: str | None = None) -> VLAPolicy:
        """Load a checkpoint. For a "smolvlm" policy the backbone is read from `backbone_path`, or from the path in
        the checkpoint's config.json, and must be the one it was trained on (its fingerprint is compared)."""
        from policies.checkpoint import load_checkpoint

        config_dict, state = load_checkpoint(directory, map_location=map_location)
        config = VLAConfig.from_dict(config_dict)
        model = cls(config, backbone_path=backbone_path)
        if model.prefix is not None:
            record_file = Path(directory) / BACKBONE_FILE
            if not record_file.is_file():
                raise FileNotFoundError(f"{directory} is a smolvlm-backbone checkpoint without {BACKBONE_FILE}")
            check_backbone_record(json.loads(record_file.read_text()), model.prefix, source=directory)
        model.load_state_dict_checked(state, source=directory)
        return model

    def load_state_dict_checked(self, state: Mapping[str, Tensor], *, source: str) -> None:
        from policies.checkpoint import state_dict_mismatch

        if mismatch := state_dict_mismatch(self.state_dict(), state):
            raise ValueError(f"checkpoint {source} does not match this VLA architecture: {mismatch}")
        self.load_state_dict(state)


def random_shift(images: Tensor, pad: int) -> tuple[Tensor, Tensor]:
    """DrQ-style augmentation: pad by replicating edges, crop back at a random offset per sample. Returns the images
    and how far their content moved, (B, 2) as (x, y) in [-1, 1] units (a label at p is at p + shift after it)."""
    B, C, H, W = images.shape
    padded = F.pad(images, (pad, pad, pad, pad), mode="replicate")
    dx = torch.randint(0, 2 * pad + 1, (B,), device=images.device)
    dy = torch.randint(0, 2 * pad + 1, (B,), device=images.device)
    rows = (dy[:, None] + torch.arange(H, device=images.device)[None])  # (B, H)
    cols = (dx[:, None] + torch.arange(W, device=images.device)[None])  # (B, W)
    idx_b = torch.arange(B, device=images.device)[:, None, None]
    shifted = padded.permute(0, 2, 3, 1)[idx_b, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
    shift = torch.stack([(pad - dx) * 2.0 / W, (pad - dy) * 2.0 / H], dim=-1).to(images.dtype)
    return shifted, shift
