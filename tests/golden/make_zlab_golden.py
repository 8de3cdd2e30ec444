"""Regenerate zlab_drafter_forward.json: the case of tests/zlab_golden.py through the z-lab reference forward.

Needs a checkout of https://github.com/z-lab/dflash (its dflash/model.py is imported from there, not
copied here). Run from the repository root:

    .venv/bin/python tests/golden/make_zlab_golden.py /path/to/z-lab-dflash [COMMIT]
"""

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.zlab_golden import CONTEXT, GOLDEN, RAW, case_inputs, write_case_drafter  # noqa: E402


def main(checkout: Path, commit: str) -> None:
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", checkout / "dflash" / "model.py")
    zlab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zlab)
    with tempfile.TemporaryDirectory() as tmp:
        model = zlab.DFlashDraftModel.from_pretrained(write_case_drafter(Path(tmp)), torch_dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    features, block = case_inputs()
    k, t, h = features.shape
    with torch.no_grad():
        hidden = model(position_ids=torch.arange(CONTEXT + block.shape[0])[None],
                       noise_embedding=block[None], target_hidden=features.permute(1, 0, 2).reshape(1, t, k * h),
                       is_causal=False)[0]
    GOLDEN.write_text(json.dumps({
        "source": "z-lab/dflash dflash/model.py DFlashDraftModel.forward, eager attention, no mask, is_causal=False",
        "commit": commit, "torch": torch.__version__, "config": RAW, "context_tokens": CONTEXT,
        "hidden": [[round(x, 7) for x in row] for row in hidden.tolist()],
    }, indent=1) + "\n")
    print(f"wrote {GOLDEN}: hidden {list(hidden.shape)}, sum {float(hidden.sum()):.6f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "unknown")
