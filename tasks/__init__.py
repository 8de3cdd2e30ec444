"""One thin Prefect task per stage: fetch, references, features, drafts, scores, diagnostics, baselines.

Tasks are thin: they compute a stage's content key, ask the store for the entry (tasks/stage.py:
the store is the cache, and a hit shows as `Cached` in Prefect), and otherwise call dflash_core
and write the entry. They pass small records (paths and content keys), never tensors.
"""
