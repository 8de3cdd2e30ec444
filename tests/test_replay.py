"""The offline replay gives exactly the acceptance lengths of real greedy speculative decoding.

The oracle is `speculative_decode`: the target verifies every drafted block. Its output must equal
plain greedy decoding, and the replay over the greedy reference's teacher-forced features must
reproduce its acceptance lengths block by block.

Drafters here have random weights, so a tiny vocabulary (24 tokens) makes chance agreement common
enough that acceptance lengths vary (asserted); the trained fixtures make the strong version.
"""

import pytest
import torch
from transformers import AutoModel, Qwen3ForCausalLM

from dflash_core.decoding import greedy_decode, speculative_decode
from dflash_core.features import extract_features
from dflash_core.replay import BlockScorer, Reference, replay
from dflash_core.target import Target, load_target
from tests.drafters import drafter_config, random_drafter
from tests.tiny_models import qwen3_config

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 24
STOP = 3


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def qwen3_target():
    torch.manual_seed(0)
    return Target.from_model(Qwen3ForCausalLM(qwen3_config(vocab_size=VOCAB, num_hidden_layers=4, initializer_range=0.2)))


def online_and_replay(target, drafter, prompt_list, max_new_tokens=40, all_positions=False):
    online = [speculative_decode(target, drafter, p, max_new_tokens, stop_token_ids=[STOP]) for p in prompt_list]
    greedy = [greedy_decode(target, p, max_new_tokens, stop_token_ids=[STOP]) for p in prompt_list]
    references = [Reference(len(p), g) for p, g in zip(prompt_list, greedy)]
    features = extract_features(target, [r.token_ids for r in references], drafter.target_layer_ids)
    replayed = replay(drafter, target.embed_weight, target.head_weight, references, features, all_positions=all_positions)
    return online, greedy, replayed


def assert_replay_equals_online(online, greedy, replayed, block_size):
    lengths = []
    for on, g, rp in zip(online, greedy, replayed):
        assert on.output_ids == g, "speculative decoding must emit exactly the greedy continuation"
        assert rp.starts == on.starts
        assert rp.acceptance_lengths == on.acceptance_lengths
        assert sum(on.acceptance_lengths) == len(g) - on.prompt_len - 1
        lengths += on.acceptance_lengths
    assert max(lengths) > 1 and min(lengths) == 1, f"acceptance lengths do not vary: {lengths}"
    assert max(lengths) <= block_size
    return lengths


