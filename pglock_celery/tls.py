"""TLS for the Patroni REST API: the fence's own context, from three settings.

``pglock_patroni_cafile``, ``pglock_patroni_certfile`` and ``pglock_patroni_keyfile``
(per shard too) name PEM files: the CA that signs the members' REST API certificates,
and a client certificate and its key for Patroni's ``restapi.verify_client``. The fence
and the doctor use a context made from them (patroni.MemberClient); nothing
process-wide (SSL_CERT_FILE, the default context) is read or changed. Apart from
patroni.py so that reading the settings does not load the fence.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from typing import Any

__all__ = ["TLS_SETTINGS", "readable_file", "tls_context", "tls_reason"]

#: The PglockConfig fields (and shard keys) of the REST API's TLS, in tls_context's order.
TLS_SETTINGS = ("patroni_cafile", "patroni_certfile", "patroni_keyfile")


def readable_file(raw: Any) -> str | None:
    """A TLS setting's value: the path of a file that exists and can be read (None when
    unset). ValueError saying why not (the path is no secret; the file is not quoted)."""
    if raw in (None, ""):
        return None
    if not isinstance(raw, (str, os.PathLike)):
        raise ValueError("must be the path of a PEM file (a str)")
    path = os.fspath(raw)
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError as exc:
        raise ValueError(f"cannot be read: {exc.strerror or type(exc).__name__}") from None
    return str(path)


def tls_context(
    cafile: str | None,
    certfile: str | None,
    keyfile: str | None,
    *,
    named: Callable[[str], str] = "pglock_{}".format,
) -> ssl.SSLContext | None:
    """The fence's own TLS context for ``https://`` members: certificates verified against
    ``cafile`` (only it; the system's CAs without it), the host name checked, and the
    client certificate ``certfile`` (with ``keyfile``, unless the key is in it) shown
    to a REST API that asks for one. None when nothing is set (the default context).
    Nothing process-wide is read or changed (SSL_CERT_FILE is for the system's CAs).
    ValueError naming the setting whose file is not what it should be, as ``named`` gives
    a setting's name (``patroni_cafile`` -> ``pglock_patroni_cafile``).
    """
    if cafile is None and certfile is None and keyfile is None:
        return None
    if keyfile is not None and certfile is None:
        raise ValueError(f"{named('patroni_keyfile')} is set without {named('patroni_certfile')}")
    try:
        context = ssl.create_default_context(cafile=cafile)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"{named('patroni_cafile')}: not a PEM file of CA certificates ({tls_reason(exc)})"
        ) from None
    if certfile is not None:
        try:
            context.load_cert_chain(certfile, keyfile)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"{named('patroni_certfile')}, {named('patroni_keyfile')}: not a PEM "
                f"certificate and its private key ({tls_reason(exc)}; a key protected by a "
                "passphrase is not supported)"
            ) from None
    return context


def tls_reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None)
    return str(reason) if reason else type(exc).__name__
