"""The bearer header every client of a replica or the proxy sends: one spelling for the seven of them."""

from __future__ import annotations


def bearer_headers(token: str | None) -> dict[str, str]:
    """`Authorization: Bearer <token>`, or no header where there is no token (a loopback-only setup).

    >>> bearer_headers("k"), bearer_headers(None)
    ({'Authorization': 'Bearer k'}, {})
    """
    return {"Authorization": f"Bearer {token}"} if token else {}
