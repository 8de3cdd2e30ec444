"""Record deepspec_markov.safetensors: DeepSpec's Markov heads (github deepseek-ai/DeepSpec, commit afdfa7c, MIT:
deepspec/modeling/dspark/markov_head.py) of each markov_head_type read here (vanilla, gated), each made by its own
`build_markov_head` with seeded weights, and what each computes from the same inputs: its greedy walk over a block
(`sample_block_tokens` at temperature 0, which DeepSpec's drafting calls: the tokens chosen and the biased logits).

What it writes (tests/golden/deepspec_markov.safetensors, float32):
- `base_logits` [N, D, V], `hidden` [N, D, H], `first_previous` [N]: N blocks of D slots, the backbone's logits and
  hidden states (seeded random) and the anchor before the first slot;
- per type T: `T.<tensor>` its weights under DeepSpec's names (markov_w1.weight, markov_w2.weight, and gated's
  gate_proj.weight and .bias), `T.tokens` [N, D] and `T.logits` [N, D, V] its walk;
- metadata: DeepSpec's commit, the versions, the sizes.

Run once, with DeepSpec's checkout and its requirements (torch, transformers 5.10.2):
    /tmp/deepspec-venv/bin/python tests/golden/make_deepspec_markov_golden.py --deepspec /tmp/deepspec-src
DeepSpec's code runs as it is, imported from the checkout (never copied here); no adaptation is needed on a CPU.
"""

import argparse
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

OUT = Path(__file__).parent / "deepspec_markov.safetensors"
TYPES = ("vanilla", "gated")  # (its rnn head is refused: tests/test_deepspec_golden.py)
N, D, V, H, RANK = 4, 7, 64, 16, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspec", type=Path, default=Path("/tmp/deepspec-src"), help="a DeepSpec checkout")
    args = parser.parse_args()
    sys.path.insert(0, str(args.deepspec))
    from deepspec.modeling.dspark.markov_head import build_markov_head

    commit = subprocess.run(["git", "-C", str(args.deepspec), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    generator = torch.Generator().manual_seed(0)
    tensors = {"base_logits": 2 * torch.randn(N, D, V, generator=generator),
               "hidden": torch.randn(N, D, H, generator=generator),
               "first_previous": torch.randint(0, V, (N,), generator=generator)}
    for kind in TYPES:
        torch.manual_seed(1)  # its weights as its constructor draws them, then spread so that the bias matters
        head = build_markov_head(SimpleNamespace(markov_rank=RANK, markov_head_type=kind, vocab_size=V, hidden_size=H))
        with torch.no_grad():
            for parameter in head.parameters():
                parameter.mul_(3.0)
        with torch.no_grad():
            tokens, logits = head.sample_block_tokens(tensors["base_logits"], first_prev_token_ids=tensors[
                "first_previous"], hidden_states=tensors["hidden"], temperature=0.0)
        tensors.update({f"{kind}.{name}": t.detach().clone() for name, t in head.state_dict().items()})
        tensors[f"{kind}.tokens"], tensors[f"{kind}.logits"] = tokens, logits
    metadata = {"source": f"github deepseek-ai/DeepSpec {commit} (MIT): build_markov_head, sample_block_tokens "
                          "(temperature 0)", "torch": torch.__version__, "sizes": f"N={N} D={D} V={V} H={H} rank={RANK}"}
    save_file(tensors, OUT, metadata=metadata)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
