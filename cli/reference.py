"""`serve-reference`: a reference server of our own, for tests and for machines without SGLang or vLLM."""

from typing import Annotated

import typer

from .common import configure_threads, decoding_threads, fail, token_from_file
from .options import DeviceOption, ServedDtype, Target, example

app = typer.Typer()


@app.command("serve-reference", epilog=example("dflash-eval serve-reference --target runs/tiny/target --port 30000"))
def serve_reference(
    target: Target,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on (0: any free "
                                      "port).")] = 30000,
    dtype: Annotated[ServedDtype, typer.Option("--dtype", help="auto (the checkpoint's own; float16 serves in "
                                               "float32, as evaluations compute), float32, bfloat16 or float16: the "
                                               "target's compute dtype.")] = "auto",
    device: DeviceOption = "cpu",
    served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="Model name in /v1/models and "
                                                          "responses (default: the target folder name).")] = None,
    api_key_file: Annotated[str | None, typer.Option("--api-key-file", help="File holding the API key clients must "
                                                     "send (Authorization: Bearer), as SGLang's --api-key; /health "
                                                     "needs none.")] = None,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="CPU threads each generation computes with "
                                                "(default: $OMP_NUM_THREADS, else every core, fewer for a target this "
                                                "small that decodes faster so).")] = None,
):
    """Serve the target's greedy completions over HTTP (SGLang /generate, OpenAI /v1/completions)
    until killed: a reference server for tests and for machines without SGLang or vLLM."""
    from dflash_eval.services.reference.server import serve_reference as serve

    api_key = token_from_file(api_key_file, "--api-key-file")
    try:
        name = str(dtype)
        if name == "auto":
            from dflash_eval.tasks.target import resolve_dtype

            choice = resolve_dtype(name, target)
            name = choice.name
            typer.echo(f"--dtype auto: {name} ({choice.note})" if choice.note else f"--dtype auto: {name}")
        configure_threads(threads if threads is not None else decoding_threads(target))
        serve(target, host=host, port=port, dtype=name, served_model_name=served_model_name, device=str(device),
              log=typer.echo, api_key=api_key)
    except (ValueError, OSError) as e:  # no such target, port in use
        fail(str(e))
