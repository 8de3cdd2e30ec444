import random

import pytest
import torch

from dflash_core.features import extract_features, length_sorted_batches
from dflash_core.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")

F32 = torch.float32


def _sequences(count=9, min_len=1, max_len=40, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(64) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def _assert_close_to_row_scale(actual, expected, tol=1e-5):
    """|a - b| <= tol * RMS of the row, for every position.

    Batched and one-by-one runs differ by float rounding only (kernels block by
    shape); measured < 3e-6 of the row RMS on these models in float32. An
    element-wise relative tolerance is meaningless for elements near zero.
    """
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = expected.float().pow(2).mean(-1, keepdim=True).sqrt()
    error = (actual.float() - expected.float()).abs() / scale
    assert error.max().item() <= tol, error.max().item()


@pytest.fixture(scope="module")
def targets(qwen3_dir, llama_tied_dir, qwen3_5_dirs, gemma3_dir):
    return {
        "qwen3": load_target(qwen3_dir, dtype=F32),
        "llama_tied": load_target(llama_tied_dir, dtype=F32),
        "qwen3_5": load_target(qwen3_5_dirs[1], dtype=F32),
        "gemma3": load_target(gemma3_dir, dtype=F32),
    }


FAMILIES = ["qwen3", "llama_tied", "qwen3_5", "gemma3"]


@pytest.mark.parametrize("name", FAMILIES)
def test_one_by_one_is_bitwise_hf_hidden_states(targets, name):
    target = targets[name]
    sequences = _sequences(count=3)
    layer_ids = list(reversed(range(target.num_layers)))  # includes the last layer; order is kept
    features = extract_features(target, sequences, layer_ids, batch_size=1)
    for ids, feats in zip(sequences, features):
        assert feats.shape == (len(layer_ids), len(ids), target.hidden_size)
        assert feats.dtype == target.dtype
        hidden_states = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        for k, layer_id in enumerate(layer_ids):
            assert torch.equal(feats[k], hidden_states[layer_id + 1][0]), layer_id
        # an off-by-one layer index would be visibly different
        assert not torch.allclose(feats[-1], hidden_states[0][0], atol=1e-3)


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_equals_one_by_one(targets, name):
    target = targets[name]
    sequences = _sequences(count=9, seed=1)
    layer_ids = [0, target.num_layers - 1]
    one_by_one = extract_features(target, sequences, layer_ids, batch_size=1)
    for batch_size in (4, 9):
        batched = extract_features(target, sequences, layer_ids, batch_size=batch_size)
        assert len(batched) == len(sequences)
        for ids, got, expected in zip(sequences, batched, one_by_one):
            assert got.shape == (2, len(ids), target.hidden_size)
            _assert_close_to_row_scale(got, expected)


def test_batching_does_not_depend_on_the_padding_content(targets):
    # right padding: a real token never sees the pad tokens, whatever they are
    target = targets["qwen3_5"]
    short, long = [5, 9, 2, 7], list(range(1, 30))
    features = extract_features(target, [short, long], [0, 1, 2], batch_size=2)[0]
    ids = torch.tensor([short + [63] * (len(long) - len(short)), long])
    out = target.forward(ids, layer_ids=[0, 1, 2], logits=False)  # no mask, other pad id
    for k in range(3):
        _assert_close_to_row_scale(features[k], out.features[k][0, : len(short)])


def test_layers_after_the_last_requested_are_not_run(targets):
    target = targets["qwen3_5"]  # 4 layers
    calls = [0] * target.num_layers
    hooks = [
        layer.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(target.backbone.layers)
    ]
    try:
        extract_features(target, _sequences(count=5), [1, 0], batch_size=2)
    finally:
        for h in hooks:
            h.remove()
    assert calls == [3, 3, 0, 0]


def test_length_sorted_batches_cut_padding(targets):
    assert length_sorted_batches([5, 50, 6, 49, 7], 2) == [[1, 3], [4, 2], [0]]
    target = targets["qwen3"]
    widths = []
    hook = target.backbone.layers[0].register_forward_hook(lambda m, a, o: widths.append(tuple(o.shape[:2])))
    try:
        sequences = _sequences(count=4, max_len=3, seed=2) + _sequences(count=4, min_len=30, max_len=33, seed=3)
        random.Random(0).shuffle(sequences)
        features = extract_features(target, sequences, [0], batch_size=4)
    finally:
        hook.remove()
    assert [w[0] for w in widths] == [4, 4]
    assert widths[0][1] <= 33 and widths[1][1] <= 3
    assert [f.shape[1] for f in features] == [len(s) for s in sequences]  # back in input order


def test_progress_and_tensor_inputs(targets):
    target = targets["qwen3"]
    sequences = [torch.tensor(s) for s in _sequences(count=5)]
    done = []
    features = extract_features(target, sequences, [1], batch_size=2, progress=done.append)
    assert done == [2, 4, 5]
    assert [f.shape[1] for f in features] == [len(s) for s in sequences]


def test_bfloat16_target(qwen3_dir):
    target = load_target(qwen3_dir)  # bfloat16 by default
    features = extract_features(target, _sequences(count=2), [0, 2])
    assert all(f.dtype == torch.bfloat16 for f in features)


# ---- errors


def test_empty_layer_ids(targets):
    with pytest.raises(ValueError, match="layer_ids is empty"):
        extract_features(targets["qwen3"], _sequences(count=1), [])


def test_layer_id_out_of_range(targets):
    with pytest.raises(ValueError, match="layer id 3 is out of range: the target has 3 layers"):
        extract_features(targets["qwen3"], _sequences(count=1), [0, 3])


def test_empty_sequence(targets):
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        extract_features(targets["qwen3"], [[1, 2], []], [0])


def test_sequence_longer_than_context(targets):
    with pytest.raises(ValueError, match="prompt of 65 tokens exceeds the target's context of 64"):
        extract_features(targets["llama_tied"], [[1] * 10, [1] * 65], [0])


def test_token_out_of_vocab(targets):
    with pytest.raises(ValueError, match="token id 64 is out of the target's vocabulary of 64"):
        extract_features(targets["qwen3"], [[1, 2, 64]], [0])


def test_batch_size_must_be_positive(targets):
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        extract_features(targets["qwen3"], _sequences(count=1), [0], batch_size=0)
