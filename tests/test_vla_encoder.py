"""The VLA's camera encoders: the spatial-softmax encoder says where a small object is, where the stride-4 patchify
cannot (benchmarks/localisation_probe.py, on frames of a real MuJoCo scene); the choice is stored in config.json, and
checkpoints written before it load as patchify and act as before."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_vla import fake_batch, tiny_config

from policies.vla import VLAConfig, VLAPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from localisation_probe import cube_frames, named_object_frames, probe  # noqa: E402

FIXTURE_CHECKPOINT = Path(__file__).parent / "fixtures" / "run-before-methods" / "checkpoints" / "round-001"


def test_the_spatial_softmax_encoder_localises_a_four_centimetre_cube_where_patchify_cannot():
    """Known answer: the cube's pixel position, from the camera's pose. From 384 frames the spatial softmax comes
    within two pixels on held-out frames (a cell of its 16x16 map is four); the patchify memorises its training frames
    and stays near the labels' own spread on new ones (it needs several times the frames: the benchmark's full run)."""
    torch.set_num_threads(1)
    train, test = cube_frames(384, 0), cube_frames(128, 1)
    spread = float(np.median(np.linalg.norm(test[1] - train[1].mean(0), axis=-1)))  # the error of always guessing the mean
    assert 4.0 < spread < 10.0, spread
    small = dict(steps=600, lr=2e-3, vision_channels=(16, 32, 32), vision_dim=64, keypoints=16)
    keypoints, patchify = probe("spatial_softmax", train, test, **small), probe("patchify", train, test, **small)
    assert keypoints["test_median_px"] < 2.0, keypoints
    assert patchify["test_median_px"] > 0.75 * spread and patchify["test_median_px"] > 2.5 * keypoints["test_median_px"], (patchify, keypoints, spread)


@pytest.mark.slow
def test_the_grounded_locator_finds_the_object_the_instruction_names_among_two():
    """Known answer: the named object's pixel position in full-difficulty pick_place scenes (a distractor and two
    plates beside it, random colours, shapes and yaws), the instruction read by the word encoder. The locator's cells,
    trained to classify the one that holds the named object, come within ~2 pixels on held-out scenes after 500 steps;
    patchify read by a linear head on the same frames and steps does not beat guessing the mean."""
    torch.set_num_threads(1)
    train, test = named_object_frames(384, 0), named_object_frames(128, 1)
    spread = float(np.median(np.linalg.norm(test[1] - train[1].mean(0), axis=-1)))
    small = dict(steps=500, vision_channels=(16, 32, 32), vision_dim=64)
    located = probe("patchify_grounded", train, test, direct=True, keypoints=2, **small)
    patchify = probe("patchify", train, test, **small)
    assert located["test_median_px"] < 3.0 and located["test_median_px"] < 0.5 * spread, (located, spread)
    assert patchify["test_median_px"] > 0.75 * spread, (patchify, spread)


def test_the_encoder_choice_is_stored_and_a_spatial_softmax_checkpoint_acts_the_same_after_loading(tmp_path):
    torch.manual_seed(0)
    model = VLAPolicy(tiny_config(vision_encoder="spatial_softmax", keypoints=8)).eval()
    model.save_pretrained(str(tmp_path / "ckpt"))
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert (config["vision_encoder"], config["keypoints"]) == ("spatial_softmax", 8)
    loaded = VLAPolicy.from_pretrained(str(tmp_path / "ckpt")).eval()
    batch, noise = fake_batch(), torch.randn(6, 4, 7)
    torch.testing.assert_close(model.predict_action_chunk(batch, noise=noise), loaded.predict_action_chunk(batch, noise=noise))
    config["vision_encoder"] = "patchify"  # the weights of one encoder are not the other's
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match this VLA architecture.*keypoints"):
        VLAPolicy.from_pretrained(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="vision_encoder must be one of 'patchify', 'spatial_softmax', 'patchify_grounded'; got 'resnet'"):
        VLAConfig(vision_encoder="resnet")


def test_a_checkpoint_from_before_the_choice_loads_as_patchify_and_acts():
    assert "vision_encoder" not in json.loads((FIXTURE_CHECKPOINT / "config.json").read_text())
    policy = VLAPolicy.from_pretrained(str(FIXTURE_CHECKPOINT)).eval()
    assert policy.config.vision_encoder == "patchify"
    s = policy.config.image_size
    batch = {"observation.images.agentview": np.zeros((2, s, s, 3), np.uint8), "observation.images.wrist": np.zeros((2, s, s, 3), np.uint8),
             "observation.state": np.zeros((2, 8), np.float32), "task": ["open the top drawer"] * 2}  # fmt: skip
    chunk = policy.predict_action_chunk(batch, noise=torch.zeros(2, policy.config.chunk_size, 7))
    assert chunk.shape == (2, policy.config.chunk_size, 7) and torch.isfinite(chunk).all()


def test_the_grounded_encoder_points_where_the_instruction_words_say_and_the_aux_head_reads_only_those_points(tmp_path):
    """patchify_grounded: beside patchify's features, each camera gives `keypoints` expected (x, y) of cells scored
    against the instruction's words; with aux_input="keypoints" the privileged-position head reads those coordinates
    and nothing else (not the state, not patchify's features), so that its loss can only be lowered by pointing."""
    torch.manual_seed(0)
    config = tiny_config(vision_encoder="patchify_grounded", keypoints=3, aux_input="keypoints", aux_dim=5)
    model = VLAPolicy(config).eval()
    batch = fake_batch(config=config)
    batch["aux_target"] = torch.randn(6, 5)
    context, aux = model.encode(batch)
    where = aux.head
    assert where.shape == (6, 2 * 3 * len(config.cameras)) and where.abs().max() <= 1.0  # image coordinates in [-1, 1]
    other_words = {**batch, "task": ["put the green brick on the red plate"] * 6}
    assert not torch.allclose(model.encode(other_words)[1].head, where)  # the points follow the words
    moved = {**batch, "observation.state": batch["observation.state"] + 3.0}
    torch.testing.assert_close(model.aux_loss(moved, model.encode(moved)[1]), model.aux_loss(batch, aux))
    assert not torch.allclose(model.features(moved), context)  # the actions still see the state
    with torch.no_grad():
        for encoder in model.vision.values():
            encoder.project[1].weight.normal_()  # patchify's features change; the points do not
    torch.testing.assert_close(model.encode(batch)[1].head, where)
    model.save_pretrained(str(tmp_path / "ckpt"))
    loaded = VLAPolicy.from_pretrained(str(tmp_path / "ckpt")).eval()
    noise = torch.randn(6, 4, 7)
    torch.testing.assert_close(loaded.predict_action_chunk(batch, noise=noise), model.predict_action_chunk(batch, noise=noise))
    with pytest.raises(ValueError, match="aux_input 'keypoints' reads the keypoints of vision_encoder 'patchify_grounded'.*got vision_encoder 'patchify'"):
        tiny_config(aux_input="keypoints", aux_dim=5)


def test_with_instruction_input_locator_the_instruction_reaches_the_policy_only_through_where_the_locators_point():
    """instruction_input="locator": a paraphrase changes the fused feature only by moving the locators' points; held
    at the same points, the feature is the same. With "pooled" (the default) the pooled words change it anyway."""
    paraphrase = ["could you transfer the red cube to the blue plate"] * 6
    for instruction_input, same_when_points_held in (("locator", True), ("pooled", False)):
        torch.manual_seed(0)
        config = tiny_config(vision_encoder="patchify_grounded", keypoints=2, instruction_input=instruction_input)
        model = VLAPolicy(config).eval()
        batch = fake_batch(config=config)
        with torch.no_grad():
            context = model.features(batch)
            assert not torch.allclose(model.features({**batch, "task": paraphrase}), context)  # the points follow the words
            ids, mask = model.tokenizer(batch["task"])
            words = model.text(ids, mask)[0]
            held = {cam: encoder.locator.logits(encoder.inputs(model._image(batch, cam)[0]), words, mask) for cam, encoder in model.vision.items()}
            for cam, encoder in model.vision.items():
                encoder.locator.logits = lambda inputs, words, mask, fixed=held[cam]: fixed
            assert torch.allclose(model.features({**batch, "task": paraphrase}), context, atol=1e-6) is same_when_points_held
    with pytest.raises(ValueError, match="instruction_input 'locator' passes the instruction through the locators"):
        tiny_config(instruction_input="locator")


def test_random_shift_reports_where_the_content_moved():
    """The shift random_shift returns is where a pixel label goes: a lone bright pixel is found at its position plus
    the shift, in the [-1, 1] convention of the labels."""
    from policies.vla.modeling_vla import random_shift

    torch.manual_seed(0)
    images = torch.zeros(16, 3, 32, 32)
    row, column = 11, 20
    images[:, :, row, column] = 1.0
    shifted, shift = random_shift(images, 4)
    assert shift.shape == (16, 2) and shift.abs().max() > 0
    found = shifted[:, 0].flatten(1).argmax(-1)
    label = torch.tensor([(column + 0.5) / 32 * 2 - 1, (row + 0.5) / 32 * 2 - 1])
    moved = label + shift
    torch.testing.assert_close(torch.stack([found % 32, found // 32], -1).float(), (moved + 1) / 2 * 32 - 0.5)


def test_the_where_loss_classifies_the_labelled_cell_and_skips_what_is_out_of_view():
    """where_loss: cross-entropy of keypoint 0 on the target's cells and keypoint 1 on the goal's, per camera,
    averaged over the labels in view. Known answers on hand-made cell scores (labels on grid points, so that each is
    one cell): near 0 where the scores peak at the labelled cells, about the peak's height where they peak elsewhere,
    0 for a sample whose labels are all unknown, and a label moved by the augmentation shift is scored at its new cell."""
    from policies.vla.modeling_vla import AuxFeatures

    config = tiny_config(vision_encoder="patchify_grounded", keypoints=3)
    model = VLAPolicy(config).eval()
    locator = model.vision[config.cameras[0]].locator
    cells = locator.grid.shape[0]
    right = torch.tensor([2 * int(cells**0.5) + 5, 6 * int(cells**0.5) + 1])  # target, goal cells
    target = locator.grid[right]  # in every camera
    where = target.expand(4, len(config.cameras), 2, 2).clone()
    where[2] = float("nan")  # no label: a recording
    where[3, :, 1] = 2.0  # the goal out of view
    logits = torch.zeros(4, 3, cells)
    logits[:, 0, right[0]] = logits[:, 1, right[1]] = 30.0
    logits[1, 0, right[0]] = 0.0
    logits[1, 0, (right[0] + 1) % cells] = 30.0  # sample 1's target keypoint peaks one cell off
    zero = {cam: torch.zeros(4, 2) for cam in config.cameras}
    aux = AuxFeatures(torch.zeros(4, 1), {cam: logits for cam in config.cameras}, zero)
    loss = model.where_loss({"where_target": where}, aux)
    assert loss[0] < 1e-6 and loss[3] < 1e-6 and loss[2] == 0
    torch.testing.assert_close(loss[1], torch.tensor(15.0), atol=1e-3, rtol=0)  # (30 + 0) / 2 labels
    side = int(cells**0.5)
    moved = {cam: torch.tensor([[2.0 / (side - 1), 0.0]]).expand(4, 2) for cam in config.cameras}  # one cell to the right
    shifted = model.where_loss({"where_target": where}, AuxFeatures(aux.head, aux.where_logits, moved))
    assert shifted[0] > 10  # the scores stayed, the label moved on


@pytest.mark.parametrize("locator_stride", [4, 2])
def test_the_locator_is_taught_to_point_below_a_cell(locator_stride):
    """The where_loss's soft labels (`cell_distribution`) have the labelled position as their expected coordinates,
    anywhere in the image (borders included); free cell scores trained on them point there to a hundredth of a
    cell, where a one-hot label on the cell holding the position leaves them at that cell's grid point. At either
    map resolution (image_size / 4 or / 2)."""
    from policies.vla.modeling_vla import expected_coordinates

    torch.manual_seed(0)
    config = tiny_config(vision_encoder="patchify_grounded", keypoints=2, locator_stride=locator_stride)
    locator = VLAPolicy(config).vision["agentview"].locator
    grid, side = locator.grid, int(locator.grid.shape[0] ** 0.5)
    assert side == config.image_size // locator_stride
    positions = torch.cat([torch.rand(64, 2) * 2 - 1, torch.tensor([[-1.0, -1.0], [1.0, 1.0], [1.0, -0.97]])])
    labels = locator.cell_distribution(positions)
    assert torch.allclose(labels.sum(-1), torch.ones(len(positions))) and (labels >= 0).all()
    torch.testing.assert_close(labels @ grid, positions, atol=1e-5, rtol=0)
    logits = torch.zeros(len(positions), grid.shape[0], requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.5)
    for _ in range(300):
        loss = -(labels * logits.log_softmax(-1)).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    pointed = expected_coordinates(logits.detach()[:, None], grid).view(-1, 2)
    assert (pointed - positions).abs().max() < 0.01 * 2 / (side - 1)
    hard = ((positions + 1) / 2 * side).long().clamp(0, side - 1)
    assert (grid[hard[:, 1] * side + hard[:, 0]] - positions).abs().max() > 0.5 * 2 / (side - 1)  # what one-hot cells teach


def test_state_points_give_the_state_the_locators_target_and_goal_points_normalised_and_out_of_the_flow_losss_reach(tmp_path):
    """state_points=("agentview",): the agentview locator's keypoints 0 and 1 (target, goal) join the state before
    its MLP, normalised by the pixel labels' statistics and with training's random shift taken back out (the points
    then say where the object is in the camera's own frame, as the pixel oracle's true labels do); they are detached
    and leave the camera's features, so the flow loss does not move that locator (its cell loss does), while the
    wrist's coordinates still sit among its features. The normalisation travels in the checkpoint."""
    torch.manual_seed(0)
    config = tiny_config(vision_encoder="patchify_grounded", keypoints=3, state_points=("agentview",), augment_shift=4,
                         aux_input="keypoints", aux_dim=2)  # fmt: skip
    model = VLAPolicy(config)
    mean, std = np.array([[0.1, -0.2], [0.3, 0.4]]), np.array([[0.5, 0.25], [0.2, 0.1]])
    model.set_normalization({"observation.state": {"mean": np.zeros(8), "std": np.ones(8)},
                             "where_target.agentview": {"mean": mean, "std": std}})  # fmt: skip
    batch = fake_batch(config=config)
    seen = {}
    model.state_mlp.register_forward_hook(lambda module, inputs, output: seen.update(state=inputs[0]))
    _, aux = model.encode(batch)  # training: the images are shifted, and the points with them
    located = aux.head[:, :4]  # the agentview's (x, y) of keypoint 0, then keypoint 1 (aux_input="keypoints")
    shift = aux.shift["agentview"]
    assert seen["state"].shape == (6, 8 + 4) and shift.abs().sum() > 0
    expected = (located - shift.repeat(1, 2) - torch.tensor(mean, dtype=torch.float32).reshape(-1)) / torch.tensor(std, dtype=torch.float32).reshape(-1)
    torch.testing.assert_close(seen["state"][:, 8:], expected)
    model.flow_loss(batch).mean().backward()
    agentview, wrist = model.vision["agentview"].locator, model.vision["wrist"].locator
    assert all(p.grad is None or not p.grad.any() for p in agentview.parameters())
    assert any(p.grad is not None and p.grad.any() for p in wrist.parameters())
    model.zero_grad()
    labels = torch.full((6, 2, 2, 2), float("nan"))
    labels[:, 0] = torch.tensor([[0.2, -0.1], [-0.5, 0.3]])
    model.aux_loss({**batch, "where_target": labels}, model.encode(batch)[1]).mean().backward()
    assert any(p.grad is not None and p.grad.any() for p in agentview.parameters())
    model.eval()
    context = model.features(batch)
    model.save_pretrained(str(tmp_path / "ckpt"))
    loaded = VLAPolicy.from_pretrained(str(tmp_path / "ckpt")).eval()
    torch.testing.assert_close(loaded.points_std, model.points_std)
    torch.testing.assert_close(loaded.features(batch), context)
    with pytest.raises(ValueError, match="state_points passes the target and goal points.*got vision_encoder 'patchify'"):
        tiny_config(state_points=("agentview",))
    with pytest.raises(ValueError, match=r"state_points names cameras \['front'\] the policy does not read"):
        tiny_config(vision_encoder="patchify_grounded", state_points=("front",))


def test_with_state_points_training_labels_the_policy_trains_on_the_pixel_labels_and_acts_on_its_locators_points():
    """Teacher forcing: in training the state's points are the samples' pixel labels (the locator's where a label is
    missing, NaN); acting reads the locator's points whatever the batch holds."""
    torch.manual_seed(0)
    config = tiny_config(vision_encoder="patchify_grounded", keypoints=2, state_points=("agentview",), state_points_training="labels",
                         aux_input="keypoints", aux_dim=2)  # fmt: skip
    model = VLAPolicy(config)
    seen = {}
    model.state_mlp.register_forward_hook(lambda module, inputs, output: seen.update(state=inputs[0]))
    batch = fake_batch(config=config)
    labels = torch.full((6, 2, 2, 2), float("nan"))
    labels[:3, 0] = torch.tensor([[0.2, -0.1], [-0.5, 0.3]])
    batch["where_target"] = labels
    located = model.encode(batch)[1].head[:, :4]
    torch.testing.assert_close(seen["state"][:3, 8:], labels[:3, 0].reshape(3, 4))
    torch.testing.assert_close(seen["state"][3:, 8:], located[3:])
    model.eval()
    located = model.encode(batch)[1].head[:, :4]
    torch.testing.assert_close(seen["state"][:, 8:], located)
    with pytest.raises(ValueError, match="state_points_training must be 'located' or 'labels'; got 'true'"):
        tiny_config(vision_encoder="patchify_grounded", state_points=("agentview",), state_points_training="true")


def test_a_finer_locator_scores_cells_of_its_own_map_and_a_checkpoint_keeps_its_resolution(tmp_path):
    """locator_stride=2: the locators score (image_size / 2)^2 cells, each camera's keypoint logits follow the new
    map, and the choice travels in config.json (a checkpoint acts the same after loading); checkpoints written
    before the field load at stride 4; any other stride is refused with what is allowed."""
    torch.manual_seed(0)
    config = tiny_config(vision_encoder="patchify_grounded", keypoints=3, locator_stride=2)
    model = VLAPolicy(config).eval()
    batch = fake_batch(2, config)
    _, aux = model.encode(batch)
    assert {cam: logits.shape for cam, logits in aux.where_logits.items()} == {
        cam: (2, 3, (config.image_size // 2) ** 2) for cam in config.cameras}
    model.save_pretrained(str(tmp_path / "ckpt"))
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["locator_stride"] == 2
    loaded = VLAPolicy.from_pretrained(str(tmp_path / "ckpt")).eval()
    noise = torch.randn(2, config.chunk_size, config.action_dim)
    torch.testing.assert_close(loaded.predict_action_chunk(batch, noise=noise), model.predict_action_chunk(batch, noise=noise))
    data = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del data["locator_stride"]
    assert VLAConfig.from_dict(data).locator_stride == 4
    with pytest.raises(ValueError, match="locator_stride must be 2 or 4"):
        tiny_config(vision_encoder="patchify_grounded", locator_stride=3)
