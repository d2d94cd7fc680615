"""The trajectory viewer: read-only web pages over the ledger, served by the scheduler under ``/viewer``.

``tokens`` turns a stored trajectory into per-token rows (text, origin, mask, logprob, version), ``queries`` holds
its SQL, ``routes`` its JSON API under ``/v1/viewer`` (read scope), ``pages`` the static page and its headers.
"""
