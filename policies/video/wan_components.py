"""kinema's two diffusers components, self-contained: this file imports only torch and diffusers.

It is copied verbatim into the component folders of every generator kinema saves (`transformer/`, `vae/`, under a
name with its content hash, `kinema_video_<hash>.py`) and `model_index.json` names it, so that stock diffusers loads
the folder without kinema: `WanPipeline.from_pretrained(dir, trust_remote_code=True)` (diffusers runs a component's
own code only when asked to). kinema itself imports the classes from here (`policies.video.modeling_wan`).

- `WanX0Transformer3DModel`: a `WanTransformer3DModel` whose network predicts the clean sample x̂_0 and whose
  `forward` returns the velocity v = (x_t − x̂_0)/max(t, ε). `WanPipeline` and the Euler scheduler only ever see a
  velocity, so the standard sampling path is unchanged; the raw x̂_0 is `forward_native`. (Loading its folder as a
  plain `WanTransformer3DModel` only warns about the extra config keys, and would read x̂_0 as v: it cannot be
  saved under diffusers' own class name.)
- `PixelSpaceAutoencoder`: a parameter-free, exactly invertible stand-in for `AutoencoderKLWan` that folds
  (temporal x spatial x spatial) pixel blocks into channels. It has the Wan VAE's causal layout (frame 0 alone,
  then groups of `scale_factor_temporal` frames) and its config keys (z_dim, latents_mean/std, scale factors), so
  `WanPipeline` decodes through it unchanged. Frame 0 is repeated to fill its group; decoding averages the copies.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import WanTransformer3DModel
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import DecoderOutput, DiagonalGaussianDistribution
from diffusers.models.modeling_outputs import AutoencoderKLOutput, Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from torch import Tensor

__all__ = ["PixelSpaceAutoencoder", "WanX0Transformer3DModel", "velocity_from_x0"]


def velocity_from_x0(x_t: Tensor, x0_hat: Tensor, t: Tensor, *, eps: float = 1e-3) -> Tensor:
    """v = (x_t − x̂_0) / max(t, eps), t (B,) or already of x_t's rank: `diffusion_rl.flow.velocity_from_x0`,
    restated so that this file needs nothing but torch and diffusers (a test checks that the two agree)."""
    tt = torch.as_tensor(t, dtype=x_t.dtype, device=x_t.device)
    tt = tt if tt.dim() == x_t.dim() else tt.reshape(-1, *([1] * (x_t.dim() - 1)))
    return (x_t - x0_hat) / tt.clamp_min(eps)


class WanX0Transformer3DModel(WanTransformer3DModel):
    """Wan transformer with clean-sample prediction; `forward` converts it to the flow velocity.

    Args (beyond `WanTransformer3DModel`'s):
        prediction_type: "x0" (the network outputs x̂_0) or "velocity" (it outputs v; then this class is a plain
            Wan transformer).
        x0_min_t: ε in v = (x_t − x̂_0)/max(t, ε): keeps the last sampling step finite.
        num_train_timesteps: the scheduler's timestep scale (timestep = t · num_train_timesteps).
    """

    @register_to_config
    def __init__(
        self,
        patch_size: tuple[int, ...] = (1, 2, 2),
        num_attention_heads: int = 40,
        attention_head_dim: int = 128,
        in_channels: int = 16,
        out_channels: int = 16,
        text_dim: int = 4096,
        freq_dim: int = 256,
        ffn_dim: int = 13824,
        num_layers: int = 40,
        cross_attn_norm: bool = True,
        qk_norm: str | None = "rms_norm_across_heads",
        eps: float = 1e-6,
        image_dim: int | None = None,
        added_kv_proj_dim: int | None = None,
        rope_max_seq_len: int = 1024,
        pos_embed_seq_len: int | None = None,
        prediction_type: str = "x0",
        x0_min_t: float = 1e-3,
        num_train_timesteps: int = 1000,
    ) -> None:
        if prediction_type not in ("x0", "velocity"):
            raise ValueError(f"prediction_type must be 'x0' or 'velocity'; got {prediction_type!r}")
        super().__init__(
            patch_size=patch_size,
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            in_channels=in_channels,
            out_channels=out_channels,
            text_dim=text_dim,
            freq_dim=freq_dim,
            ffn_dim=ffn_dim,
            num_layers=num_layers,
            cross_attn_norm=cross_attn_norm,
            qk_norm=qk_norm,
            eps=eps,
            image_dim=image_dim,
            added_kv_proj_dim=added_kv_proj_dim,
            rope_max_seq_len=rope_max_seq_len,
            pos_embed_seq_len=pos_embed_seq_len,
        )

    def forward_native(
        self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor, **kwargs: Any
    ) -> Tensor:
        """The network's own output (x̂_0 for prediction_type "x0"), (B, C, F, h, w)."""
        kwargs["return_dict"] = False
        return super().forward(hidden_states, timestep, encoder_hidden_states, **kwargs)[0]

    def forward(
        self,
        hidden_states: Tensor,
        timestep: Tensor,
        encoder_hidden_states: Tensor,
        encoder_hidden_states_image: Tensor | None = None,
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
    ) -> Tensor | Transformer2DModelOutput:
        out = self.forward_native(
            hidden_states,
            timestep,
            encoder_hidden_states,
            encoder_hidden_states_image=encoder_hidden_states_image,
            attention_kwargs=attention_kwargs,
        )
        if self.config.prediction_type == "x0":
            t = timestep.to(torch.float32) / self.config.num_train_timesteps
            if t.ndim == 2:  # per-token timesteps (Wan2.2 ti2v), constant within a latent frame: (B, 1, F, 1, 1)
                frames = hidden_states.shape[2]
                if self.config.patch_size[0] != 1 or t.shape[1] % frames:
                    raise ValueError(f"x0 prediction takes per-token timesteps only as one time per latent frame "
                                     f"(temporal patch 1); got {tuple(t.shape)} tokens for {frames} frames")
                t = t.view(t.shape[0], frames, -1)[:, :, 0][:, None, :, None, None]
            out = velocity_from_x0(hidden_states.float(), out.float(), t, eps=self.config.x0_min_t).to(out.dtype)
        return (out,) if not return_dict else Transformer2DModelOutput(sample=out)


class PixelSpaceAutoencoder(ModelMixin, ConfigMixin):
    """An exact "VAE" for pixel-space flow models.

    (B, 3, T·k + 1, H, W) in [-1, 1] <-> (B, 3·T·S², k + 1, H/S, W/S).

    Channel order of a latent voxel: (colour, frame-in-group, row-in-block, column-in-block).
    """

    @register_to_config
    def __init__(
        self,
        in_channels: int = 3,
        scale_factor_temporal: int = 4,
        scale_factor_spatial: int = 2,
        z_dim: int | None = None,
        latents_mean: list[float] | None = None,
        latents_std: list[float] | None = None,
    ) -> None:
        super().__init__()
        expected = in_channels * scale_factor_temporal * scale_factor_spatial**2
        if z_dim is not None and z_dim != expected:
            raise ValueError(f"PixelSpaceAutoencoder z_dim must be {expected} (channels x T x S²); got {z_dim}")
        # WanPipeline reads these keys: unit normalisation keeps latents = pixels in [-1, 1].
        self.register_to_config(
            z_dim=expected,
            latents_mean=list(latents_mean) if latents_mean is not None else [0.0] * expected,
            latents_std=list(latents_std) if latents_std is not None else [1.0] * expected,
        )
        # A buffer gives the module a dtype and a device for diffusers' accounting, and (persistent) a weights file,
        # without which diffusers' from_pretrained refuses the folder. It carries no information.
        self.register_buffer("anchor", torch.zeros(()))

    def _fold(self, x: Tensor) -> Tensor:
        T, S = self.config.scale_factor_temporal, self.config.scale_factor_spatial
        B, C, F, H, W = x.shape
        if (F - 1) % T or H % S or W % S:
            raise ValueError(f"PixelSpaceAutoencoder needs frames {T}k + 1 and sizes divisible by {S}; got {(F, H, W)}")
        x = torch.cat([x[:, :, :1].expand(B, C, T - 1, H, W), x], dim=2)  # frame 0 fills its own group
        k = x.shape[2] // T
        x = x.reshape(B, C, k, T, H // S, S, W // S, S).permute(0, 1, 3, 5, 7, 2, 4, 6)
        return x.reshape(B, C * T * S * S, k, H // S, W // S)

    def _unfold(self, z: Tensor) -> Tensor:
        T, S, C = self.config.scale_factor_temporal, self.config.scale_factor_spatial, self.config.in_channels
        B, Z, k, h, w = z.shape
        if Z != C * T * S * S:
            raise ValueError(f"PixelSpaceAutoencoder latents need {C * T * S * S} channels; got {Z}")
        x = z.reshape(B, C, T, S, S, k, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(B, C, k * T, h * S, w * S)
        first = x[:, :, :T].mean(dim=2, keepdim=True)  # the repeated copies of frame 0
        return torch.cat([first, x[:, :, T:]], dim=2)

    def encode(self, x: Tensor, return_dict: bool = True) -> AutoencoderKLOutput | tuple:
        z = self._fold(x)
        dist = DiagonalGaussianDistribution(torch.cat([z, torch.zeros_like(z)], dim=1), deterministic=True)
        return AutoencoderKLOutput(latent_dist=dist) if return_dict else (dist,)

    def decode(self, z: Tensor, return_dict: bool = True) -> DecoderOutput | tuple:
        x = self._unfold(z)
        return DecoderOutput(sample=x) if return_dict else (x,)

    def forward(self, sample: Tensor, return_dict: bool = True) -> DecoderOutput | tuple:
        return self.decode(self.encode(sample).latent_dist.mode(), return_dict=return_dict)
