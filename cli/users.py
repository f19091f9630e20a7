"""``ftq users ...`` (on the box, straight to the store) and ``ftq login`` (on any client).

    ftq users create NAME [--admin] [--max-running N]   prints the new user's key once
    ftq users list                                      users, caps and their keys' prefixes
    ftq users key NAME [--label L]                      a new key for NAME, printed once
    ftq users revoke PREFIX                             revoke a key (prefix or key id)
    ftq users set NAME [--max-running N|default] [--admin|--no-admin] [--disable|--enable]
    ftq login --key KEY [--url URL]                     check the key, save it to the config file

The ``users`` commands need the store (``FTQ_DATABASE_URL``, default the embedded SQLite under
``FTQ_DATA_DIR``), not the API: they are how the first admin of a production install is made.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.orm import Session

from cli.errors import CliError
from core.settings import Settings


def add_parsers(commands: Any) -> None:
    parser = commands.add_parser("users", help="manage users and API keys (on the box: uses the store)")
    sub = parser.add_subparsers(dest="users_command", required=True, metavar="USERS_COMMAND")

    p = sub.add_parser("create", help="create a user and print its first API key (shown once)")
    p.add_argument("name")
    p.add_argument("--admin", action="store_true", help="may manage users and cancel/delete anyone's jobs/files")
    p.add_argument("--max-running", type=int, help="cap on the user's concurrently running jobs")
    p.add_argument("--project", dest="projects", action="append", metavar="NAME",
                   help="a project the user joins (repeatable; the first is their default; none: 'default')")
    p.set_defaults(run=run_create)

    p = sub.add_parser("list", help="users with their caps and keys (prefixes only)")
    p.set_defaults(run=run_list)

    p = sub.add_parser("key", help="issue another API key for a user (shown once)")
    p.add_argument("name")
    p.add_argument("--label", help="what the key is for (e.g. the laptop it lives on)")
    p.set_defaults(run=run_key)

    p = sub.add_parser("revoke", help="revoke an API key by its prefix (8 hex characters after ftq_) or id")
    p.add_argument("prefix")
    p.set_defaults(run=run_revoke)

    p = sub.add_parser("set", help="change a user's cap, admin flag or disabled state")
    p.add_argument("name")
    p.add_argument("--max-running", help="a number, or 'default' for FTQ_MAX_RUNNING_JOBS_PER_USER")
    p.add_argument("--admin", dest="admin", action="store_true", default=None)
    p.add_argument("--no-admin", dest="admin", action="store_false")
    p.add_argument("--disable", dest="disabled", action="store_true", default=None)
    p.add_argument("--enable", dest="disabled", action="store_false")
    p.set_defaults(run=run_set)

    p = commands.add_parser("login", help="save an API key (and API URL) to the client config file")
    p.add_argument("--key", required=True, help="the API key (ftq_<prefix>_<secret>)")
    p.add_argument("--url", help="the API's URL (default FTQ_API_URL or the local API)")
    p.set_defaults(run=run_login)


@contextmanager
def store_session() -> Iterator[Session]:
    """A session on the configured store, refused with the fix when it has no schema."""
    from cli.serve import require_migrated_store
    from core.db import make_engine, make_sessionmaker

    settings = Settings().resolved()
    require_migrated_store(settings)
    engine = make_engine(settings.database_url or "")
    try:
        with make_sessionmaker(engine)() as session:
            yield session
    finally:
        engine.dispose()


def _domain(call: Any) -> Any:
    """Run a ``core.users.service`` call; its errors become CLI errors (same messages)."""
    from core.errors import FtqError

    try:
        return call()
    except FtqError as exc:
        raise CliError(exc.message) from exc


def print_new_key(name: str, key: str, out: Any = None) -> None:
    out = out or sys.stdout
    print(f"API key for {name} (shown once; the store keeps only its hash):\n\n    {key}\n", file=out)
    print("Use it with:  export FTQ_API_KEY=<key>   or   ftq login --key <key>", file=out, flush=True)


def run_create(args: argparse.Namespace) -> int:
    from core.users import service

    with store_session() as session:
        user, issued = _domain(lambda: service.create_user_with_key(
            session, args.name, is_admin=args.admin, max_running_jobs=args.max_running,
            project_names=getattr(args, "projects", None),
        ))
        session.commit()
        role = "admin" if user.is_admin else "user"
        print(f"created {role} {user.name}" + (f" (max {args.max_running} running jobs)" if args.max_running is not None else ""))
        print_new_key(user.name, issued.secret)
    return 0


def run_list(args: argparse.Namespace) -> int:
    from core.users import service

    with store_session() as session:
        rows = []
        for user in service.list_users(session):
            keys = service.list_keys(session, user)
            active = [k.prefix for k in keys if k.revoked_at is None]
            rows.append((
                user.name,
                "admin" if user.is_admin else "",
                "default" if user.max_running_jobs is None else str(user.max_running_jobs),
                "disabled" if user.disabled_at else "",
                ", ".join(active) or "-",
            ))
    if not rows:
        print("no users; create one with `ftq users create NAME --admin`")
        return 0
    header = ("NAME", "ROLE", "MAX RUNNING", "STATE", "ACTIVE KEYS (prefix)")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def run_key(args: argparse.Namespace) -> int:
    from core.users import service

    with store_session() as session:
        user = _domain(lambda: service.get_user(session, args.name))
        issued = service.issue_key(session, user, name=args.label)
        session.commit()
        print_new_key(user.name, issued.secret)
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    from core.users import service
    from core.users.models import User

    with store_session() as session:
        key = _domain(lambda: service.find_key(session, args.prefix))
        service.revoke_key(session, key)
        session.commit()
        owner = session.get(User, key.user_id)
        print(f"revoked key {key.prefix} of {owner.name if owner else '?'}")
    return 0


def run_set(args: argparse.Namespace) -> int:
    from core.users import service

    cap, clear = None, False
    if args.max_running is not None:
        if args.max_running == "default":
            clear = True
        elif args.max_running.isdigit():
            cap = int(args.max_running)
        else:
            raise CliError(f"--max-running {args.max_running!r}: give a number (0 or more) or 'default'")
    with store_session() as session:
        user = _domain(lambda: service.update_user(
            session, args.name, max_running_jobs=cap, clear_max_running=clear, is_admin=args.admin,
            disabled=args.disabled,
        ))
        session.commit()
        cap_text = "default" if user.max_running_jobs is None else str(user.max_running_jobs)
        print(f"{user.name}: {'admin' if user.is_admin else 'user'}, max running {cap_text}"
              + (", disabled" if user.disabled_at else ""))
    return 0


def run_login(args: argparse.Namespace) -> int:
    from cli import client, config

    key = args.key.strip()
    with client.connect(args.url.rstrip("/") if args.url else None, api_key=key) as http:
        me = client.call(http, "GET", "/v1/users/me").json()
        url = str(http.base_url).rstrip("/")
    values = {"api_key": key}
    if args.url:
        values["api_url"] = url
    path = config.save_config(values)
    print(f"logged in to {url} as {me['name']}{' (admin)' if me.get('is_admin') else ''}; key saved to {path}")
    return 0


def bootstrap_admin(settings: Settings, out: Any = None, *, show_key: bool = True) -> str | None:
    """The embedded default's first start: with no users in the store, create ``admin``.

    Saves its key to the client config file, so ``ftq submit`` works at once, and prints it once
    (``show_key=False``: the caller shows it; ``ftq up`` does in its box, once the service answers).
    Returns the key, or None when the store already has users (then nothing is printed). The
    production path (``ftq api``) never does this: there ``ftq users create`` makes the first admin.
    """
    from cli import config
    from core.db import make_engine, make_sessionmaker
    from core.users import service

    out = out or sys.stdout
    engine = make_engine(settings.database_url or "")
    try:
        with make_sessionmaker(engine)() as session:
            if service.count_users(session) > 0:
                return None
            _user, issued = service.create_user_with_key(session, "admin", is_admin=True)
            session.commit()
    finally:
        engine.dispose()
    if not show_key:
        print("ftq: first start, no users yet: created the admin user 'admin'; its key is shown once the "
              "service is up.", file=out)
    else:
        print("ftq: first start, no users yet: created the admin user 'admin'.", file=out)
        print_new_key("admin", issued.secret, out)
    try:
        path = config.save_config({"api_key": issued.secret})
        if show_key:
            print(f"ftq: saved it to {path} (mode 0600), so `ftq submit`, `ftq jobs`, ... work from this "
                  "account at once; paste it into the dashboard's login. Add teammates with "
                  "`ftq users create NAME`.", file=out, flush=True)
    except (OSError, CliError) as exc:
        print(f"ftq: warning: could not save the key to the client config ({exc}); "
              "run `ftq login --key <key>`", file=out, flush=True)
    return issued.secret
