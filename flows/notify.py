"""Tell the Prefect server that a checkpoint was saved: event `dflash.checkpoint.saved`, whose payload
names the checkpoint; the evaluate-checkpoint deployment's trigger starts an evaluation of it.

For training scripts, so it never raises and never waits long: an unreachable server, a missing
PREFECT_API_URL or a refused event is reported on stderr, and the trainer goes on. With Prefect
installed the event goes through `prefect.events.emit_event`; without it (a trainer's own environment)
it is POSTed to `$PREFECT_API_URL/events` with the standard library alone, so this file also works
copied on its own: `python notify.py --checkpoint http://relay:8700/run1/step_1000 --step 1000`.
"""

import argparse
import datetime
import json
import logging
import os
import sys
import urllib.error
import urllib.request
import uuid

EVENT = "dflash.checkpoint.saved"
RESOURCE_PREFIX = "dflash.checkpoint."  # + the checkpoint; triggers match "dflash.checkpoint.*"


def checkpoint_event(checkpoint: str, step: int | None = None) -> dict:
    """The event as Prefect's API takes it."""
    payload = {"checkpoint": checkpoint} | ({"step": step} if step is not None else {})
    return {
        "id": str(uuid.uuid4()),
        "occurred": datetime.datetime.now(datetime.UTC).isoformat(),
        "event": EVENT,
        "resource": {"prefect.resource.id": RESOURCE_PREFIX + checkpoint, "prefect.resource.name": checkpoint},
        "payload": payload,
    }


def notify(checkpoint: str, step: int | None = None, api_url: str | None = None, timeout: float = 3.0,
           use_prefect: bool = True) -> bool:
    """Send the event; True if the server took it. Never raises: failures are printed to stderr."""
    api_url = (api_url or os.environ.get("PREFECT_API_URL") or "").rstrip("/")
    if not api_url:
        _warn("PREFECT_API_URL is not set: no event sent (set it to the Prefect server's API, "
              "e.g. http://eval-box:4200/api)")
        return False
    try:  # one quick probe, so a dead server costs `timeout` seconds at most
        urllib.request.urlopen(f"{api_url}/health", timeout=timeout).close()
    except (urllib.error.URLError, OSError, ValueError) as e:
        _warn(f"the Prefect server at {api_url} is unreachable ({_reason(e)}): no evaluation was triggered for "
              f"{checkpoint}; a relay watcher or `dflash-eval run` can still evaluate it")
        return False
    event = checkpoint_event(checkpoint, step)
    if use_prefect:
        try:
            from prefect.events import emit_event
            from prefect.settings import PREFECT_API_URL, temporary_settings
        except ImportError:
            pass
        else:
            try:
                with temporary_settings({PREFECT_API_URL: api_url}):
                    emit_event(event=event["event"], resource=event["resource"], payload=event["payload"],
                               id=uuid.UUID(event["id"]))
                    _deliver_now(timeout)
                return True
            except Exception as e:  # noqa: BLE001 - a trainer must never crash on a notification
                _warn(f"emitting the event through Prefect failed ({e}); posting it over HTTP instead")
    try:
        request = urllib.request.Request(f"{api_url}/events", data=json.dumps([event]).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=timeout).close()
        return True
    except (urllib.error.URLError, OSError, ValueError) as e:
        _warn(f"the Prefect server at {api_url} did not take the event ({_reason(e)})")
        return False


def _deliver_now(timeout: float) -> None:
    """Send what emit_event queued before returning, not at the process's exit: "sent" is then true, and Prefect's
    events worker, stopped at exit with the event still queued, does not print "Still processing items"."""
    from prefect.events.worker import EventsWorker

    worker_log = logging.getLogger("EventsWorker")  # it warns of the queued event as it drains it
    level = worker_log.level
    worker_log.setLevel(logging.ERROR)
    try:
        EventsWorker.drain_all(timeout=timeout)
    finally:
        worker_log.setLevel(level)


def _reason(e: Exception) -> str:
    return str(getattr(e, "reason", None) or e)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="Where the evaluation fetches it: a relay URL or a folder.")
    parser.add_argument("--step", type=int, default=None, help="Its training step (shown with the event).")
    parser.add_argument("--api-url", default=None, help="Prefect API URL (default $PREFECT_API_URL).")
    args = parser.parse_args(argv)
    if notify(args.checkpoint, args.step, args.api_url):
        print(f"sent {EVENT} for {args.checkpoint}")
    return 0  # always: a training job must not stop over its evaluation


if __name__ == "__main__":
    sys.exit(main())
