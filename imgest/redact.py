"""Secrets never leave in a message: credentials in URLs, presigned signatures, credential variables."""

from __future__ import annotations

import configparser
import logging
import os
import re
import threading
from urllib.parse import quote, quote_plus, unquote

# A URL's scheme wherever one starts in a text (also inside fsspec chains: simplecache::s3://...).
_SCHEME = re.compile(r"(?<![A-Za-z0-9+.-])(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)")
# Where a URL ends in a message: at whitespace only, since a password may hold quotes, brackets or backticks
# (a quote closing the URL is masked with it only when an `@` follows before the next space: too much, never less).
_RUN = re.compile(r"\S*")
# Kept for callers that import it (imgest.storage): a URL starting with a user name and an `@`.
USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@")

# Query parameters that are secrets themselves or sign a request (AWS SigV4 and V2, GCS V4 and V2, Azure SAS,
# bearer tokens): a URL carrying one is refused as a parameter, and their values are masked in any text.
SECRET_PARAMETERS = (
    "X-Amz-Signature", "X-Amz-Credential", "X-Amz-Security-Token", "AWSAccessKeyId", "Signature",
    "X-Goog-Signature", "X-Goog-Credential", "GoogleAccessId", "sig", "skoid", "sktid", "skt", "ske", "sks", "skv",
    "token", "access_token", "id_token", "refresh_token", "security_token", "sessiontoken", "api_key", "apikey",
    "password", "passwd", "secret", "client_secret",
)
# The other parameters of a SAS token (version, expiry, permissions, ...): not secret alone, masked with it.
_SAS_PARAMETERS = ("sv", "se", "st", "sp", "spr", "sr", "srt", "ss", "si", "sdd", "ses")
_SECRET_NAMES = {name.lower() for name in SECRET_PARAMETERS}
# A parameter starts a word, or follows an encoded `?` or `&` (a URL inside another URL's query string).
_SIGNING = re.compile(
    r"(?:(?<![\w.-])|(?<=%3F)|(?<=%26))(?P<name>" + "|".join(map(re.escape, SECRET_PARAMETERS + _SAS_PARAMETERS))
    + r")(?P<eq>=|%3D)(?:(?!%26)[^&\s'\"`<>])*", re.IGNORECASE)
# The query string of an http(s) URL: presigned S3 signatures, Azure SAS tokens, GCS signed URLs, whatever else.
_HTTP_QUERY = re.compile(r"(?P<url>https?://[^\s?#'\"]*)\?[^\s#'\"]*", re.IGNORECASE)

# Environment variables whose values are secrets (or name where one is), masked wherever they appear.
CREDENTIAL_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_CONNECTION_STRING", "AZURE_CLIENT_SECRET", "GOOGLE_APPLICATION_CREDENTIALS", "PREFECT_API_KEY",
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MILVUS_TOKEN", "QDRANT_API_KEY", "IMGEST_API_TOKEN",
)
# Keys of an AWS shared credentials or config file whose values are secrets.
_PROFILE_KEYS = ("aws_secret_access_key", "aws_session_token", "aws_security_token", "aws_access_key_id")
_MIN_SECRET = 4  # shorter values would mask ordinary words

_registered: set[str] = set()
_profiles: dict[str, tuple[tuple[int, int], frozenset[str]]] = {}
_lock = threading.Lock()


# -- finding what is secret in a URL ---------------------------------------------------------------------------
def _userinfo_end(run: str) -> int:
    """Where the credentials of a URL end in ``run`` (the text after ``scheme://``): the index of their closing
    ``@``, or -1 when the URL names no user.

    urllib is no help here: AWS secret keys hold ``/`` and ``+``, so ``s3://KEY:ab/cd@bucket/x`` parses as host
    ``KEY:ab``. The rules: ``user:`` before the first ``/?#`` opens a password that runs to the LAST ``@`` of the
    URL, whatever it holds; ``user@`` with no ``:`` before it is a user name (a token) alone. Erring on the safe
    side, ``host:port/...`` followed by an ``@`` anywhere is read as ``user:password@`` too (``http://h:9000/a@b``
    is refused; ``%40`` spells an ``@`` in a path)."""
    authority = re.split(r"[/?#]", run, maxsplit=1)[0]
    colon, at = authority.find(":"), authority.find("@")
    if colon != -1 and (at == -1 or colon < at):
        return run.rfind("@")
    return at


def _credential_spans(text: str, whole: bool = False) -> list[tuple[int, int]]:
    """(start, end) of each URL's credentials in ``text``, the ``@`` excluded; ``whole``: text is one URL, whose
    password may even hold whitespace."""
    spans, pos = [], 0
    while (match := _SCHEME.search(text, pos)) is not None:
        start = match.end()
        run = text[start:] if whole else _RUN.match(text, start).group()
        end = _userinfo_end(run)
        if end > 0:
            spans.append((start, start + end))
            pos = start + end + 1
        else:
            pos = start
    return spans


