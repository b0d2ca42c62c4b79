"""API keys: generation, hashing, and constant-time comparison.

Keys are ``lsk-`` followed by 32 random bytes (``secrets.token_urlsafe``), so each has 256 bits of entropy. The store
keeps only ``sha256:<hex digest>`` of a key. A slow, salted KDF (scrypt, PBKDF2) is there to stop dictionary and
brute-force attacks on low-entropy human passwords; against a uniformly random 256-bit key such attacks are already
hopeless, so the KDF would add nothing but its cost, which every authenticated request would pay. The digest is
tagged with its algorithm so that a later scheme can sit beside it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

API_KEY_PREFIX = "lsk-"
API_KEY_BYTES = 32
_HASH_SCHEME = "sha256:"


def generate_api_key() -> str:
    """A new random API key; shown to its owner once, stored only as ``hash_api_key(key)``."""
    return API_KEY_PREFIX + secrets.token_urlsafe(API_KEY_BYTES)


def hash_api_key(api_key: str) -> str:
    """The stored form of a key: ``"sha256:" + hex(SHA-256(utf-8 key))``."""
    return _HASH_SCHEME + hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def constant_time_equals(a: str, b: str) -> bool:
    """``a == b`` in time that does not depend on where they differ (for keys and digests from clients).

    Works on any str, not only ASCII, because client input is compared as UTF-8 bytes.
    """
    return hmac.compare_digest(a.encode("utf-8"), b.encode("utf-8"))


def verify_api_key(api_key: str, key_hash: str) -> bool:
    """Whether ``api_key`` is the key whose stored form is ``key_hash``, compared in constant time."""
    return constant_time_equals(hash_api_key(api_key), key_hash)