@pytest.mark.parametrize("semantics", ["causal", "non_causal"])
def test_replay_equals_online_loop(qwen3_target, semantics):
    # one sliding layer with a short window so that the semantics and the window both matter
    raw = drafter_config(hidden_size=64, num_layers=2, block_size=6, layer_ids=(1, 2), mask_token_id=0,
                         layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    drafter = random_drafter(raw, seed=11, sliding_semantics=semantics, scale=3.0)
    online, greedy, replayed = online_and_replay(qwen3_target, drafter, prompts())
    assert_replay_equals_online(online, greedy, replayed, drafter.block_size)


def test_all_positions_mode_agrees_with_decode_mode(qwen3_target):
    raw = drafter_config(hidden_size=64, block_size=5, layer_ids=(0, 2), mask_token_id=0)
    drafter = random_drafter(raw, seed=12, scale=3.0)
    online, greedy, replayed = online_and_replay(qwen3_target, drafter, prompts(seed=1), all_positions=True)
    assert_replay_equals_online(online, greedy, replayed, drafter.block_size)
    decode_only = replay(drafter, qwen3_target.embed_weight, qwen3_target.head_weight,
                         [Reference(len(p), g) for p, g in zip(prompts(seed=1), greedy)],
                         extract_features(qwen3_target, greedy, drafter.target_layer_ids))
    for full, dec, g, p in zip(replayed, decode_only, greedy, prompts(seed=1)):
        assert len(full.all_positions) == len(g) - len(p) - 1
        assert [full.all_positions[s - len(p)] for s in full.starts] == full.acceptance_lengths
        assert dec.acceptance_lengths == full.acceptance_lengths
        assert dec.rejected_drafts == full.rejected_drafts


def test_all_positions_mode_counts_teacher_forced_hits_per_position(qwen3_target):
    """Each draft position's accuracy whatever came before it (as training measures it): counted from the
    drafter's whole block at every start, which a test recomputes with BlockScorer.draft_tokens."""
    raw = drafter_config(hidden_size=64, block_size=5, layer_ids=(0, 2), mask_token_id=0)
    drafter = random_drafter(raw, seed=12, scale=3.0)
    ps = prompts(seed=1)
    refs = [Reference(len(p), greedy_decode(qwen3_target, p, 40, stop_token_ids=[STOP])) for p in ps]
    feats = extract_features(qwen3_target, [r.token_ids for r in refs], drafter.target_layer_ids)
    args = (drafter, qwen3_target.embed_weight, qwen3_target.head_weight, refs, feats)
    replayed = replay(*args, all_positions=True)
    scorer = BlockScorer(*args)
    expected = [[0, 0] for _ in range(drafter.block_size - 1)]
    for s, ref in enumerate(refs):
        starts = range(ref.prompt_len, ref.end - 1)
        for p, drafts in zip(starts, scorer.draft_tokens([(s, p) for p in starts])):
            for k, d in enumerate(drafts, start=1):
                if p + k < ref.end:
                    expected[k - 1][0] += d == ref.token_ids[p + k]
                    expected[k - 1][1] += 1
    counted = [[sum(r.position_hits[k][i] for r in replayed) for i in (0, 1)] for k in range(drafter.block_size - 1)]
    assert counted == expected
    # position 3 also matches in blocks that missed before it: more hits than blocks accepting 1..3
    accepting_three = sum(a >= 4 for r in replayed for a in r.all_positions)
    assert counted[2][0] > accepting_three, "no position 3 hit after a miss: teacher forcing not exercised"


def test_replay_batches_equal_one_at_a_time(qwen3_target):
    raw = drafter_config(hidden_size=64, block_size=4, layer_ids=(1, 2), mask_token_id=0)
    drafter = random_drafter(raw, seed=13, scale=3.0)
    ps = prompts(seed=2)
    refs = [Reference(len(p), greedy_decode(qwen3_target, p, 30)) for p in ps]
    feats = extract_features(qwen3_target, [r.token_ids for r in refs], drafter.target_layer_ids)
    args = (drafter, qwen3_target.embed_weight, qwen3_target.head_weight, refs, feats)
    batched = replay(*args, all_positions=True)
    single = replay(*args, all_positions=True, max_blocks=1)
    assert [r.all_positions for r in batched] == [r.all_positions for r in single]


def test_features_are_read_one_at_a_time(qwen3_target):
    """replay takes any iterable of features and holds one at a time: a generator that reads them from
    the store (tasks/drafts.py) gives the same result as a list."""
    raw = drafter_config(hidden_size=64, block_size=4, layer_ids=(1, 2), mask_token_id=0)
    drafter = random_drafter(raw, seed=13, scale=3.0)
    refs = [Reference(len(p), greedy_decode(qwen3_target, p, 12)) for p in prompts(seed=3)]
    feats = extract_features(qwen3_target, [r.token_ids for r in refs], drafter.target_layer_ids)
    args = (drafter, qwen3_target.embed_weight, qwen3_target.head_weight, refs)
    live = []

    def read_one_by_one():
        for f in feats:
            live.append(f.clone())
            yield live[-1]
            live.pop()  # the replay asked for the next one: it no longer needs this one

    lazy = replay(*args, read_one_by_one())
    assert [(r.starts, r.acceptance_lengths) for r in lazy] == [(r.starts, r.acceptance_lengths) for r in replay(*args, feats)]
    assert live == []
    with pytest.raises(ValueError, match=f"{len(refs)} references but {len(refs) - 1} feature tensors"):
        replay(*args, iter(feats[:-1]))


def test_clipped_last_step_and_stop_token(qwen3_target):
    raw = drafter_config(hidden_size=64, block_size=8, layer_ids=(1, 2), mask_token_id=0)
    drafter = random_drafter(raw, seed=14, scale=3.0)
    # a reference the target wrote, truncated by max_new_tokens: every step fits what is left
    for p in prompts(seed=3):
        on = speculative_decode(qwen3_target, drafter, p, 7)
        g = greedy_decode(qwen3_target, p, 7)
        assert on.output_ids == g and len(g) == len(p) + 7
        rp = replay(drafter, qwen3_target.embed_weight, qwen3_target.head_weight, [Reference(len(p), g)],
                    extract_features(qwen3_target, [g], drafter.target_layer_ids))[0]
        assert rp.acceptance_lengths == on.acceptance_lengths and sum(rp.acceptance_lengths) == 6


def test_lookahead_scores_the_last_step_against_a_whole_block(qwen3_target):
    raw = drafter_config(hidden_size=64, block_size=6, layer_ids=(1, 2), mask_token_id=0)
    drafter = random_drafter(raw, seed=15, scale=3.0)
    head = (qwen3_target.embed_weight, qwen3_target.head_weight)
    for p in prompts(seed=4):
        # the completion is 10 tokens; 5 more greedy tokens (B - 1) are lookahead
        full = greedy_decode(qwen3_target, p, 15)
        end = len(p) + 10
        feats = extract_features(qwen3_target, [full], drafter.target_layer_ids)
        looked, unbounded = (replay(drafter, *head, [ref], feats)[0]
                             for ref in (Reference(len(p), full, completion_end=end), Reference(len(p), full)))
        clipped = replay(drafter, *head, [Reference(len(p), full[:end])], [feats[0][:, :end]])[0]
        # the same decode chain up to the completion's end ...
        assert looked.starts == clipped.starts == [s for s in unbounded.starts if s < end - 1]
        assert looked.acceptance_lengths == unbounded.acceptance_lengths[: len(looked.starts)]
        assert looked.acceptance_lengths[:-1] == clipped.acceptance_lengths[:-1]
        # ... and a last step no longer cut at the end of the completion
        assert looked.acceptance_lengths[-1] >= clipped.acceptance_lengths[-1]
        assert sum(clipped.acceptance_lengths) == 9


def test_off_by_one_layer_changes_acceptance(qwen3_target):
    raw = drafter_config(hidden_size=64, block_size=6, layer_ids=(1, 2), mask_token_id=0)
    drafter = random_drafter(raw, seed=15, scale=3.0)
    ps = prompts(n=8, seed=4)
    refs = [Reference(len(p), greedy_decode(qwen3_target, p, 40, [STOP])) for p in ps]
    right = extract_features(qwen3_target, [r.token_ids for r in refs], [1, 2])
    shifted = extract_features(qwen3_target, [r.token_ids for r in refs], [0, 1])
    args = (drafter, qwen3_target.embed_weight, qwen3_target.head_weight, refs)
    a = replay(*args, right, all_positions=True)
    b = replay(*args, shifted, all_positions=True)
    assert [r.all_positions for r in a] != [r.all_positions for r in b]


def test_hybrid_target_rolls_back_recurrent_state(qwen3_5_dirs):
    """Qwen3.5 (Gated DeltaNet + full attention), loaded three ways: identical, exact results."""
    text_dir, vlm_dir = qwen3_5_dirs
    targets = {
        "text": load_target(text_dir, dtype=torch.float32),
        "vlm": load_target(vlm_dir, dtype=torch.float32),
        "automodel": Target.from_model(AutoModel.from_pretrained(vlm_dir, dtype=torch.float32), checkpoint_dir=vlm_dir),
    }
    raw = drafter_config(hidden_size=64, block_size=5, layer_ids=(0, 2), mask_token_id=0, num_target_layers=4)
    drafter = random_drafter(raw, seed=16, scale=3.0)
    ps = [[t % 60 for t in p] for p in prompts(n=5, seed=5)]
    results = {}
    for name, target in targets.items():
        online = [speculative_decode(target, drafter, p, 30) for p in ps]
        greedy = [greedy_decode(target, p, 30) for p in ps]
        refs = [Reference(len(p), g) for p, g in zip(ps, greedy)]
        replayed = replay(drafter, target.embed_weight, target.head_weight, refs,
                          extract_features(target, greedy, drafter.target_layer_ids))
        lengths = []
        for on, g, rp in zip(online, greedy, replayed):
            assert on.output_ids == g, f"{name}: speculative decoding diverged from greedy"
            assert rp.acceptance_lengths == on.acceptance_lengths, name
            lengths += on.acceptance_lengths
        # partial acceptances happened, so the rollback was exercised
        assert any(1 < a < drafter.block_size for a in lengths) or (max(lengths) > 1 and min(lengths) == 1)
        results[name] = ([o.output_ids for o in online], [o.acceptance_lengths for o in online])
    assert results["text"] == results["vlm"] == results["automodel"]


def test_without_rollback_hybrid_decoding_goes_wrong(qwen3_5_dirs, monkeypatch):
    """Negative control: cropping alone (no recurrent-state restore) silently diverges from greedy."""
    import dflash_core.decoding as decoding

    target = load_target(qwen3_5_dirs[0], dtype=torch.float32)
    raw = drafter_config(hidden_size=64, block_size=5, layer_ids=(0, 2), mask_token_id=0, num_target_layers=4)
    drafter = random_drafter(raw, seed=16, scale=3.0)
    ps = [[t % 60 for t in p] for p in prompts(n=5, seed=5)]
    greedy = [greedy_decode(target, p, 30) for p in ps]
    monkeypatch.setattr(decoding, "_restore", lambda layers, snapshot: None)
    naive = [speculative_decode(target, drafter, p, 30).output_ids for p in ps]
    assert naive != greedy


@pytest.mark.parametrize("raw_edit,target_layers,message", [
    (dict(hidden_size=32), 4, "drafter hidden_size 32 != target hidden_size 64"),
    (dict(mask_token_id=VOCAB), 4, f"mask_token_id {VOCAB} is outside the target's vocabulary of {VOCAB}"),
    (dict(layer_ids=(1, 4)), 4, r"include \[4\], but the target's text model has only 4 layers"),
])
def test_incompatible_drafter_is_refused(qwen3_target, raw_edit, target_layers, message):
    from dflash_core.drafter_config import DrafterError

    raw = drafter_config(**{**dict(hidden_size=64, layer_ids=(1, 2), mask_token_id=0), **raw_edit})
    drafter = random_drafter(raw)
    with pytest.raises(DrafterError, match=message):
        speculative_decode(qwen3_target, drafter, [5, 6, 7], 5)


def test_prompt_longer_than_context_is_refused(qwen3_target):
    drafter = random_drafter(drafter_config(hidden_size=64, layer_ids=(1, 2), mask_token_id=0))
    with pytest.raises(ValueError, match="prompt of 120 tokens \\+ 20 new tokens exceeds the target's context of 128"):
        speculative_decode(qwen3_target, drafter, [5] * 120, 20)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        greedy_decode(qwen3_target, [5, VOCAB + 1], 3)


def test_replay_refuses_mismatched_inputs(qwen3_target):
    from dflash_core.drafter_config import DrafterError

    refs = [Reference(3, [5, 6, 7, 8, 9])]
    feats = extract_features(qwen3_target, [r.token_ids for r in refs], [1, 2])
    small = random_drafter(drafter_config(hidden_size=32, layer_ids=(1, 2), mask_token_id=0))
    with pytest.raises(DrafterError, match="drafter hidden_size 32 != target hidden_size 64"):
        replay(small, qwen3_target.embed_weight, qwen3_target.head_weight, refs, feats)
    three_layers = random_drafter(drafter_config(hidden_size=64, layer_ids=(0, 1, 2), mask_token_id=0))
    with pytest.raises(ValueError, match=r"this drafter needs 3 layers \[0, 1, 2\]"):
        replay(three_layers, qwen3_target.embed_weight, qwen3_target.head_weight, refs, feats)
    good = random_drafter(drafter_config(hidden_size=64, layer_ids=(1, 2), mask_token_id=0))
    with pytest.raises(ValueError, match=r"token ids \[99\] are outside"):
        replay(good, qwen3_target.embed_weight, qwen3_target.head_weight, [Reference(3, [5, 6, 7, 99])], feats)
    with pytest.raises(ValueError, match="features cover 5 tokens, the reference needs 6"):
        replay(good, qwen3_target.embed_weight, qwen3_target.head_weight, [Reference(3, [5, 6, 7, 8, 9, 10, 11])], feats)


def test_agreement_counts_equal_a_block_by_block_count(qwen3_target):
    """The diagnostics' agreement counts, drafted in padded batches of blocks from many references, equal a
    count over one block at a time; the target's next tokens from its last layer's features are its greedy
    ones (the references here are greedy)."""
    from dflash_core.diagnostics import LABEL_OFFSETS, agreement_counts, next_tokens

    raw = drafter_config(hidden_size=64, block_size=5, layer_ids=(0, 2), mask_token_id=0)
    drafter = random_drafter(raw, seed=12, scale=3.0)
    refs = [Reference(len(p), greedy_decode(qwen3_target, p, 20, stop_token_ids=[STOP])) for p in prompts(seed=2)]
    last = qwen3_target.num_layers - 1
    feats = extract_features(qwen3_target, [r.token_ids for r in refs], [0, 2, last])
    target_next = [next_tokens(f[2], qwen3_target.head_weight, rows=7) for f in feats]
    for ref, following in zip(refs, target_next):  # greedy: the target's next token is the reference's
        assert following[ref.prompt_len - 1:len(ref.token_ids) - 1].tolist() == list(ref.token_ids[ref.prompt_len:])
    inputs = [f[:2] for f in feats]
    counted = agreement_counts(drafter, qwen3_target.embed_weight, qwen3_target.head_weight, refs, inputs,
                               target_next, blocks_per_pass=5)
    scorer = BlockScorer(drafter, qwen3_target.embed_weight, qwen3_target.head_weight, refs, inputs)
    expected = {name: [0, 0] for name in ("context", "references", *LABEL_OFFSETS)}
    for s, ref in enumerate(refs):
        tokens = ref.token_ids
        for p in range(1, len(tokens) - 1):
            (drafted,) = scorer.draft_tokens([(s, p)])
            where = "context" if p + 1 < ref.prompt_len else "references"
            expected[where][0] += drafted[0] == int(target_next[s][p])
            expected[where][1] += 1
            if where == "references":
                for name, shift in LABEL_OFFSETS.items():
                    for k, d in enumerate(drafted, start=1):
                        if 0 <= p + k + shift < len(tokens):
                            expected[name][0] += d == tokens[p + k + shift]
                            expected[name][1] += 1
    assert counted == expected
    assert 0 < counted["references"][0] < counted["references"][1] and counted["context"][1] > 0