def url_secrets(url: str, *, query: bool = True) -> list[str]:
    """What in ``url`` is secret, in words (empty: nothing): credentials before the host and, unless ``query``
    is False, presigned or SAS signatures and tokens in the query string, whatever the secret's characters
    (``/ + = @ :``)."""
    url = str(url).strip()
    found = []
    if _credential_spans(url, whole=True):
        found.append("credentials in the URL")
    string = url.split("?", 1)[1].split("#", 1)[0] if query and "?" in url else ""
    for pair in re.split(r"[&;]", string):
        name = unquote(pair.split("=", 1)[0]).strip()
        if name.lower() in _SECRET_NAMES:
            found.append(f"the secret query parameter {name}")
    return list(dict.fromkeys(found))


# -- secrets known by value --------------------------------------------------------------------------------------
def register_secret(value: str | None) -> None:
    """Mask ``value`` in every message from now on (credentials loaded at run time, e.g. from a Prefect block)."""
    if value and len(value) >= _MIN_SECRET:
        with _lock:
            _registered.add(value)


def _profile_secrets() -> set[str]:
    """The credentials of every profile in the AWS shared credentials and config files botocore reads,
    re-read when a file changes."""
    found: set[str] = set()
    for path in (os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials",
                 os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config"):
        path = os.path.expanduser(path)
        try:
            stat = os.stat(path)
        except OSError:
            continue
        stamp = (stat.st_mtime_ns, stat.st_size)
        cached = _profiles.get(path)
        if cached is None or cached[0] != stamp:
            parser = configparser.RawConfigParser(strict=False)
            try:
                parser.read(path, encoding="utf-8")
                values = frozenset(parser.get(s, k).strip() for s in parser.sections() for k in _PROFILE_KEYS
                                   if parser.has_option(s, k))
            except (configparser.Error, UnicodeDecodeError, OSError):
                values = frozenset()
            cached = _profiles[path] = (stamp, values)
        found |= cached[1]
    return found


def _known_secrets() -> list[str]:
    values = {os.environ.get(var, "").strip() for var in CREDENTIAL_VARIABLES} | _profile_secrets() | _registered
    forms = set()
    for value in values:
        if len(value) >= _MIN_SECRET:
            forms |= {value, quote(value, safe=""), quote_plus(value, safe="")}
    return sorted(forms, key=len, reverse=True)  # a longer form first: its masking cannot leave a shorter one


# -- masking ---------------------------------------------------------------------------------------------------------
def redact(text: str) -> str:
    """Remove what could be a secret from a message: credentials embedded in URLs (``s3://KEY:SECRET@b``, the
    secret holding any of ``/ + = @ :``), the query strings of http(s) URLs (presigned signatures, SAS tokens),
    signing and token parameters anywhere, and the values of credential variables and AWS profiles (also
    percent-encoded)."""
    text = str(text)
    for start, end in reversed(_credential_spans(text)):
        text = f"{text[:start]}***{text[end:]}"
    text = _HTTP_QUERY.sub(r"\g<url>?***", text)
    text = _SIGNING.sub(r"\g<name>\g<eq>***", text)
    for secret in _known_secrets():
        text = text.replace(secret, "***")
    return text


def redact_url(url: str) -> str:
    """One URL given alone (a parameter) with what could be secret masked, a password holding whitespace too."""
    url = str(url)
    for start, end in reversed(_credential_spans(url, whole=True)):
        url = f"{url[:start]}***{url[end:]}"
    return redact(url)


def one_line(exc: BaseException, limit: int | None = None) -> str:
    """An exception as one redacted line: its type and message, whitespace collapsed; past `limit` characters
    cut (masked first, so a cut never leaves part of a secret unrecognised)."""
    line = redact(" ".join(f"{type(exc).__name__}: {exc}".split()))
    return line if limit is None or len(line) <= limit else line[:limit].rstrip() + " ..."


class RedactingFilter(logging.Filter):
    """Masks a log record before any handler formats it: its message, and its traceback with the text of every
    chained exception (a library's error may quote a URL raw; Prefect sends tracebacks to its API)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.msg, record.args = redact(record.getMessage()), None
        except Exception:  # a malformed record (arguments that do not fit): logging reports it, unmasked text never
            record.msg, record.args = redact(str(record.msg)), None
        if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


# Where Prefect's engine logs runs (their records go to the API): a logger's filters see the records made on it.
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs", "prefect")


def redact_logging(names: tuple[str, ...] = RUN_LOGGERS) -> None:
    """Mask every record made on these loggers (idempotent)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactingFilter) for f in logger.filters):
            logger.addFilter(RedactingFilter())
