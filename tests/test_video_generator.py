"""The diffusers video generator wrapper (policies/video): tiny Wan stacks built offline, on CPU."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from diffusion_rl.protocol import FlowPolicy  # noqa: E402
from policies.video.configuration_video import VideoGeneratorConfig, preset_config  # noqa: E402
from policies.video.generator import BASE, VideoGenerator  # noqa: E402
from policies.video.tokenizer import build_tokenizer  # noqa: E402

PROMPTS = ["pick up the red cube", "push the blue block into the green square"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def gen() -> VideoGenerator:
    return VideoGenerator.from_preset("tiny", seed=0)


def _randomise_adapter(g: VideoGenerator, name: str, seed: int, scale: float = 0.05) -> None:
    # LoRA starts as a no-op (B = 0); give it weights so that adapters differ measurably.
    gen_ = torch.Generator().manual_seed(seed)
    g.load_adapter_state_dict(
        name, {k: torch.randn(v.shape, generator=gen_) * scale for k, v in g.adapter_state_dict(name).items()}
    )


def _default_and_old(g: VideoGenerator) -> None:
    """Adapters "default" (active) and "old", with different random weights."""
    g.add_adapter("default")
    _randomise_adapter(g, "default", seed=5)
    g.copy_adapter("default", "old")
    _randomise_adapter(g, "old", seed=6)


def _batch(g: VideoGenerator, seed: int = 0) -> dict[str, torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)
    x0 = torch.rand(2, *g.latent_shape(2)[1:], generator=rng) * 2 - 1
    return {
        "x0": x0,
        "prompt_embeds": g.encode_prompts(PROMPTS),
        "t": torch.tensor([0.3, 0.8]),
        "noise": torch.randn(x0.shape, generator=rng),
    }


# ---------------------------------------------------------------------------------------------------------------
# Sampling through WanPipeline
# ---------------------------------------------------------------------------------------------------------------


def test_pipeline_generation_without_cfg_shape_range_determinism(gen):
    a = gen.generate(PROMPTS, num_inference_steps=3, seed=7)
    b = gen.generate(PROMPTS, num_inference_steps=3, seed=7)
    c = gen.generate(PROMPTS, num_inference_steps=3, seed=8)
    assert a.shape == (2, 9, 3, 32, 32)
    assert a.dtype == torch.float32 and a.min() >= 0.0 and a.max() <= 1.0
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-3


def test_cfg_calls_the_transformer_twice_per_step_and_changes_the_sample(gen):
    calls = []
    handle = gen.transformer.register_forward_hook(lambda *args: calls.append(1))
    try:
        free = gen.generate(PROMPTS, num_inference_steps=3, seed=1)
        n_free = len(calls)
        guided = gen.generate(PROMPTS, num_inference_steps=3, seed=1, guidance_scale=4.0)
        n_guided = len(calls) - n_free
    finally:
        handle.remove()
    assert (n_free, n_guided) == (3, 6)
    assert guided.shape == free.shape and guided.min() >= 0 and guided.max() <= 1
    assert torch.equal(guided, gen.generate(PROMPTS, num_inference_steps=3, seed=1, guidance_scale=4.0))
    assert (guided - free).abs().max() > 1e-3


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_euler_sample_equals_pipeline_latents(gen, guidance):
    gen.add_adapter("default")
    _randomise_adapter(gen, "default", seed=3)
    videos, latents = gen.generate(PROMPTS, num_inference_steps=4, seed=5, guidance_scale=guidance,
                                   return_latents=True)
    ours = gen.euler_sample(gen.encode_prompts(PROMPTS), num_steps=4, seed=5, guidance_scale=guidance)
    assert latents.shape == ours.shape == gen.latent_shape(2)
    torch.testing.assert_close(ours, latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(gen.decode_latents(ours), videos, rtol=0, atol=1e-5)


def test_generate_with_a_named_adapter_matches_euler_with_it_and_restores_the_active_one(gen):
    gen.add_adapter("default")
    gen.copy_adapter("default", "old")
    _randomise_adapter(gen, "old", seed=4)
    _, lat_old = gen.generate(PROMPTS, num_inference_steps=3, seed=2, adapter="old", return_latents=True)
    _, lat_default = gen.generate(PROMPTS, num_inference_steps=3, seed=2, return_latents=True)
    euler_old = gen.euler_sample(gen.encode_prompts(PROMPTS), num_steps=3, seed=2, adapter="old")
    torch.testing.assert_close(euler_old, lat_old, rtol=0, atol=1e-5)
    assert (lat_old - lat_default).abs().max() > 1e-3
    assert gen.active_adapter == "default"


# ---------------------------------------------------------------------------------------------------------------
# Flow losses and the model as a flow
# ---------------------------------------------------------------------------------------------------------------


def test_implements_the_flow_policy_protocol(gen):
    assert isinstance(gen, FlowPolicy)


def test_flow_loss_is_per_sample_and_weights_scale_it(gen):
    batch = _batch(gen)
    loss = gen.flow_loss(batch)
    assert loss.shape == (2,) and bool((loss > 0).all())
    w = torch.tensor([0.5, 3.0])
    torch.testing.assert_close(gen.flow_loss(batch, weights=w), loss * w)
    # Sampling t and ε itself when the batch does not carry them: still (B,), and a fresh draw each call.
    free = {"x0": batch["x0"], "prompt_embeds": batch["prompt_embeds"]}
    a, b = gen.flow_loss(free), gen.flow_loss(free)
    assert a.shape == (2,) and not torch.equal(a, b)


def test_flow_loss_targets_in_either_space_equal_the_plain_target(gen):
    batch = _batch(gen)
    plain = gen.flow_loss(batch)
    v_true = batch["noise"] - batch["x0"]
    torch.testing.assert_close(gen.flow_loss(batch, targets={"x0": batch["x0"]}), plain)
    torch.testing.assert_close(gen.flow_loss(batch, targets={"velocity": v_true}), plain, atol=1e-5, rtol=1e-5)
    shifted = gen.flow_loss(batch, targets={"x0": batch["x0"] + 1.0})
    assert bool((shifted > plain).all())
    with pytest.raises(ValueError, match="one of 'x0' or 'velocity'"):
        gen.flow_loss(batch, targets={"eps": v_true})


def test_velocity_prediction_preset_regresses_eps_minus_x0():
    g = VideoGenerator.from_preset("tiny-velocity", seed=0)
    batch = _batch(g)
    x_t = (1 - batch["t"].view(-1, 1, 1, 1, 1)) * batch["x0"] + batch["t"].view(-1, 1, 1, 1, 1) * batch["noise"]
    v = g.velocity(x_t, batch["t"], batch["prompt_embeds"])
    expected = ((v - (batch["noise"] - batch["x0"])) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(g.flow_loss(batch), expected)
    torch.testing.assert_close(g.flow_loss(batch, targets={"x0": batch["x0"]}), expected, atol=1e-4, rtol=1e-4)


def test_x0_model_velocity_is_derived_from_its_clean_sample_prediction(gen):
    batch = _batch(gen)
    t = batch["t"]
    x_t = torch.randn_like(batch["x0"])
    x0_hat = gen.x0_pred(x_t, t, batch["prompt_embeds"])
    v = gen.velocity(x_t, t, batch["prompt_embeds"])
    torch.testing.assert_close(v, (x_t - x0_hat) / t.view(-1, 1, 1, 1, 1), atol=1e-5, rtol=1e-5)


def test_one_flow_time_per_latent_frame_reaches_each_frames_tokens(gen):
    """t (B, F'): each latent frame's tokens are told their own time (Wan2.2's per-token timesteps); the same time for
    every frame is the per-sample t, and the velocity of an x0 model divides by each frame's own time."""
    batch = _batch(gen)
    x_t, prompt = torch.randn_like(batch["x0"]), batch["prompt_embeds"]
    B, F = x_t.shape[0], x_t.shape[2]
    t = batch["t"]
    torch.testing.assert_close(gen.velocity(x_t, t[:, None].expand(B, F), prompt), gen.velocity(x_t, t, prompt), atol=1e-5, rtol=1e-5)
    per_frame = torch.rand(B, F) * 0.8 + 0.1
    seen = []
    hook = gen.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True)
    try:
        x0_hat, v = gen.x0_pred(x_t, per_frame, prompt), gen.velocity(x_t, per_frame, prompt)
    finally:
        hook.remove()
    tokens = seen[0].view(B, F, -1)
    assert seen[0].shape == (B, x_t[0, 0].numel() // 4) and torch.equal(tokens, tokens[:, :, :1].expand_as(tokens))
    torch.testing.assert_close(tokens[:, :, 0] / 1000, per_frame)
    torch.testing.assert_close(v, (x_t - x0_hat) / per_frame[:, None, :, None, None], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"one per latent frame"):
        gen.velocity(x_t, torch.rand(B, F + 1), prompt)


def test_sde_log_prob_of_recorded_steps_equals_sampling_time_log_prob(gen):
    gen.add_adapter("default")
    _randomise_adapter(gen, "default", seed=9)
    embeds = gen.encode_prompts(PROMPTS)
    x0, rec = gen.sample_sde(embeds, num_steps=4, noise_level=0.7, seed=11)
    assert rec["x_t"].shape == (4, *x0.shape) and rec["log_prob"].shape == (4, 2)
    assert torch.equal(rec["x_next"][-1], x0)
    for i in range(4):
        step = gen.sde_log_prob(
            {"x_t": rec["x_t"][i], "t": rec["t"][i], "t_next": rec["t_next"][i], "x_next": rec["x_next"][i],
             "prompt_embeds": embeds},
            noise_level=0.7,
        )
        ratio = torch.exp(step.log_prob - rec["log_prob"][i])
        assert torch.equal(ratio, torch.ones(2)), f"step {i}: ratio {ratio}"
        assert step.log_prob.requires_grad  # PPO differentiates it
    # The SDE explores: two seeds end apart; the same seed repeats.
    assert torch.equal(gen.sample_sde(embeds, num_steps=4, seed=11)[0], x0)
    assert (gen.sample_sde(embeds, num_steps=4, seed=12)[0] - x0).abs().max() > 1e-2


def test_features_are_per_sample_and_finite(gen):
    videos = torch.rand(3, 9, 3, 32, 32)
    f = gen.features({"videos": videos})
    assert f.shape == (3, 5 * 48) and bool(torch.isfinite(f).all())
    torch.testing.assert_close(f, gen.features({"x0": gen.encode_video(videos)}))


# ---------------------------------------------------------------------------------------------------------------
# Latent spaces
# ---------------------------------------------------------------------------------------------------------------


def test_pixel_space_round_trip_is_exact_and_layout_is_wan_causal(gen):
    videos = torch.rand(2, 9, 3, 32, 32)
    z = gen.encode_video(videos)
    assert z.shape == (2, 48, 3, 16, 16)  # 3 x 4 x 2 x 2 channels; frames 1 + 2 groups of 4
    torch.testing.assert_close(gen.decode_latents(z), videos, rtol=0, atol=1e-6)
    # The first latent frame holds frame 0 only; frame 5's change shows up in the third latent frame only.
    edited = videos.clone()
    edited[:, 5] = 0.0
    dz = (gen.encode_video(edited) - z).abs().amax(dim=(0, 1, 3, 4))
    assert dz[0] == 0 and dz[1] == 0 and dz[2] > 0


def test_vae_preset_encodes_and_decodes_through_autoencoder_kl_wan():
    g = VideoGenerator.from_preset("tiny-vae", seed=0)
    assert type(g.vae).__name__ == "AutoencoderKLWan"
    videos = torch.rand(1, 9, 3, 32, 32)
    z = g.encode_video(videos)
    assert z.shape == (1, 8, 3, 4, 4)
    out = g.decode_latents(z)
    assert out.shape == videos.shape and out.min() >= 0 and out.max() <= 1
    assert g.generate(PROMPTS[:1], num_inference_steps=2, seed=0).shape == (1, 9, 3, 32, 32)


# ---------------------------------------------------------------------------------------------------------------
# LoRA adapters and EMA
# ---------------------------------------------------------------------------------------------------------------


def test_zero_initialised_adapter_leaves_the_model_unchanged(gen):
    batch = _batch(gen)
    x_t = torch.randn_like(batch["x0"])
    before = gen.velocity(x_t, batch["t"], batch["prompt_embeds"])
    gen.add_adapter("default")
    after = gen.velocity(x_t, batch["t"], batch["prompt_embeds"])
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert gen.adapters == ["default"] and gen.active_adapter == "default"


def test_training_step_changes_only_the_active_adapters_lora_weights(gen):
    gen.add_adapter("default")
    _randomise_adapter(gen, "default", seed=1)
    gen.copy_adapter("default", "old")
    gen.copy_adapter("default", "ref")
    base_before = {k: v.clone() for k, v in gen.base_state_dict().items()}
    other_before = {k: v.clone() for k, v in gen.state_dict().items() if ".lora_" not in k or ".default." not in k}
    default_before = gen.adapter_state_dict("default")

    params = gen.trainable_parameters()
    assert params and all(p.requires_grad for p in params)
    assert sum(p.numel() for p in params) == sum(p.numel() for p in gen.transformer.parameters() if p.requires_grad)
    opt = torch.optim.SGD(params, lr=0.5)
    batch = _batch(gen)
    # A reference query in the middle of the step must not switch off the active adapter's gradients.
    with torch.no_grad():
        gen.velocity(torch.randn_like(batch["x0"]), batch["t"], batch["prompt_embeds"], adapter="ref")
        with gen.disable_adapters():
            gen.velocity(torch.randn_like(batch["x0"]), batch["t"], batch["prompt_embeds"])
    gen.flow_loss(batch).mean().backward()
    assert all(p.grad is not None for p in params)
    opt.step()

    after = gen.state_dict()
    for k, v in other_before.items():
        assert torch.equal(after[k], v), f"{k} changed"
    for k, v in base_before.items():
        assert torch.equal(gen.base_state_dict()[k], v)
    changed = [k for k, v in gen.adapter_state_dict("default").items() if not torch.equal(v, default_before[k])]
    assert changed
    # "old" still holds the pre-step weights, so its velocity differs from the trained adapter's.
    x_t = torch.randn_like(batch["x0"])
    v_new = gen.velocity(x_t, batch["t"], batch["prompt_embeds"])
    v_old = gen.velocity(x_t, batch["t"], batch["prompt_embeds"], adapter="old")
    v_base = gen.velocity(x_t, batch["t"], batch["prompt_embeds"], adapter=BASE)
    assert (v_new - v_old).abs().max() > 1e-6 and (v_old - v_base).abs().max() > 1e-6
    gen.copy_adapter("default", "old")
    torch.testing.assert_close(gen.velocity(x_t, batch["t"], batch["prompt_embeds"], adapter="old"), v_new)


def test_adapter_errors_name_the_adapters(gen):
    with pytest.raises(ValueError, match="no adapter yet"):
        gen.trainable_parameters()
    gen.add_adapter("default")
    with pytest.raises(ValueError, match="unknown adapter 'nope'.*default"):
        gen.set_adapter("nope")
    with pytest.raises(ValueError, match="already exists"):
        gen.add_adapter("default")
    with pytest.raises(ValueError, match="identifier other than 'base'"):
        gen.add_adapter(BASE)
    with pytest.raises(ValueError, match="matched no module"):
        gen.add_adapter("other", targets=["not_a_layer"])


def test_ema_updates_and_swaps_in(gen):
    gen.add_adapter("default")
    ema = gen.ema(decay=0.75)
    params = gen.lora_parameters()
    start = {k: p.detach().clone() for k, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            p.add_(1.0)
    ema.update()
    for k, p in params.items():
        torch.testing.assert_close(ema.shadow[k], start[k] + 0.25)
    with ema.swap_in():
        assert all(torch.equal(p, ema.shadow[k]) for k, p in params.items())
    assert all(torch.equal(p, start[k] + 1.0) for k, p in params.items())
    state = ema.state_dict()
    other = gen.ema(decay=0.5)
    other.load_state_dict(state)
    assert other.decay == 0.75 and other.num_updates == 1
    assert all(torch.equal(other.shadow[k], ema.shadow[k]) for k in params)


# ---------------------------------------------------------------------------------------------------------------
# Saving and loading
# ---------------------------------------------------------------------------------------------------------------


def test_save_load_round_trip_gives_equal_outputs(gen, tmp_path):
    gen.add_adapter("default")
    _randomise_adapter(gen, "default", seed=2)
    gen.copy_adapter("default", "ref")
    _randomise_adapter(gen, "default", seed=3)
    ref_videos = gen.generate(PROMPTS, num_inference_steps=3, seed=4)
    ref_old = gen.generate(PROMPTS, num_inference_steps=3, seed=4, adapter="ref")
    folder = gen.save_pretrained(tmp_path / "model")
    gen.save_pretrained(tmp_path / "model")  # over an existing folder: replaced, no leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    for comp in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (folder / comp).is_dir()
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "WanPipeline"

    loaded = VideoGenerator.from_pretrained(folder)
    assert loaded.config == gen.config
    assert loaded.adapters == ["default", "ref"] and loaded.active_adapter == "default"
    torch.testing.assert_close(loaded.generate(PROMPTS, num_inference_steps=3, seed=4), ref_videos, rtol=0, atol=0)
    torch.testing.assert_close(
        loaded.generate(PROMPTS, num_inference_steps=3, seed=4, adapter="ref"), ref_old, rtol=0, atol=0
    )
    torch.testing.assert_close(loaded.encode_prompts(PROMPTS), gen.encode_prompts(PROMPTS), rtol=0, atol=0)


def test_transformer_folder_is_plain_diffusers_weights(gen, tmp_path):
    from diffusers import ModelMixin

    from policies.video.modeling_wan import WanX0Transformer3DModel

    gen.add_adapter("default")
    folder = gen.save_pretrained(tmp_path / "m")
    t = WanX0Transformer3DModel.from_pretrained(folder / "transformer")
    assert isinstance(t, ModelMixin) and t.config.prediction_type == "x0"
    assert not any("lora" in k for k in t.state_dict())
    for k, v in t.state_dict().items():
        assert torch.equal(v, gen.base_state_dict()[k])


def test_missing_component_error_names_it(gen, tmp_path):
    folder = gen.save_pretrained(tmp_path / "m")
    shutil.rmtree(folder / "text_encoder")
    with pytest.raises(FileNotFoundError, match="missing the 'text_encoder' component"):
        VideoGenerator.from_pretrained(folder)
    with pytest.raises(FileNotFoundError, match="no video generator folder"):
        VideoGenerator.from_pretrained(tmp_path / "absent")


@pytest.mark.parametrize("damage", ["truncated transformer weights", "bad text encoder config", "bad scheduler config"])
def test_damaged_component_error_names_it_and_the_file(gen, tmp_path, damage):
    folder = gen.save_pretrained(tmp_path / "m")
    if damage == "truncated transformer weights":
        (weights,) = (folder / "transformer").glob("*.safetensors")
        weights.write_bytes(weights.read_bytes()[:100])
        component = "transformer"
    elif damage == "bad text encoder config":
        (folder / "text_encoder" / "config.json").write_text("{not json")
        component = "text_encoder"
    else:
        (folder / "scheduler" / "scheduler_config.json").write_text("{not json")
        component = "scheduler"
    with pytest.raises(ValueError, match=rf"the '{component}' component in {re.escape(str(folder / component))} could not be loaded"):
        VideoGenerator.from_pretrained(folder)


def test_bare_diffusers_folder_loads_with_config_read_off_the_components(tmp_path):
    g = VideoGenerator.from_preset("tiny-velocity", seed=0, latent_space="vae")
    folder = g.save_pretrained(tmp_path / "m")
    (folder / "kinema_video.json").unlink()
    loaded = VideoGenerator.from_pretrained(folder, num_frames=9, height=32, width=32, max_sequence_length=16)
    assert loaded.config.prediction == "velocity" and loaded.config.latent_space == "vae"
    assert type(loaded.transformer).__name__ == "WanTransformer3DModel"
    torch.testing.assert_close(
        loaded.generate(PROMPTS[:1], num_inference_steps=2, seed=0),
        g.generate(PROMPTS[:1], num_inference_steps=2, seed=0),
    )


def test_newer_format_version_fails_loudly(gen, tmp_path):
    folder = gen.save_pretrained(tmp_path / "m")
    meta = json.loads((folder / "kinema_video.json").read_text())
    (folder / "kinema_video.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version 99"):
        VideoGenerator.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------------------------
# Configs, shapes and text
# ---------------------------------------------------------------------------------------------------------------


def test_bad_frame_count_and_size_are_explained():
    with pytest.raises(ValueError, match=r"num_frames=10 is not 4k \+ 1.*use one of \[9, 13\]"):
        VideoGeneratorConfig(num_frames=10)
    with pytest.raises(ValueError, match="height=40 is not a multiple of 16.*use 32 or 48"):
        VideoGeneratorConfig(height=40)
    with pytest.raises(ValueError, match="width=24"):
        preset_config("tiny-vae", width=24)
    g = VideoGenerator.from_preset("tiny", seed=0)
    with pytest.raises(ValueError, match="num_frames=8"):
        g.generate(PROMPTS, num_frames=8)
    with pytest.raises(ValueError, match="num_frames=6"):
        g.encode_video(torch.rand(1, 6, 3, 32, 32))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="prediction must be one of"):
        VideoGeneratorConfig(prediction="eps")
    with pytest.raises(ValueError, match="unknown video generator preset 'tiyn'.*did you mean 'tiny'"):
        preset_config("tiyn")
    with pytest.raises(ValueError, match="unknown VideoGeneratorConfig key"):
        VideoGeneratorConfig.from_dict({"frames": 9})
    cfg = VideoGeneratorConfig()
    assert VideoGeneratorConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_offline_tokenizer_keeps_known_words_whole_and_spells_unseen_ones():
    tok = build_tokenizer()
    ids = tok("pick up the red cube").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["▁pick", "▁up", "▁the", "▁red", "▁cube", "</s>"]
    pieces = tok.convert_ids_to_tokens(tok("zebra").input_ids)
    assert pieces == ["▁z", "e", "b", "r", "a", "</s>"] and tok.unk_token not in pieces


def test_prompt_embeddings_are_cached_padded_and_distinct(gen):
    e = gen.encode_prompts(PROMPTS)
    assert e.shape == (2, 16, 32)
    assert (e[0] - e[1]).abs().max() > 1e-3
    n_tokens = len(gen.tokenizer(PROMPTS[0]).input_ids)
    assert torch.equal(e[0, n_tokens:], torch.zeros_like(e[0, n_tokens:]))  # WanPipeline zeroes the padding
    assert torch.equal(gen.encode_prompts(PROMPTS[:1])[0], e[0])


def test_velocities_of_several_adapters_in_one_pass_equal_one_call_each(gen):
    _default_and_old(gen)
    batch = _batch(gen)
    x_t, t, emb = torch.randn_like(batch["x0"]), batch["t"], batch["prompt_embeds"]
    names = ("old", BASE, "default")
    one_each = [gen.velocity(x_t, t, emb, adapter=a) for a in names]
    calls = []
    hook = gen.transformer.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    fused = gen.velocities(x_t, t, emb, names)
    hook.remove()
    assert calls == [6]  # one forward over the three adapters' rows
    assert (fused[0] - fused[1]).abs().max() > 1e-3 and (fused[0] - fused[2]).abs().max() > 1e-3  # they differ
    for a, b in zip(fused, one_each):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # batched matmuls round differently
    with gen.disable_adapters():  # the adapters are named, so a disabled state does not matter, and is kept
        for a, b in zip(gen.velocities(x_t, t, emb, names), one_each):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # batched matmuls round differently
        torch.testing.assert_close(gen.velocity(x_t, t, emb), one_each[1], rtol=0, atol=0)
    torch.testing.assert_close(gen.velocity(x_t, t, emb), one_each[2], rtol=0, atol=0)  # no hook left behind
    assert [p.requires_grad for p in gen.lora_parameters("default").values()] == [True] * 80
    assert not any(p.requires_grad for p in gen.lora_parameters("old").values())
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        gen.velocities(x_t, t, emb, ("old", "nope"))


def test_adapter_contexts_nest_and_restore(gen):
    _default_and_old(gen)
    batch = _batch(gen)
    x_t = torch.randn_like(batch["x0"])

    def v(**kw):
        return gen.velocity(x_t, batch["t"], batch["prompt_embeds"], **kw)

    v_default, v_old, v_base = v(), v(adapter="old"), v(adapter=BASE)
    with gen.disable_adapters():
        torch.testing.assert_close(v(), v_base, rtol=0, atol=0)
        torch.testing.assert_close(v(adapter="default"), v_default, rtol=0, atol=0)
        torch.testing.assert_close(v(adapter="old"), v_old, rtol=0, atol=0)
        torch.testing.assert_close(v(), v_base, rtol=0, atol=0)
    with gen.use_adapter("old"):
        torch.testing.assert_close(v(), v_old, rtol=0, atol=0)
    torch.testing.assert_close(v(), v_default, rtol=0, atol=0)
    assert [p.requires_grad for p in gen.lora_parameters("default").values()] == [True] * 80
    assert not any(p.requires_grad for p in gen.lora_parameters("old").values())


@pytest.mark.parametrize("preset, overrides", [("tiny", {}), ("tiny-velocity", {"latent_space": "vae"})])
def test_plain_diffusers_loads_the_saved_folder_and_its_lora(tmp_path, preset, overrides):
    # The standard path after training: diffusers' own WanPipeline.from_pretrained + load_lora_weights. kinema's
    # x0 transformer and pixel-space autoencoder load too: their code is saved in their folders, and diffusers runs
    # it with trust_remote_code=True (a fresh process that never imports kinema: tests/test_video_export.py).
    from diffusers import WanPipeline

    g = VideoGenerator.from_preset(preset, seed=0, **overrides)
    g.add_adapter("default", alpha=4.0)  # alpha != rank: the scale must travel in the LoRA metadata
    _randomise_adapter(g, "default", seed=1)
    ours = g.generate(PROMPTS[:1], num_inference_steps=3, seed=0)
    folder = g.save_pretrained(tmp_path / "m")
    custom = bool(list(folder.rglob("*.py")))
    assert custom == (preset == "tiny")  # a stack of diffusers' own classes carries no code
    pipe = WanPipeline.from_pretrained(folder, **({"trust_remote_code": True} if custom else {}))
    pipe.load_lora_weights(folder / "adapters" / "default", adapter_name="default")
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(
        prompt=PROMPTS[0], num_frames=9, height=32, width=32, num_inference_steps=3, guidance_scale=1.0,
        generator=torch.Generator().manual_seed(0), output_type="pt", max_sequence_length=16,
    ).frames
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_lerp_adapter_keeps_an_ema_reference_as_a_named_adapter(gen):
    gen.add_adapter("default")
    _randomise_adapter(gen, "default", seed=1)
    gen.copy_adapter("default", "ema")
    start = gen.adapter_state_dict("ema")
    _randomise_adapter(gen, "default", seed=2)
    now = gen.adapter_state_dict("default")
    gen.lerp_adapter("ema", "default", decay=0.9)
    for k, v in gen.adapter_state_dict("ema").items():
        torch.testing.assert_close(v, 0.9 * start[k] + 0.1 * now[k])
    gen.lerp_adapter("ema", "default", decay=0.0)
    assert all(torch.equal(v, now[k]) for k, v in gen.adapter_state_dict("ema").items())
    with pytest.raises(ValueError, match="decay must be in"):
        gen.lerp_adapter("ema", "default", decay=1.5)


def test_config_that_contradicts_the_components_is_refused(gen, tmp_path):
    folder = gen.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="config says prediction='velocity'.*WanX0Transformer3DModel predicting 'x0'"):
        VideoGenerator.from_pretrained(folder, prediction="velocity")


def test_foreign_unipc_scheduler_is_replaced_by_euler_with_its_shift(tmp_path):
    from diffusers import UniPCMultistepScheduler

    g = VideoGenerator.from_preset("tiny-velocity", seed=0, latent_space="vae")
    folder = g.save_pretrained(tmp_path / "m")
    (folder / "kinema_video.json").unlink()
    shutil.rmtree(folder / "scheduler")
    UniPCMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction").save_pretrained(
        folder / "scheduler"
    )
    with pytest.warns(UserWarning, match="UniPCMultistepScheduler.*shift=3.0"):
        loaded = VideoGenerator.from_pretrained(folder, num_frames=9, height=32, width=32, max_sequence_length=16)
    assert type(loaded.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert loaded.scheduler.config.shift == 3.0 and loaded.config.flow_shift == 3.0
    sig = loaded.sigmas(4)
    assert sig[0] == 1.0 and sig[-1] == 0.0 and sig[2] > 0.5  # shift 3 keeps the middle noisy (0.75 at σ = 0.5)
