"""`relay serve` and `relay ls`: checkpoints from a training box to this one over HTTP."""

from pathlib import Path
from typing import Annotated

import typer

from .common import fail, open_store, token_from_file
from .options import StoreRoot, example

app = typer.Typer(help="Move checkpoints from a training box to this one over HTTP.", no_args_is_help=True)


@app.command("serve", epilog=example("dflash-eval relay serve runs/tiny/drafter --port 8700"))
def relay_serve(
    root: Annotated[Path | None, typer.Argument(help="Folder to serve checkpoints from (any depth); optional with "
                                                "--upstream.")] = None,
    upstream: Annotated[str | None, typer.Option("--upstream", help="Pull checkpoints through from this relay "
                                                 "(http://HOST:PORT).")] = None,
    upstream_token_file: Annotated[str | None, typer.Option("--upstream-token-file", help="File holding the "
                                                            "upstream's token.")] = None,
    token_file: Annotated[str | None, typer.Option("--token-file", help="File holding the bearer token clients must "
                                                   "send.")] = None,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535)] = 8700,
    state_dir: Annotated[Path | None, typer.Option("--state-dir", help="Digest cache and pulled-through files "
                                                   "(default ~/.cache/dflash-eval/relay).")] = None,
    settle_seconds: Annotated[float, typer.Option(
        "--settle-seconds", min=0, help="A checkpoint is listed once none of its "
        "files changed for this long (trainers write no completion "
        "marker).")] = 30,
    max_rate_mb: Annotated[float | None, typer.Option(
        "--max-rate-mb", min=0.001, help="Cap on MB/s sent over all downloads "
        "together (leave bandwidth to a trainer on the same link); "
        "default no cap.")] = None,
    max_connections: Annotated[int, typer.Option(
        "--max-connections", min=1, help="Connections served at once; more get "
        "503 + Retry-After (one thread each, so this bounds the "
        "threads).")] = 128,
    max_connections_per_client: Annotated[int, typer.Option(
        "--max-connections-per-client", min=1, help="Connections served "
        "at once from one address (IPv6: one /64).")] = 32,
    request_timeout: Annotated[float, typer.Option(
        "--request-timeout", min=0.001, help="Seconds a request may take to arrive "
        "whole, and an idle keep-alive connection stays open.")] = 30,
):
    """Serve the checkpoints under ROOT over HTTP: Hugging Face folders (config.json + safetensors) and
    SpecForge saves, at any depth; only the files evaluation needs are hashed and sent.

    A checkpoint's URL is the relay's URL + its folder relative to ROOT, e.g.
    `dflash-eval run --drafter http://relay:8700/run1/step_1000 ...`.
    """
    import logging

    from dflash_eval.services.relay.server import DEFAULT_STATE_DIR, RelayServer

    if root is None and upstream is None:
        raise typer.BadParameter("give a folder to serve, or --upstream", param_hint="ROOT")
    if root is not None and not root.is_dir():
        raise typer.BadParameter(f"{root} is not a directory", param_hint="ROOT")
    token = token_from_file(token_file, "--token-file")
    upstream_token = token_from_file(upstream_token_file, "--upstream-token-file")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        relay = RelayServer(root, host=host, port=port, token=token, upstream=upstream, upstream_token=upstream_token,
                            state_dir=state_dir or DEFAULT_STATE_DIR, settle_seconds=settle_seconds,
                            max_rate=max_rate_mb * 1e6 if max_rate_mb else None, max_connections=max_connections,
                            max_connections_per_client=max_connections_per_client, request_timeout=request_timeout)
    except OSError as e:  # the port taken, the address not this machine's, the state folder not writable
        fail(f"the relay cannot start on {host}:{port}: {e.strerror or e}")
    typer.echo(f"relay listening on {relay.url}")
    relay.serve_forever()  # until Ctrl+C


@app.command("ls", epilog=example("dflash-eval relay ls http://127.0.0.1:8700 --store .dflash-store"))
def relay_ls(
    url: Annotated[str, typer.Argument(help="The relay, http://HOST:PORT.")],
    store: StoreRoot = None,
    token_file: Annotated[str | None, typer.Option("--token-file", help="File holding the relay's bearer "
                                                   "token.")] = None,
):
    """List a relay's checkpoints: path, step, size, and whether this store already holds them."""
    from rich.console import Console
    from rich.table import Table

    from dflash_eval.services.relay.client import RelayClient, RelayError
    from dflash_eval.storage.schema import Stage

    try:
        client = RelayClient(url, token=token_from_file(token_file, "--token-file"))
        checkpoints = client.list_checkpoints()
        held_in = open_store(store)
        held = [held_in.is_complete(Stage.FETCH, client.manifest(c["path"])["key"]) for c in checkpoints]
    except RelayError as e:
        fail(str(e))
    table = Table(title=f"{url}: {len(checkpoints)} checkpoints")
    for column in ("checkpoint", "step", "layout", "size (what evaluation fetches)", "in store"):
        table.add_column(column)
    for checkpoint, in_store in zip(checkpoints, held):
        table.add_row(f"{url.rstrip('/')}/{checkpoint['path']}", str(checkpoint["step"] if checkpoint["step"] is not None else "-"),
                      checkpoint.get("layout", "hf"), f"{checkpoint['total_bytes'] / 1e6:.1f} MB", "yes" if in_store else "no")
    Console(width=200).print(table)
