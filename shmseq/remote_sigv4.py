"""S3 requests signed in this process (AWS Signature Version 4), without botocore, where the
``storage_options`` and the environment leave botocore nothing to decide: credentials given
(``key`` and ``secret``, or ``anon``) or in ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``,
no profile, no AWS config or credentials file, no other ``AWS_*`` setting, and either an
``endpoint_url`` or a region of AWS's main partition. Importing botocore and making its first
client takes about 0.16 s of CPU in every process that signs: the trainer as it loads the index
(before its workers start), each rank's fetch process, each worker started by spawn. Anything
else is botocore's (``remote_sources``), and for the cases taken here the requests are the ones
botocore makes, byte for byte in every signed header (``tests/test_remote_sigv4.py`` signs both
ways)."""
from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import re
import threading
from typing import Literal, NamedTuple
from urllib.parse import quote, urlsplit

from .remote_stream import Transport

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
# the environment botocore reads that this module reads the same way (the CA bundle is the
# transport's, not the signature's)
ENVIRONMENT = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                         "AWS_DEFAULT_REGION", "AWS_CA_BUNDLE"})
OPTIONS = frozenset({"key", "username", "secret", "password", "token", "anon", "endpoint_url",
                     "use_ssl", "requester_pays", "version_aware", "client_kwargs"})
CLIENT_OPTIONS = frozenset({"region_name", "endpoint_url", "verify"})
AWS_REGION = re.compile(r"(us|eu|ap|sa|ca|me|af|il|mx)-[a-z]+-\d+")  # the main partition's
VIRTUAL_HOSTABLE = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")  # a bucket in the host name
DEFAULT_REGION = "us-east-1"  # botocore's for S3 where none is given (its global endpoint)
SERVICE = "s3"


class Credentials(NamedTuple):
    key: str
    secret: str
    token: str | None = None


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class OwnSigner:
    """Signs GetObject and HeadObject requests for one ``storage_options`` (``credentials``
    None: unsigned, as ``anon``), for each bucket in the region it is known to be in."""

    def __init__(self, transport: Transport, credentials: Credentials | None,
                 region: str | None, endpoint: str | None, use_ssl: bool, requester_pays: bool,
                 version_aware: bool) -> None:
        self.transport, self.credentials = transport, credentials
        self.region = region or DEFAULT_REGION
        self.endpoint, self.use_ssl = endpoint, use_ssl
        self.requester_pays, self.version_aware = requester_pays, version_aware
        self._regions: dict[str, str] = {}
        self._keys: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def moved(self, bucket: str, region: str) -> bool:
        """Whether ``bucket`` was signed for another region than ``region`` (then learnt)."""
        if self._regions.get(bucket, self.region) == region:
            return False
        self._regions[bucket] = region
        return True

    def signed(self, bucket: str, key: str, version: str | None,
               byte_range: str | None) -> tuple[str, dict[str, str]]:
        """The URL and headers of a GetObject of ``byte_range`` (a Range header's value), or of
        a HeadObject (None)."""
        region = self._regions.get(bucket, self.region)
        url = self._url(bucket, key, region) + ("" if version is None else
                                                 "?versionId=" + quote(version, safe=""))
        headers: dict[str, str] = {}
        if self.requester_pays:
            headers["x-amz-request-payer"] = "requester"
        if byte_range is not None:
            headers["Range"] = byte_range
            headers["x-amz-checksum-mode"] = "ENABLED"  # botocore's default for a GetObject
        if self.credentials is not None:
            self._sign("GET" if byte_range is not None else "HEAD", url, headers, region)
        return url, headers

    def _url(self, bucket: str, key: str, region: str) -> str:
        """Path style on a given endpoint; on AWS's, the bucket in the host name where it can
        be, as botocore addresses it."""
        path = quote(key, safe="/")
        if self.endpoint is not None:
            return f"{self.endpoint.rstrip('/')}/{bucket}/{path}"
        scheme = "https" if self.use_ssl else "http"
        host = "s3.amazonaws.com" if region == DEFAULT_REGION else f"s3.{region}.amazonaws.com"
        if VIRTUAL_HOSTABLE.fullmatch(bucket):
            return f"{scheme}://{bucket}.{host}/{path}"
        return f"{scheme}://{host}/{bucket}/{path}"

    def _sign(self, method: str, url: str, headers: dict[str, str], region: str) -> None:
        """SigV4's headers added to ``headers``: every header signed, the payload's hash the
        empty body's, the path as it is (S3 does not normalize it)."""
        assert self.credentials is not None
        now = _now()
        stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        headers["X-Amz-Date"] = stamp
        if self.credentials.token:
            headers["X-Amz-Security-Token"] = self.credentials.token
        headers["X-Amz-Content-SHA256"] = EMPTY_SHA256
        parts = urlsplit(url)
        signed = {"host": _host(parts.scheme, parts.netloc),
                  **{name.lower(): " ".join(value.split()) for name, value in headers.items()}}
        names = ";".join(sorted(signed))
        request = "\n".join([method, parts.path or "/", _canonical_query(parts.query),
                             *(f"{name}:{signed[name]}" for name in sorted(signed)), "", names,
                             EMPTY_SHA256])
        scope = f"{day}/{region}/{SERVICE}/aws4_request"
        text = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                          hashlib.sha256(request.encode()).hexdigest()])
        signature = hmac.new(self._key(day, region), text.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.credentials.key}/{scope}, "
                                    f"SignedHeaders={names}, Signature={signature}")

    def _key(self, day: str, region: str) -> bytes:
        """The day's signing key for ``region`` (four HMACs), made once a day."""
        with self._lock:
            if (day, region) not in self._keys:
                assert self.credentials is not None
                key = f"AWS4{self.credentials.secret}".encode()
                for part in (day, region, SERVICE, "aws4_request"):
                    key = hmac.new(key, part.encode(), hashlib.sha256).digest()
                self._keys[(day, region)] = key
            return self._keys[(day, region)]


