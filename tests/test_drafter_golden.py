"""The drafter's forward against values produced once with the z-lab DFlash reference (see
tests/golden/make_zlab_golden.py for how, tests/golden/zlab_drafter_forward.json for the commit)."""

import json

import pytest
import torch

from dflash_core.drafter import load_drafter
from tests.zlab_golden import CONTEXT, GOLDEN, RAW, case_inputs, write_case_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_forward_matches_the_z_lab_reference(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    assert golden["config"] == RAW and golden["context_tokens"] == CONTEXT  # the case the values were made for
    drafter = load_drafter(write_case_drafter(tmp_path / "drafter"), dtype=torch.float32, sliding_semantics="causal")
    features, block = case_inputs()
    with torch.no_grad():
        hidden = drafter(block[None], torch.tensor([CONTEXT]), [(k[None], v[None]) for k, v in drafter.context_kv(features)])[0]
    expected = torch.tensor(golden["hidden"])
    assert hidden.shape == expected.shape
    torch.testing.assert_close(hidden, expected, rtol=0, atol=2e-5)
