"""Reasoning that survives a stateless round trip: sealed by the cluster, read back by it.

Agents keep their conversation themselves and send it back whole on every turn. A
model's reasoning is part of that conversation, so ringlet hands it out sealed: the
Responses API's ``reasoning.encrypted_content`` (with ``include:
["reasoning.encrypted_content"]``) and the Anthropic ``thinking`` block's ``signature``
carry the reasoning text encrypted and authenticated with a key of the cluster. On the
next turn ringlet opens them and renders the reasoning back exactly as generated, so
the prompt matches what the prefix cache holds; a client cannot forge or edit them.

The key: HKDF-SHA256 (RFC 5869) of the cluster secret (``--secret-file``); a cluster
without a secret derives it from its cluster id, which every member knows — enough to
catch edited or foreign reasoning, not a determined forger who knows the cluster's
name (use a secret for that). Every node of a cluster derives the same key, so any
node reads what another sealed. The cipher is AES-256-GCM (NIST SP 800-38D) with a
random 96-bit nonce; the associated data binds a sealed text to its kind and model.
"""

from __future__ import annotations

import base64
import json
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

#: HKDF's ``info``: a key for this use only (the secret also derives TLS and auth keys)
INFO = b"ringlet reasoning seal v1"
NONCE_BYTES = 12


class SealError(ValueError):
    """A sealed text that does not open: not sealed by this cluster, for another kind
    or model, or altered."""


class Sealer:
    """Seals and opens reasoning texts with the cluster's key.

    Args:
        material: the cluster secret (bytes), or, without one, the cluster id's bytes.
        model: the served model's name, bound into every seal.
    """

    def __init__(self, material: bytes, model: str):
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=INFO).derive(material)
        self._aead = AESGCM(key)
        self.model = model

    def _aad(self, kind: str) -> bytes:
        return f"{kind}\0{self.model}".encode()

    def seal(self, kind: str, text: str) -> str:
        """``text`` sealed for ``kind`` (``"thinking"``, ``"reasoning"``): URL-safe
        base64 of nonce + ciphertext + 16-byte tag."""
        nonce = os.urandom(NONCE_BYTES)
        body = self._aead.encrypt(nonce, json.dumps({"text": text}).encode(), self._aad(kind))
        return base64.urlsafe_b64encode(nonce + body).decode()

    def open(self, kind: str, sealed: str) -> str:
        """The text a :meth:`seal` of ``kind`` holds.

        Raises:
            SealError: ``sealed`` was not made by this cluster for ``kind`` and this
                model, or was altered.
        """
        try:
            raw = base64.urlsafe_b64decode(sealed.encode("ascii"))
            if len(raw) <= NONCE_BYTES:
                raise ValueError("too short")
            plain = self._aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], self._aad(kind))
            text = json.loads(plain)["text"]
        except (InvalidTag, ValueError, KeyError, TypeError, UnicodeEncodeError):
            raise SealError("it was not sealed by this cluster for this model, or it was altered") from None
        if not isinstance(text, str):
            raise SealError("it holds no text")
        return text
