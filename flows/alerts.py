"""Create the alert automations: ``python -m flows.alerts --webhook-url URL``.

Saves a Custom Webhook notification block (``batching-alerts``) that POSTs ``{"title",
"text"}`` JSON to ``URL``, then (re)creates every automation in ``deployments/automations/``
with that block as the notification target. Running it again replaces them (same names).

The reconcile-failed notification's text is what a person reads: the findings one per line in
words (the event's ``findings_text``), the scoring run checked, and the reconcile flow run's
page in the UI (the event's ``flow_run_url``), not the repr of a payload dict.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit
from uuid import UUID

import yaml
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.client.orchestration import get_client
from prefect.events.schemas.automations import AutomationCore

from batching.redaction import redact_url
from flows import settings

AUTOMATIONS = settings.REPO / "deployments" / "automations"
BLOCK = "batching-alerts"


def save_webhook(url: str, name: str = BLOCK) -> UUID:
    """Save (or replace) the notification block that POSTs alerts to ``url``; returns its id."""
    block = CustomWebhookNotificationBlock(
        name=name, url=url, json_data={"title": "{{subject}}", "text": "{{body}}"}
    )
    return cast(UUID, block.save(name, overwrite=True))  # sync_compatible: a UUID here


def load_automation(path: Path, block_id: UUID) -> AutomationCore:
    """Read an automation file, pointing its notifications at ``block_id``."""
    spec: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    for action in spec.get("actions", []):
        if action.get("type") == "send-notification":
            action["block_document_id"] = str(block_id)
    return AutomationCore.model_validate(spec)


def create(url: str, paths: Iterable[Path] | None = None) -> dict[str, UUID]:
    """Save the webhook block and (re)create the automations; returns their ids by name."""
    block_id = save_webhook(url)
    created: dict[str, UUID] = {}
    with get_client(sync_client=True) as client:
        for path in sorted(paths or AUTOMATIONS.glob("*.yaml")):
            automation = load_automation(path, block_id)
            for old in client.read_automations_by_name(automation.name):
                client.delete_automation(old.id)
            created[automation.name] = client.create_automation(automation)
    return created


def webhook_url(text: str) -> str:
    """``--webhook-url``: an http(s) URL with a host, else refused (argparse exits 2)."""
    try:
        parts = urlsplit(text)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number, an unclosed IPv6 bracket
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(
            f"{redact_url(text)!r} is not an http(s) URL like https://hooks.example.com/alerts"
        )
    return text


def main(argv: list[str] | None = None) -> None:
    """Command line: ``--webhook-url URL``."""
    parser = argparse.ArgumentParser(prog="python -m flows.alerts", description=__doc__)
    parser.add_argument(
        "--webhook-url", required=True, type=webhook_url, help="where alerts are POSTed"
    )
    args = parser.parse_args(argv)
    for name, automation_id in create(args.webhook_url).items():
        print(f"automation {name}: {automation_id}")


if __name__ == "__main__":
    main()
