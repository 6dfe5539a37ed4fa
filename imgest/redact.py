"""Secrets never leave in a message: credentials in URLs, presigned signatures, credential variables."""

from __future__ import annotations

import os
import re

USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@")
# The query string of an http(s) URL: presigned S3 signatures, Azure SAS tokens, GCS signed URLs.
_HTTP_QUERY = re.compile(r"(?P<url>https?://[^\s?#'\"]*)\?[^\s#'\"]*", re.IGNORECASE)
# Signing parameters wherever they appear (another scheme, a bare query string in a message).
_SIGNING = re.compile(r"(?P<name>X-Amz-(?:Signature|Credential|Security-Token)|X-Goog-(?:Signature|Credential)|"
                      r"sig|signature|se|st|sv|skoid|sktid|token|access_token)=[^&\s'\"]*", re.IGNORECASE)
_CREDENTIAL_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AZURE_STORAGE_KEY",
                    "AZURE_STORAGE_SAS_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS")


def redact(text: str) -> str:
    """Remove what could be a secret from a message: credentials embedded in URLs (``s3://KEY:SECRET@b``),
    the query strings of http(s) URLs (presigned signatures, SAS tokens), signing parameters anywhere, and
    the values of the usual credential variables."""
    text = USERINFO.sub(r"\g<scheme>***@", str(text))
    text = _HTTP_QUERY.sub(r"\g<url>?***", text)
    text = _SIGNING.sub(r"\g<name>=***", text)
    for var in _CREDENTIAL_VARS:
        secret = os.environ.get(var)
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def one_line(exc: BaseException) -> str:
    """An exception as one redacted line: its type and message, whitespace collapsed."""
    return redact(" ".join(f"{type(exc).__name__}: {exc}".split()))
