"""What this machine is to the store: its worker key's id, the address other machines reach it
at, and the shared checkpoint directory it mounts.

The worker row carries them (``Runtime.ensure_registered``, ``presence.register``): the key id
ties a remote worker to the key an admin can revoke (worker/remote.py ``may_claim``), the
address is where a multi-machine job's ranks meet (worker/nodes.py), the shared directory and
its id say which machines may run a sharded job together (worker/shared_storage.py).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from core.settings import Settings


def identity(session: Session, settings: Settings) -> dict[str, Any]:
    """The worker row's ``key_id`` (None: a local worker, or a key the store does not know),
    ``address`` (FTQ_WORKER_ADDRESS, else the local IP of the route to the store's host),
    ``shared_dir`` and ``shared_id`` (FTQ_SHARED_DIR and its marker's id; None without one,
    or while it cannot be used: ``cli serve`` refused that at the worker's start)."""
    from worker.shared_storage import published

    key_id = None
    if settings.remote_worker:
        from core.workers.keys import worker_key_active

        assert settings.worker_key is not None
        row = worker_key_active(session, settings.worker_key.get_secret_value())
        key_id = row.worker_key_id if row is not None else None
    address = settings.worker_address or default_address(settings)
    return {"key_id": key_id, "address": address, **published(settings, strict=False)}


def default_address(settings: Settings) -> str | None:
    """This machine's IP on the route to the store's host (else the broker's, else the API's):
    the interface the other machines of the cluster reach it on. No packet is sent.

    None when that route is the loopback (the store on this very machine: no other machine could
    reach this one there) or unknown: such a worker takes no part in multi-machine jobs unless
    ``FTQ_WORKER_ADDRESS`` names its address. (A worker in a container on a bridge network finds
    the container's address: give it ``FTQ_WORKER_ADDRESS`` or host networking.)"""
    for url in (settings.database_url, settings.broker_url, settings.api_url):
        host = _host_of(url)
        if not host:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))
                address = str(probe.getsockname()[0])
        except OSError:
            continue
        return None if ipaddress.ip_address(address).is_loopback else address
    return None


def _host_of(url: str | None) -> str | None:
    if not url or "://" not in url:
        return None
    try:
        return urlsplit(url).hostname
    except ValueError:
        return None
