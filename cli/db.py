"""``ftq db upgrade``: bring the store (FTQ_DATABASE_URL, default SQLite under FTQ_DATA_DIR) to head."""

from __future__ import annotations

import argparse
from typing import Any

from core.settings import Settings


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("db", help="manage the job store")
    sub = parser.add_subparsers(dest="db_command", required=True, metavar="DB_COMMAND")
    upgrade = sub.add_parser("upgrade", help="apply the migrations (idempotent)")
    upgrade.add_argument("--revision", default="head", help="target revision (default: head)")
    upgrade.set_defaults(run=run_upgrade)


def run_upgrade(args: argparse.Namespace) -> int:
    settings = Settings().resolved()
    upgrade_store(settings, args.revision)
    print(f"store at {redact(settings.database_url or '')} is at {args.revision}")
    return 0


def upgrade_store(settings: Settings, revision: str = "head") -> None:
    from core.migrate import upgrade

    upgrade(settings.database_url or "", revision)


def redact(url: str) -> str:
    """The URL without its password, for printing."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a URL we cannot parse is printed as its scheme only
        return url.split(":", 1)[0] + "://…"