def _host(scheme: str, netloc: str) -> str:
    """The Host header http.client sends: the port left out where it is the scheme's own."""
    default = {"http": ":80", "https": ":443"}.get(scheme)
    return netloc[:-len(default)] if default and netloc.endswith(default) else netloc


def _canonical_query(query: str) -> str:
    pairs = sorted(tuple(pair.split("=", 1)) if "=" in pair else (pair, "")
                   for pair in query.split("&") if pair)
    return "&".join(f"{name}={value}" for name, value in pairs)


def own_signer(options: dict, transport: Transport) -> OwnSigner | None:
    """A signer for ``storage_options`` (s3fs's names), its requests sent through
    ``transport``, where this module signs as botocore would; None where botocore has something
    to decide (see the module's text)."""
    client = options.get("client_kwargs") or {}
    if (set(options) - OPTIONS or set(client) - CLIENT_OPTIONS or _botocore_configured()
            or options.get("s3_additional_kwargs")):
        return None
    credentials = _credentials(options)
    if credentials is False:
        return None
    endpoint = client.get("endpoint_url") or options.get("endpoint_url")
    region = client.get("region_name") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint is None and region is not None and not AWS_REGION.fullmatch(region):
        return None  # another partition's endpoints (China, GovCloud): botocore knows them
    return OwnSigner(transport, credentials, region, endpoint, bool(options.get("use_ssl", True)),
                     bool(options.get("requester_pays", False)),
                     bool(options.get("version_aware", False)))


def _credentials(options: dict) -> Credentials | None | Literal[False]:
    """The options' credentials, else the environment's; None where unsigned (``anon``);
    False where botocore would look further (a profile, a file, instance metadata) or
    refuse them (a key without its secret)."""
    if options.get("anon"):
        return None
    key = options.get("key") or options.get("username")
    secret = options.get("secret") or options.get("password")
    if key or secret:
        return Credentials(key, secret, options.get("token")) if key and secret else False
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        return Credentials(key, secret, os.environ.get("AWS_SESSION_TOKEN") or None)
    return False


def _botocore_configured() -> bool:
    """Whether botocore reads settings this module does not: an ``AWS_*`` variable other than
    ``ENVIRONMENT``'s, or a config or credentials file (a region, an endpoint, an addressing
    style, a profile's credentials)."""
    if any(name.startswith("AWS_") and name not in ENVIRONMENT for name in os.environ):
        return True
    home = os.path.expanduser("~")
    return any(os.path.exists(os.path.join(home, ".aws", name)) for name in ("config",
                                                                              "credentials"))
