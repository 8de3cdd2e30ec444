# the tiny Gemma 4 DSpark drafter of tests/golden/make_deepspec_gemma4_golden.py (DeepSpec's config layout)
from deepspec.trainer import Gemma4DSparkTrainer

model = dict(target_model_name_or_path='../../target', **{'block_size': 7, 'num_draft_layers': 2, 'target_layer_ids': [1, 2], 'mask_token_id': 127, 'num_anchors': 16, 'markov_rank': 16, 'markov_head_type': 'vanilla', 'confidence_head_alpha': 1.0, 'confidence_head_with_markov': True, 'loss_decay_gamma': 4.0, 'ce_loss_alpha': 0.1, 'l1_loss_alpha': 0.9})
train = dict(trainer_cls=Gemma4DSparkTrainer, **{'lr': 0.003, 'local_batch_size': 8, 'max_train_steps': 600, 'precision': 'bf16'})
