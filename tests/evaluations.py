"""Evaluations as a script runs them: the evaluate-checkpoint flow (or a rerun-<stage> flow) with its settings given
by name, flat, as on the command line (flows.settings.by_group puts each in its group); and a setting's place in a
deployment's form."""

from dflash_eval.flows.settings import by_group


def run_evaluation(flow=None, *, return_state: bool = False, **settings):
    """Run `flow` (default evaluate-checkpoint) with these settings (`drafter`, `target`, `max_new_tokens`, ...)."""
    from dflash_eval.flows.evaluate import evaluate_checkpoint

    return (flow or evaluate_checkpoint)(**by_group(settings), return_state=return_state)


def setting_schema(schema: dict, group: str, name: str) -> dict:
    """The form's schema of setting `name` in section `group` of a deployment's parameters (its schema)."""
    definition = schema["properties"][group]["$ref"].rsplit("/", 1)[1]
    return schema["definitions"][definition]["properties"][name]
