"""The video-diffusion policy (policies/video_policy) at its tiny CPU size: the latent layout, planning, persistence,
learning on a fixed batch, the trainer's future batches, and `kinema train --policy.type video` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from diffusion_rl.data import Episode
from kinema.train.actor import actor_updates
from kinema.train.buffer import StepBuffer
from policies import load_policy, make_policy, policy_classes
from policies.video_policy import VideoPolicy, VideoPolicyConfig
from policies.video_policy.modeling_video_policy import POLICY, VALUE, WORLD

CAMS = ("agentview", "wrist")


def tiny(**kw) -> VideoPolicy:
    torch.manual_seed(0)
    return make_policy("video", VideoPolicyConfig(**{"num_layers": 2, **kw}))


def batch(B: int = 4, seed: int = 0, *, future: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {f"observation.images.{c}": torch.randint(0, 256, (B, 64, 64, 3), generator=g, dtype=torch.uint8) for c in CAMS}
    out.update({"observation.state": torch.randn(B, 8, generator=g), "task": ["open the drawer"] * B,
                "action": torch.rand(B, 8, 7, generator=g) * 2 - 1, "action_is_pad": torch.zeros(B, 8, dtype=torch.bool)})
    if future:
        out.update({f"future.images.{c}": torch.randint(0, 256, (B, 64, 64, 3), generator=g, dtype=torch.uint8) for c in CAMS})
        out.update({"future.state": torch.randn(B, 8, generator=g), "outcome": torch.tensor([1.0, 0.0] * (B // 2)),
                    "steps_to_end": torch.arange(B, dtype=torch.float32)})
    return out


def test_actions_states_values_and_images_round_trip_through_the_latent_layout():
    policy = tiny()
    policy.set_normalization({"observation.state": {"mean": np.full(8, 0.3), "std": np.full(8, 2.0)}})
    b = batch()
    ctx = policy.encode(b)[0]
    x0, known, _ = policy.target_latents(b, ctx)
    assert x0.shape == (4, 48, len(policy.config.slots), 8, 8) and known.all()
    s = policy.slot_index
    torch.testing.assert_close(policy.decode_actions(x0[:, :, s["action"]]), b["action"], atol=1e-6, rtol=0)
    torch.testing.assert_close(policy.decode_states(x0[:, :, s["future.state"]]), b["future.state"], atol=1e-5, rtol=0)
    value = b["outcome"] * 0.99 ** b["steps_to_end"]
    torch.testing.assert_close(policy.decode_values(x0[:, :, s["value"]]), value, atol=1e-6, rtol=0)
    # Images: 64 -> 32 pixels, then the exact pixel space: decoding gives the resized frame back.
    image = policy._images(b, "future.images.wrist")
    torch.testing.assert_close(policy.decode_images(x0[:, :, s["future.wrist"]]), image, atol=1e-5, rtol=0)
    # Tiled copies average out noise: a noisy action frame decodes far closer than its per-element noise.
    noisy = x0[:, :, s["action"]] + 0.1 * torch.randn_like(x0[:, :, s["action"]])
    assert (policy.decode_actions(noisy) - b["action"]).abs().max() < 0.1


def test_conditioning_modes_give_the_cosmos_slots():
    policy = tiny()
    given = policy.given_slots(torch.tensor([POLICY, WORLD, VALUE]))
    names = np.array(policy.config.slots)
    assert list(names[given[0].numpy()]) == ["current.agentview", "current.wrist", "current.state"]
    assert list(names[given[1].numpy()]) == ["current.agentview", "current.wrist", "current.state", "action"]
    assert list(names[~given[2].numpy()]) == ["value"]


class _transformer_calls:
    """What each pass of the policy's Wan transformer saw: its latent sequence's shape (B, C, S, h, w) and the timesteps
    its tokens were told, (B, tokens) or (B,) (hooks on its patch embedding and time embedder, whichever entry ran)."""

    def __init__(self, policy: VideoPolicy) -> None:
        self.shapes, self.timesteps = [], []
        wan = policy.generator.transformer
        self.hooks = [
            wan.patch_embedding.register_forward_pre_hook(lambda m, args: self.shapes.append(tuple(args[0].shape))),
            wan.condition_embedder.register_forward_pre_hook(self._timestep, with_kwargs=True),
        ]

    def _timestep(self, module, args, kwargs):
        seq = kwargs.get("timestep_seq_len")
        self.timesteps.append(args[0] if seq is None else args[0].view(-1, seq))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()


def test_acting_on_actions_denoises_the_action_slot_alone_and_joint_acting_the_whole_sequence():
    """Acting "actions" (UWM): each Euler step runs the transformer on [current..., action] only, the current slots told
    time 0; no future frame or value is denoised unless a future is asked for. "joint" (Cosmos): all 8 slots, every step."""
    b = {k: v[:2] for k, v in batch(future=False).items()}
    for acting, slots in (("actions", 4), ("joint", 8)):
        policy = tiny(action_head="slot", acting=acting).eval()
        with _transformer_calls(policy) as calls:
            chunk = policy.predict_action_chunk(b)
        shapes, timesteps = calls.shapes, calls.timesteps
        assert chunk.shape == (2, 8, 7) and chunk.abs().max() <= 1
        assert len(shapes) == policy.config.num_flow_steps and {s[2] for s in shapes} == {slots}
        per_slot = torch.stack(timesteps).view(len(timesteps), 2, slots, -1)[..., 0] / 1000  # (steps, B, slots)
        assert (per_slot[:, :, :3] == 0).all()  # the given current slots are clean
        schedule = per_slot[:, 0, 3]
        assert schedule[0] == 1.0 and (schedule.diff() < 0).all()  # the action slot walks from noise down
        assert (per_slot[:, :, 3:] == schedule[:, None, None]).all()  # generated slots share the step's time
    # The predicted future, asked for (kinema eval --video-predictions), is the world model's pass given the chunk.
    policy = tiny(action_head="slot", acting="actions").eval()
    policy.predict_action_chunk(b)
    with _transformer_calls(policy) as calls:
        frames = policy.predicted_future_images()
    assert set(frames) == set(CAMS) and frames["wrist"].shape == (2, 3, 32, 32)
    assert len(calls.shapes) == policy.config.num_flow_steps and {s[2] for s in calls.shapes} == {8}


def test_independent_slot_times_train_actions_and_world_at_their_own_noise_levels():
    """slot_times "independent": the transformer is told time 0 for the given slots, t for the action slot and t_world
    for the future frames, state and value; samples marked actions_only train on [current..., action] alone.
    "shared" tells every slot the one t, as Cosmos Policy trains."""
    b = batch(4)
    b["t"], b["t_world"] = torch.tensor([0.2, 0.4, 0.6, 0.8]), torch.tensor([0.9, 0.7, 0.5, 0.3])
    b["actions_only"] = torch.tensor([False, True, False, False])
    policy = tiny(action_head="slot")
    with _transformer_calls(policy) as calls:
        policy.flow_loss(b)
    shapes, timesteps = calls.shapes, calls.timesteps
    assert sorted(s[2] for s in shapes) == [4, 8] and shapes[0][0] + shapes[1][0] == 4
    full = timesteps[[s[2] for s in shapes].index(8)].view(3, 8, -1)[..., 0] / 1000  # rows 0, 2, 3
    rows = torch.tensor([0, 2, 3])
    expected = torch.stack([torch.zeros(3)] * 3 + [b["t"][rows]] + [b["t_world"][rows]] * 4, dim=1)
    torch.testing.assert_close(full, expected)
    short = timesteps[[s[2] for s in shapes].index(4)].view(1, 4, -1)[..., 0] / 1000  # row 1
    torch.testing.assert_close(short, torch.tensor([[0.0, 0.0, 0.0, 0.4]]))
    shared = tiny(slot_times="shared", acting="joint", action_head="slot")
    with _transformer_calls(shared) as calls:
        shared.flow_loss(b)
    assert len(calls.shapes) == 1 and calls.shapes[0][2] == 8
    torch.testing.assert_close(calls.timesteps[0] / 1000, b["t"])
    with pytest.raises(ValueError, match="acting 'actions'.*needs slot_times 'independent'"):
        VideoPolicyConfig(slot_times="shared", acting="actions")


def test_with_gradients_stopped_the_action_loss_trains_the_expert_head_and_leaves_the_trunk_unchanged():
    """action_head "expert", action_gradients "stop" (Video Policy's second stage): a step on the actions alone moves
    the head and not one weight of the transformer; with "trunk" the same step moves the transformer too."""
    b = batch(4, future=False)
    for gradients, trunk_moves in (("stop", False), ("trunk", True)):
        policy = tiny(action_head="expert", action_gradients=gradients)
        trunk = {k: v.clone() for k, v in policy.generator.transformer.state_dict().items()}
        head = {k: v.clone() for k, v in policy.expert.state_dict().items()}
        opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
        for _ in range(2):  # a batch without futures: the action loss alone
            opt.zero_grad()
            policy.flow_loss(b).mean().backward()
            opt.step()
        moved = [k for k, v in policy.generator.transformer.state_dict().items() if not torch.equal(v, trunk[k])]
        assert bool(moved) is trunk_moves, (gradients, moved[:3])
        assert all(not torch.equal(v, head[k]) for k, v in policy.expert.state_dict().items() if v.is_floating_point())
    policy = tiny(action_head="expert", action_gradients="stop")
    loss = policy.flow_loss({**b, "t": torch.tensor(0.5)})  # a scalar time is every sample's
    assert loss.shape == (4,) and torch.isfinite(loss).all()
    x0 = torch.zeros(4, 48, len(policy.config.slots), 8, 8)
    with pytest.raises(ValueError, match="with action_head 'expert' the chunk is the head's"):
        policy.flow_loss(b, targets={"x0": x0})
    assert policy.flow_loss(b, targets={"x0": torch.zeros(4, 8, 7)}).shape == (4,)  # AWR's chunk target


def test_the_expert_head_acts_from_one_transformer_pass_over_the_current_slots():
    """Acting with the expert head: one pass of the transformer over the 3 clean current slots per chunk, then the head's
    Euler steps; no frame slot is denoised. A saved policy acts the same after loading."""
    policy = tiny(action_head="expert").eval()
    b, noise = {k: v[:2] for k, v in batch(future=False).items()}, torch.randn(2, 8, 7)
    with _transformer_calls(policy) as calls:
        chunk = policy.predict_action_chunk(b, noise=noise)
    assert chunk.shape == (2, 8, 7) and chunk.abs().max() <= 1
    assert calls.shapes == [(2, 48, 3, 8, 8)] and (calls.timesteps[0] == 0).all()
    assert torch.equal(policy.predict_action_chunk(b, noise=noise), chunk)  # paired: the noise follows the given rows
    assert not torch.equal(policy.predict_action_chunk(b, noise=noise + 1), chunk)
    with pytest.raises(ValueError, match="action_gradients 'stop'.*set action_head 'expert'"):
        VideoPolicyConfig(action_head="slot", action_gradients="stop")
    with pytest.raises(ValueError, match="action_head 'expert'.*needs slot_times 'independent'"):
        VideoPolicyConfig(action_head="expert", slot_times="shared", acting="joint")


def test_the_expert_reads_the_block_it_names_and_with_expert_text_the_instruction_itself():
    """expert_layer k: the head reads block k's outputs over the current slots, and the blocks after it do not run for
    it; the default (-1) reads the last block, as the head always did. expert_text: the instruction reaches the head
    directly, so that two instructions over the same frames give the head different inputs in the text columns only."""
    b = {k: v[:2] for k, v in batch(future=False).items()}
    last, first = tiny(action_head="expert").eval(), tiny(action_head="expert", expert_layer=0).eval()
    first.load_state_dict(last.state_dict())
    ran: list[int] = []
    hooks = [blk.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, blk in enumerate(last.generator.transformer.blocks)]
    hooks += [blk.register_forward_hook(lambda m, a, o, i=i: ran.append(10 + i)) for i, blk in enumerate(first.generator.transformer.blocks)]
    with torch.no_grad():
        ctx = last.encode(b)[0]
        seen = []
        grab = last.generator.transformer.blocks[0].register_forward_hook(lambda m, a, o: seen.append(o))
        read_last = last.trunk_features(ctx)
        grab.remove()
        read_first = first.trunk_features(ctx)
    for hook in hooks:
        hook.remove()
    assert ran == [0, 1, 10]  # the default pass ran both blocks; expert_layer 0 stopped after the first
    torch.testing.assert_close(read_first[:, :-8], first.token_proj(seen[0].float()).flatten(1))
    assert not torch.allclose(read_first, read_last)
    with pytest.raises(ValueError, match="expert_layer names one of the transformer's 2 blocks"):
        tiny(action_head="expert", expert_layer=2)
    with pytest.raises(ValueError, match="expert_layer and expert_text.*set action_head 'expert'"):
        VideoPolicyConfig(action_head="slot", acting="joint", slot_times="shared", expert_text=True)

    policy = tiny(action_head="expert", expert_text=True).eval()
    other = {**b, "task": ["open the bottom drawer"] * 2}
    with torch.no_grad():
        a, c = policy.trunk_features(policy.encode(b)[0]), policy.trunk_features(policy.encode(other)[0])
    text = policy.generator.transformer.config.text_dim
    assert a.shape[1] == read_last.shape[1] + text
    assert not torch.allclose(a[:, -text:], c[:, -text:])
    n = len(policy.generator.pipeline().tokenizer(["open the drawer"])["input_ids"][0])  # its words and the end token
    torch.testing.assert_close(a[:, -text:], policy.encode(b)[0].prompt.float()[:, :n].mean(1))  # padding left out


def test_a_checkpoint_written_before_slot_times_existed_acts_as_it_was_trained(tmp_path: Path):
    policy = tiny(slot_times="shared", acting="joint", action_head="slot").eval()
    policy.save_pretrained(str(tmp_path / "old"))
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    for key in ("slot_times", "acting", "actions_only_share", "action_head", "action_gradients", "expert_hidden",
                "expert_layers", "expert_token_dim"):
        config.pop(key)
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    loaded = load_policy(tmp_path / "old").eval()
    assert (loaded.config.slot_times, loaded.config.acting, loaded.config.action_head) == ("shared", "joint", "slot")
    b, noise = {k: v[:2] for k, v in batch(future=False).items()}, torch.randn(2, 8, 7)
    assert torch.equal(loaded.predict_action_chunk(b, noise=noise), policy.predict_action_chunk(b, noise=noise))
    # ... and that layout computes what the code before these options computed (recorded from it).
    recorded = json.loads((Path(__file__).parent / "fixtures" / "video_policy_before_slot_times.json").read_text())["chunk"]
    g = torch.Generator().manual_seed(0)
    old = {f"observation.images.{c}": torch.randint(0, 256, (2, 64, 64, 3), generator=g, dtype=torch.uint8) for c in CAMS}
    old.update({"observation.state": torch.randn(2, 8, generator=g), "task": ["open the drawer"] * 2})
    old_noise = torch.randn(2, 8, 7, generator=g)
    chunk = tiny(**{k: getattr(loaded.config, k) for k in ("slot_times", "acting", "action_head")}).eval().predict_action_chunk(old, noise=old_noise)
    torch.testing.assert_close(chunk.flatten(), torch.tensor(recorded), atol=1e-5, rtol=0)
    assert (VideoPolicyConfig().slot_times, VideoPolicyConfig().action_head) == ("independent", "expert")  # a new policy: the new defaults


def test_planning_executes_the_highest_valued_candidate_and_n1_turns_it_off():
    policy = tiny(planning_candidates=5).eval()
    b = {k: v[:2] for k, v in batch().items()}
    noise = torch.randn(2, 8, 7)
    plan = policy.plan(b, noise=noise)
    assert plan["chunks"].shape == (2, 5, 8, 7) and plan["values"].shape == (2, 5)
    assert (plan["values"].std(1) > 0).all()  # the candidates differ in value, so the choice matters
    chunk = policy.predict_action_chunk(b, noise=noise)
    best = plan["values"].argmax(1)
    torch.testing.assert_close(chunk, plan["chunks"][torch.arange(2), best])
    assert not torch.allclose(chunk, plan["chunks"][torch.arange(2), plan["values"].argmin(1)])
    torch.testing.assert_close(policy.last_prediction["value"], plan["values"].max(1).values)
    # N = 1: one candidate, the plain policy sample (the first candidate's noise), no world-model pass.
    policy.config.planning_candidates = 1
    single = policy.plan(b, noise=noise)
    assert single["chunks"].shape == (2, 1, 8, 7)
    torch.testing.assert_close(single["chunks"][:, 0], plan["chunks"][:, 0])


def test_best_of_n_by_the_policys_own_value_is_the_shared_selection_runner():
    """`kinema eval --select N` on a video policy: SelectChunkPolicy without a critic executes the chunk `plan` values
    most, whatever planning_candidates the checkpoint keeps; a policy that predicts no value is refused by name."""
    from kinema.train.evaluate import SelectChunkPolicy

    policy = tiny(planning_candidates=1).eval()
    b = {k: v[:2] for k, v in batch(future=False).items()}
    runner = SelectChunkPolicy(policy, None, num_samples=4)
    runner.about_to_act([3, 5], [0, 0])  # per-episode noise, as `collect` gives it
    chosen = runner.sample(b)
    plan = policy.plan(b, candidates=4, noise=runner._episode_noise(2))
    torch.testing.assert_close(chosen, plan["chunks"][torch.arange(2), plan["values"].argmax(1)])
    assert policy.config.planning_candidates == 1  # the checkpoint's setting is untouched
    with pytest.raises(ValueError, match="best-of-N needs a value: a chunk critic.*VLAPolicy predicts none"):
        SelectChunkPolicy(make_policy("vla", policy_classes("vla")[0]()), None, num_samples=4)  # a policy that does not plan


@pytest.mark.parametrize("head", ["slot", "expert"])
def test_save_and_load_preserve_predictions_exactly(tmp_path: Path, head: str):
    policy = tiny(planning_candidates=3, action_head=head).eval()
    policy.set_normalization({"observation.state": {"mean": np.arange(8.0), "std": np.full(8, 3.0)}})
    b = {k: v[:2] for k, v in batch().items()}
    noise = torch.randn(2, 8, 7)
    before = policy.predict_action_chunk(b, noise=noise)
    policy.save_pretrained(str(tmp_path / "ckpt"))
    loaded = load_policy(tmp_path / "ckpt").eval()
    assert isinstance(loaded, VideoPolicy) and loaded.config.planning_candidates == 3
    assert torch.equal(loaded.predict_action_chunk(b, noise=noise), before)
    assert torch.equal(loaded.features(b), policy.features(b))
    # A damaged config names the field.
    cfg = (tmp_path / "ckpt" / "config.json")
    cfg.write_text(cfg.read_text().replace('"planning_candidates": 3', '"planning_candidates": "many"'))
    with pytest.raises(ValueError, match="planning_candidates"):
        load_policy(tmp_path / "ckpt")


@pytest.mark.parametrize("head", ["slot", "expert"])
def test_a_short_training_run_lowers_the_loss_on_a_fixed_batch_and_changes_the_weights(head: str):
    policy = tiny(action_head=head)
    b = batch(8)
    b["t"], b["t_world"] = torch.linspace(0.1, 0.9, 8), torch.linspace(0.9, 0.1, 8)
    b["actions_only"] = torch.arange(8) % 2 == 0
    b["noise"] = torch.randn(8, 48, len(policy.config.slots), 8, 8, generator=torch.Generator().manual_seed(1))
    b["action_noise"] = torch.randn(8, 8, 7, generator=torch.Generator().manual_seed(2))
    before = {k: v.clone() for k, v in policy.generator.transformer.state_dict().items()}
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    with torch.no_grad():
        first = policy.flow_loss(b).mean().item()
    for _ in range(25):
        loss = policy.flow_loss(b).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        last = policy.flow_loss(b).mean().item()
    assert last < 0.5 * first, (first, last)
    changed = [k for k, v in policy.generator.transformer.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) > 0.9 * len(before)
    assert not any(p.requires_grad for p in policy.generator.text_encoder.parameters())  # the frozen encoder stays


def test_a_state_far_outside_the_demonstrations_is_bounded_before_it_becomes_a_slot(tmp_path: Path):
    """A state dimension nearly constant in the demonstrations (std 2e-3, the gripper's tilt) is tens of stds out in
    a rollout. Unbounded, that z-score becomes a future.state target whose squared error swamps the action loss (what
    made HABC's rounds collapse the video policy); bounded at state_clip stds, the loss stays of the order of the
    in-distribution one. A checkpoint written before the bound existed keeps acting unbounded, as it was trained."""
    from policies.video_policy import modeling_video_policy as vp

    policy = tiny(action_head="expert")
    std = np.ones(8, np.float32)
    std[3] = 2e-3
    policy.set_normalization({"observation.state": {"mean": np.zeros(8, np.float32), "std": std}})
    b = batch(4)
    far = {**b, "observation.state": b["observation.state"].clone(), "future.state": b["future.state"].clone()}
    far["observation.state"][:, 3] = 0.1  # 50 stds out
    far["future.state"][:, 3] = 0.1
    assert policy._state(far["observation.state"])[:, 3].abs().max() == pytest.approx(policy.config.state_clip * vp.STATE_SCALE)

    def loss(x):
        torch.manual_seed(0)
        with torch.no_grad():
            return float(policy.flow_loss(x).mean())

    near, bounded = loss(b), loss(far)
    policy.config.state_clip = 0.0
    unbounded = loss(far)
    assert bounded < 1.5 * near and unbounded > 5 * bounded, (near, bounded, unbounded)
    policy.save_pretrained(str(tmp_path / "old"))
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    config.pop("state_clip")
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    assert load_policy(tmp_path / "old").config.state_clip == 0.0
    assert VideoPolicyConfig().state_clip == 5.0


@pytest.mark.parametrize("head", ["slot", "expert"])
def test_flow_loss_is_per_sample_and_weighted_by_the_credit(head: str):
    policy = tiny(action_head=head)
    b = batch(4)
    b["t"], b["noise"] = torch.full((4,), 0.5), torch.randn(4, 48, len(policy.config.slots), 8, 8)
    b["t_world"], b["actions_only"] = torch.full((4,), 0.3), torch.tensor([True, False, True, False])
    b["action_noise"] = torch.randn(4, 8, 7)
    plain = policy.flow_loss(b)
    weighted = policy.flow_loss(b, weights=torch.tensor([0.0, 1.0, 2.0, 0.5]))
    assert plain.shape == (4,)
    torch.testing.assert_close(weighted, plain * torch.tensor([0.0, 1.0, 2.0, 0.5]))
    # Without future keys (e.g. a method's own batches), only the action slot trains.
    no_future = {k: v for k, v in b.items() if not k.startswith("future.") and k not in ("outcome", "steps_to_end")}
    assert policy.flow_loss(no_future).shape == (4,)


def _episode(T: int, outcome: bool) -> Episode:
    rng = np.random.default_rng(T)
    obs = {f"observation.images.{c}": rng.integers(0, 255, (T, 32, 32, 3), dtype=np.uint8) for c in CAMS}
    obs["observation.state"] = np.arange(T, dtype=np.float32)[:, None].repeat(8, 1)
    return Episode(observations=obs, action=rng.uniform(-1, 1, (T, 7)).astype(np.float32), task="open the drawer",
                   outcome=outcome)


def test_the_buffer_gives_the_chunks_end_state_and_the_outcome():
    buf = StepBuffer.from_episodes([_episode(10, True), _episode(6, False)], CAMS)
    out = buf.batch(np.array([0, 5, 10, 14]), 4, future=True)
    # steps 0 and 5 of episode 0 (T=10) -> 4 and 9 (clamped); steps 0 and 4 of episode 1 (T=6) -> 4 and 5
    np.testing.assert_array_equal(out["future.state"][:, 0].numpy(), [4, 9, 4, 5])
    np.testing.assert_array_equal(out["steps_to_end"].numpy(), [5, 0, 1, 0])
    np.testing.assert_array_equal(out["outcome"].numpy(), [1, 1, 0, 0])
    assert torch.equal(out["future.images.wrist"][2], torch.from_numpy(buf.images["wrist"][10 + 4]))
    assert "future.state" not in buf.batch(np.array([0]), 4)  # the VLA's batches are unchanged


def test_rl_updates_refine_world_model_and_value_on_all_replay_steps():
    """The experience loss reaches failed rollouts that the credit weights leave out of the action loss."""
    policy = tiny(experience_fraction=0.5)
    demos = StepBuffer.from_episodes([_episode(12, True)], CAMS)
    replay = StepBuffer.from_episodes([_episode(10, False)], CAMS)
    policy.set_normalization(demos.stats())
    seen = []
    original = policy.experience_loss
    policy.experience_loss = lambda b, **kw: (seen.append(b["outcome"].clone()), original(b, **kw))[1]
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    stats = actor_updates(policy, opt, steps=2, batch_size=4, demos=demos, replay=replay, replay_weights=np.zeros(len(replay)),
                          demo_fraction=0.5, aux_weight=0.0, rng=np.random.default_rng(0))
    assert stats["actor/replay_share"] == 0.0  # no credit: no rollout step in the action loss
    assert len(seen) == 2 and all(len(o) == 2 and (o == 0).all() for o in seen)  # but the failures train world + value


@pytest.mark.slow
def test_kinema_train_runs_the_video_policy_end_to_end(tmp_path: Path):
    from test_train_workflow import TINY

    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "kinema.cli", "train", *TINY, "--policy.type", "video", "--rl.rounds", "1",
         "--eval.heldout", "false", "--out", str(run),
         # the least evaluation a run allows: at ~0.6 s a chunk, the video policy's episodes are what this test costs
         "--eval.baseline", "false", "--eval.episodes", "1", "--eval.round_episodes", "1", "--eval.videos", "0"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--policy.generator_path RUN_DIR" in " ".join(result.stderr.split())  # what a generator would bring, said
    final = load_policy(run / "checkpoints" / "final")
    assert isinstance(final, VideoPolicy) and final.config.extra["tasks"] == ["drawer"]
    assert (run / "rollouts" / "round-001" / "meta" / "info.json").exists()
    sft = load_policy(run / "checkpoints" / "sft")
    diff = [k for k, v in final.state_dict().items() if not torch.equal(v, sft.state_dict()[k])]
    assert any(k.startswith("generator.transformer.") for k in diff)  # RL changed the transformer
    # kinema eval: planning (best-of-N by its own value) as its own column with its batch-1 latency, and the predicted futures as an MP4.
    out = tmp_path / "eval"
    result = subprocess.run(
        [sys.executable, "-m", "kinema.cli", "eval", "--policy", str(run / "checkpoints" / "final"), "--task", "drawer",
         "--episodes", "2", "--splits", "train", "--workers", "0", "--videos", "0", "--select", "2",
         "--video-predictions", "--task-config", '{"horizon": 12}', "--out", str(out)], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    assert report["select"] == 2 and "policy's predicted value" in report["selection"]
    assert report["selection_results"]["train"]["episodes"] == report["results"]["train"]["episodes"] == 2
    assert set(report["latency_ms"]) == {"1", "2"} and report["latency_ms"]["2"] > report["latency_ms"]["1"]
    assert "with selection (N=2)" in (out / "report.md").read_text()
    from kinema.media import read_mp4

    frames = read_mp4(out / "videos" / "predictions.mp4")
    assert frames.shape[1:] == (2 * 32, 3 * 32, 3) and len(frames) == 3  # 12 steps, a chunk every 4: 3 chunks


def test_a_local_generator_folder_trains_lora_and_checkpoints_reference_it(tmp_path: Path):
    """The GPU path on a tiny stand-in: a diffusers-layout Wan folder with a real VAE, LoRA on its transformer,
    checkpoints holding only the LoRA and buffers (the base is referenced by path, as a full-size Wan would be)."""
    from policies.video.generator import VideoGenerator

    VideoGenerator.from_preset("tiny-vae", seed=3).save_pretrained(tmp_path / "wan")
    policy = make_policy("video", VideoPolicyConfig(generator_path=str(tmp_path / "wan"), video_size=32, lora_rank=4))
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trainable) and all("lora_" in n or not n.startswith("generator.") for n in trainable)
    assert {n.split(".")[0] for n in trainable} == {"generator", "token_proj", "expert"}  # LoRA and the action head
    assert policy.config.hidden_dim == policy.features(batch(2)).shape[1]
    b = batch(2)
    loss = policy.flow_loss(b).mean()
    loss.backward()
    torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0).step()
    policy.eval()
    noise = torch.randn(2, 8, 7)
    before = policy.predict_action_chunk(b, noise=noise)
    policy.save_pretrained(str(tmp_path / "ckpt"))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert all("lora_" in k or not k.startswith("generator.") for k in saved)
    assert torch.equal(load_policy(tmp_path / "ckpt").eval().predict_action_chunk(b, noise=noise), before)


def test_a_post_trained_generator_is_the_video_policys_trunk(tmp_path: Path):
    """A generator folder as `kinema video train` exports it (a tiny pixel-space Wan, its post-training LoRA saved as
    the active adapter) starts the video policy: `generator_path` takes the run folder for its final/, the LoRA is
    fused into the trunk (which then computes what the folder's generator computes with its adapter on), the weights
    LoRA does not touch are the folder's (fingerprint), the policy's own adapter trains on top, and checkpoints
    reference the folder. A frame size other than the generator's is refused naming it."""
    from method_regression import fingerprint

    from policies.video.generator import VideoGenerator

    gen = VideoGenerator.from_preset("tiny", seed=3, height=32, width=32, num_frames=5)
    gen.add_adapter("default", rank=4, alpha=4.0)
    with torch.no_grad():
        for p in gen.lora_parameters("default").values():
            p.normal_(0.0, 0.05)
    gen.save_pretrained(tmp_path / "run" / "final")
    policy = make_policy("video", VideoPolicyConfig(generator_path=str(tmp_path / "run"), video_size=32, lora_rank=4))
    assert policy.config.generator_path == str(tmp_path / "run" / "final")
    assert policy.config.extra["generator_fused_adapter"] == "default" and policy.generator.adapters == ["default"]
    folder = VideoGenerator.from_pretrained(tmp_path / "run" / "final")  # its adapter active
    assert folder.active_adapter == "default"
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(2, 48, 2, 16, 16, generator=g)
    prompts = folder.encode_prompts(["open the top drawer", "push the red block"])
    with torch.no_grad():
        expected = folder.velocity(x_t, torch.tensor([0.3, 0.8]), prompts)
        got = policy.generator.velocity(x_t, torch.tensor([0.3, 0.8]), prompts)  # the policy's adapter starts at zero
        plain = folder.velocity(x_t, torch.tensor([0.3, 0.8]), prompts, adapter="base")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (expected - plain).abs().max() > 1e-3  # the LoRA matters: the check above can tell fused from not
    adapted = {k.rsplit(".lora_", 1)[0] + ".weight" for k in folder.adapter_state_dict("default")}
    untouched = lambda state: {k: v for k, v in state.items() if k not in adapted}  # noqa: E731
    assert fingerprint(untouched(policy.generator.base_state_dict())) == fingerprint(untouched(folder.base_state_dict()))
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trainable) and all("lora_" in n or not n.startswith("generator.") for n in trainable)
    policy.save_pretrained(str(tmp_path / "ckpt"))
    again = load_policy(tmp_path / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(again.generator.velocity(x_t, torch.tensor([0.3, 0.8]), prompts), got)
    with pytest.raises(ValueError, match="makes 32x32 frames; set policy.video_size to 32"):
        make_policy("video", VideoPolicyConfig(generator_path=str(tmp_path / "run"), video_size=48, lora_rank=4))


def test_methods_that_cannot_train_the_video_policy_are_refused_with_the_valid_ones():
    from kinema.common import load_config
    from kinema.train.config import TrainConfig

    with pytest.raises(ValueError, match="does not train a 'video' policy; valid for it: habc, sft_continued, awr, none"):
        load_config(None, ["--policy.type", "video", "--rl.method", "flow_ppo"], config_class=TrainConfig)
    assert load_config(None, ["--policy.type", "video", "--rl.method", "awr"], config_class=TrainConfig).policy.type == "video"


def test_options_of_another_policy_type_are_refused_not_ignored():
    from kinema.common import load_config
    from kinema.train.config import TrainConfig

    with pytest.raises(ValueError, match="policy.vision_encoder: not an option of policy.type 'video' \\(on the command line; its options: .*planning_candidates"):
        load_config(None, ["--policy.type", "video", "--policy.vision_encoder", "spatial_softmax"], config_class=TrainConfig)
    with pytest.raises(ValueError, match="policy.planning_candidates: not an option of policy.type 'vla'"):
        load_config(None, ["--policy.planning_candidates", "4"], config_class=TrainConfig)
    assert load_config(None, ["--policy.type", "video", "--policy.planning_candidates", "4"], config_class=TrainConfig).policy.planning_candidates == 4


def test_each_policy_type_has_its_own_options_group_and_a_config_file_is_checked_against_its_type(tmp_path):
    import dataclasses

    import yaml

    from kinema.common import config_keys_help, dump_config, load_config
    from kinema.train.config import PolicyOptions, TrainConfig, VideoPolicyOptions, VLAOptions
    from policies import POLICY_TYPES, policy_classes

    assert set(PolicyOptions.get_known_choices()) == set(POLICY_TYPES)
    for name, options in PolicyOptions.get_known_choices().items():
        # Every option but ema_decay (a training option) is a field of that type's policy config.
        config_fields = {f.name for f in dataclasses.fields(policy_classes(name)[0])}
        assert set(options().policy_fields()) <= config_fields, name
    assert {f.name for f in dataclasses.fields(VideoPolicyOptions)}.isdisjoint({"backbone", "vision_encoder", "keypoints"})
    assert {f.name for f in dataclasses.fields(VLAOptions)}.isdisjoint({"video_size", "generator_path", "planning_candidates"})
    # A config file: its type picks the group; another type's key is refused with the file named.
    video = tmp_path / "video.yaml"
    video.write_text("rl:\n  method: awr\npolicy:\n  type: video\n  video_size: 16\n")
    cfg = load_config(str(video), ["--policy.image_size", "32"], config_class=TrainConfig)
    assert isinstance(cfg.policy, VideoPolicyOptions) and (cfg.policy.video_size, cfg.policy.image_size) == (16, 32)
    assert yaml.safe_load(dump_config(cfg))["policy"]["type"] == "video"  # the run's config.yaml says which group
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy:\n  keypoints: 16\n  planning_candidates: 4\n")
    with pytest.raises(ValueError, match="policy.planning_candidates: not an option of policy.type 'vla' \\(in the config file"):
        load_config(str(bad), [], config_class=TrainConfig)
    assert "video: policy.image_size=64" in config_keys_help(TrainConfig)


def test_a_run_config_written_when_policy_options_were_one_union_still_loads_as_it_ran(tmp_path):
    """Until 12-06 every run's config.yaml held every policy type's options (the unused ones at their defaults)."""
    import yaml

    from kinema.common import load_config, load_run_config
    from kinema.train.config import TrainConfig, VLAOptions

    union = {"type": "vla", "image_size": 64, "chunk_size": 8, "n_action_steps": 4, "num_flow_steps": 10, "backbone": "tiny",
             "backbone_path": "", "backbone_layers": 0, "backbone_image_size": 0, "lora_rank": 8, "freeze_vision": True,
             "aux_input": "fused", "vision_encoder": "spatial_softmax", "keypoints": 16, "state_dropout": 0.0, "augment_shift": 4,
             "text_position_jitter": False, "text_filler_words": 0.0, "ema_decay": 0.995, "video_size": 32,
             "generator_path": "", "planning_candidates": 1}  # fmt: skip
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"task": "drawer", "out": str(run), "policy": union}))
    cfg = load_run_config(None, [], str(run), config_class=TrainConfig)
    assert isinstance(cfg.policy, VLAOptions) and (cfg.policy.vision_encoder, cfg.policy.keypoints) == ("spatial_softmax", 16)
    # A video option set away from its default was never a union default: it is not dropped, it is refused.
    union["planning_candidates"] = 4
    (run / "config.yaml").write_text(yaml.safe_dump({"task": "drawer", "out": str(run), "policy": union}))
    with pytest.raises(ValueError, match="policy.planning_candidates: not an option of policy.type 'vla'"):
        load_config(str(run / "config.yaml"), [], config_class=TrainConfig)
