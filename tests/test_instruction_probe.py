"""benchmarks/instruction_probe.py: the instruction's fields recovered from its template, and the probe run on a
real (untrained, tiny) checkpoint in a real MuJoCo task. (What it measured is in benchmarks/RESULTS.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from policies.vla.configuration_vla import VLAConfig
from policies.vla.modeling_vla import VLAPolicy

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "instruction_probe.py"
sys.path.insert(0, str(BENCH.parent))
from instruction_probe import template_fields  # noqa: E402


def test_template_fields_recovers_multi_word_values_and_names_a_foreign_instruction():
    templates = ("put the {object} on the {plate} plate", "move the {object} onto the {plate} plate")
    assert template_fields("move the dark red cube onto the blue plate", templates) == {"object": "dark red cube", "plate": "blue"}
    with pytest.raises(ValueError, match="'stack the red cube' was not written from any of the task's training templates"):
        template_fields("stack the red cube", templates)


def test_probe_reports_the_three_distances_and_their_ratio(tmp_path):
    config = VLAConfig(image_size=32, vision_channels=(8, 16, 16), vision_dim=32, text_dim=16, hidden_dim=32,
                       expert_hidden=64, expert_layers=2, state_hidden=16, chunk_size=4, n_action_steps=2, num_flow_steps=2)  # fmt: skip
    VLAPolicy(config).save_pretrained(str(tmp_path / "ckpt"))
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--task", "pick_place", "--policy", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    result = json.loads(out.strip().splitlines()[-1])["policies"][str(tmp_path / "ckpt")]
    assert set(result) == {"train", "heldout", "wrong_object", "heldout_over_wrong_object"}
    assert all(result[k] > 0 for k in ("train", "heldout", "wrong_object"))  # every rewording changes an untrained chunk
    assert result["heldout_over_wrong_object"] == pytest.approx(result["heldout"] / result["wrong_object"], abs=2e-3)
