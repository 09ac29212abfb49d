"""Where a whole-object fetch (and an object's HEAD) sends its requests, from its URL and
``storage_options``: for ``http(s)://`` the URL itself with the options aiohttp took through
fsspec, for ``s3://`` a request signed as s3fs's client would send it: by ``remote_sigv4``
where botocore would have nothing more to decide, else by botocore itself
(``shmseq.remote_stream`` makes the requests). An option that a fetch cannot honour is
refused, naming it, rather than left out of the requests."""
from __future__ import annotations

import os
import re
import ssl
import threading
from typing import Any, Protocol

from .remote_answers import StatusAnswer, _BadAnswer
from .remote_sigv4 import own_signer
from .remote_stream import MAX_REDIRECTS, Transport

STREAMED = ("http", "https", "s3", "s3a")
# options of fsspec's file systems that no GET depends on (listings, file objects, its loop)
_FILE_SYSTEM_ONLY = frozenset({
    "asynchronous", "loop", "use_listings_cache", "listings_expiry_time", "max_paths",
    "skip_instance_cache", "block_size", "simple_links", "same_scheme", "size_policy",
    "cache_type", "cache_options", "default_block_size", "default_fill_cache",
    "default_cache_type", "cache_regions", "max_concurrency", "fixed_upload_size",
    "local_expiry_check"})


class Source:
    """An object's requests: ``url`` and ``headers`` for a GET of its bytes ``start`` to
    ``end`` (``request``) and for a HEAD of it (``head``), sent through ``transport``;
    ``refusal`` makes the error of a failed answer."""

    def __init__(self, transport: Transport, url: str) -> None:
        self.transport, self.url = transport, url

    def request(self, start: int, end: int) -> tuple[str, dict[str, str]]:
        return self.url, {"Range": f"bytes={start}-{end - 1}"}

    def head(self) -> tuple[str, dict[str, str]]:
        """A HEAD of the object: its size and version without its bytes."""
        return self.url, {}

    def refusal(self, status: int, reason: str, head: Any, body: bytes) -> Exception:
        return StatusAnswer(status, reason)


def source(url: str, storage_options: dict | None) -> Source:
    """The requests of ``url`` (a protocol in ``STREAMED``) with ``storage_options``."""
    options = dict(storage_options or {})
    if url.split("://", 1)[0] in ("s3", "s3a"):
        return _S3(_signer(options, url), url)
    return Source(_web_transport(options, url), url)


def _web_transport(options: dict, url: str) -> Transport:
    """What aiohttp did with the options fsspec's HTTP file system passed it: ``headers``,
    ``auth`` (aiohttp's ``BasicAuth``), ``proxy``, ``ssl`` (False, or an ``SSLContext``),
    ``allow_redirects``, ``max_redirects``, ``encoded``, and in ``client_kwargs``
    ``headers``, ``auth`` and ``trust_env`` (the environment's proxies)."""
    client = dict(options.pop("client_kwargs", None) or {})
    headers = {**client.pop("headers", {}), **options.pop("headers", {})}
    auth = options.pop("auth", None) or client.pop("auth", None)
    if auth is not None:
        headers.setdefault("Authorization", auth.encode())
    redirects = options.pop("max_redirects", MAX_REDIRECTS)
    transport = Transport(
        headers=tuple(headers.items()), tls=_context(options.pop("ssl", None)),
        proxies=_proxies(options.pop("proxy", None)), trust_env=bool(client.pop("trust_env", False)),
        redirects=redirects if options.pop("allow_redirects", True) else 0,
        encoded=bool(options.pop("encoded", False)))
    _refuse_others(url, options, {f"client_kwargs[{name!r}]" for name in client})
    return transport


def _proxies(proxy: str | None) -> tuple[tuple[str, str], ...] | None:
    return None if proxy is None else (("http", proxy), ("https", proxy))


def _context(verify: object) -> ssl.SSLContext | None:
    """The TLS context that aiohttp's ``ssl=`` or botocore's ``verify=`` asks for (None: the
    system's certificates)."""
    if verify is None or verify is True:
        return None
    if isinstance(verify, ssl.SSLContext):
        return verify
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        return context
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    raise ValueError(f"storage_options: ssl/verify={verify!r} is not one a fetch takes: True, "
                     "False, an ssl.SSLContext or (verify=) a CA bundle's path")


def _refuse_others(url: str, options: dict, more: set[str]) -> None:
    """Raise naming the options left over that a fetch cannot honour."""
    left = sorted(set(options) - _FILE_SYSTEM_ONLY | more)
    if left:
        raise ValueError(f"{url}: storage_options {', '.join(left)} cannot be honoured by a "
                         "fetch of a whole object (shmseq.remote streams it without fsspec); "
                         "leave them out, or read the shards in place (cache=False)")


class S3Signer(Protocol):
    """What signs an S3 object's requests (``_S3`` calls it for each): botocore's client
    (``_BotocoreSigner``) or ``remote_sigv4.OwnSigner``."""

    transport: Transport
    version_aware: bool

    def signed(self, bucket: str, key: str, version: str | None,
               byte_range: str | None) -> tuple[str, dict[str, str]]:
        """The URL and headers of a GetObject of ``byte_range``, or of a HeadObject (None)."""

    def moved(self, bucket: str, region: str) -> bool:
        """Whether ``bucket`` was signed for another region than ``region`` (then learnt)."""


class _Prepared(Exception):
    """Raised by botocore's before-send event: the request signed, not sent."""

    def __init__(self, request: Any) -> None:
        super().__init__("prepared")
        self.request = request


def _prepared(request: Any, **_: object) -> None:
    raise _Prepared(request)


class _BotocoreSigner:
    """A botocore client made as s3fs makes its own from ``storage_options`` (``key``,
    ``secret``, ``token``, ``username``, ``password``, ``anon``, ``endpoint_url``, ``use_ssl``,
    ``client_kwargs``, ``config_kwargs``, ``requester_pays``, ``s3_additional_kwargs``,
    ``version_aware``, ``profile``), that signs a GetObject or a HeadObject without sending it;
    and a client for each other region a bucket is found in."""

    def __init__(self, options: dict, url: str) -> None:
        from botocore import UNSIGNED
        from botocore.config import Config
        client = dict(options.pop("client_kwargs", None) or {})
        config = dict(options.pop("config_kwargs", None) or {})
        self._session = _session(options.pop("profile", None))
        self.transport = _s3_transport(
            client, config,
            self._session.get_config_variable("ca_bundle") if _over_tls(options, client) else None)
        self.params = {**({"RequestPayer": "requester"} if options.pop("requester_pays", False)
                          else {}), **(options.pop("s3_additional_kwargs", None) or {})}
        self.version_aware = bool(options.pop("version_aware", False))
        anon = options.pop("anon", False)
        credentials = {"aws_access_key_id": options.pop("key", None) or options.pop("username", None),
                       "aws_secret_access_key": (options.pop("secret", None)
                                                 or options.pop("password", None)),
                       "aws_session_token": options.pop("token", None)}
        settings = {"endpoint_url": options.pop("endpoint_url", None),
                    "use_ssl": options.pop("use_ssl", True)}
        _refuse_others(url, options, {f"config_kwargs[{name!r}]" for name in config
                                      if name in ("proxies_config", "client_cert")})
        config["retries"] = {"total_max_attempts": 1}  # it sends nothing
        if anon:
            config["signature_version"] = UNSIGNED
            credentials = {}
        self._made = {**{k: v for k, v in {**credentials, **settings}.items() if v is not None},
                      **client, "config": Config(**config)}
        self._clients: dict[str | None, Any] = {}
        self._regions: dict[str, str] = {}

    def client(self, bucket: str) -> Any:
        """The client for ``bucket``'s region, as far as it is known."""
        region = self._regions.get(bucket)
        if region in self._clients:
            return self._clients[region]
        with _sessions_lock:
            if region not in self._clients:
                made = self._made if region is None else {**self._made, "region_name": region}
                client = self._session.create_client("s3", **made)
                client.meta.events.register("before-send.s3", _prepared)  # sends nothing
                self._clients[region] = client
            return self._clients[region]

    def moved(self, bucket: str, region: str) -> bool:
        if self.client(bucket).meta.region_name == region:
            return False
        self._regions[bucket] = region
        return True

    def signed(self, bucket: str, key: str, version: str | None,
               byte_range: str | None) -> tuple[str, dict[str, str]]:
        """As botocore signs it: the ``storage_options``' parameters that the operation takes
        (s3fs too leaves out the others, a GetObject's response overrides from a HeadObject,
        say) and the range."""
        from botocore import xform_name  # imported with the signer's client already
        operation = "HeadObject" if byte_range is None else "GetObject"
        client = self.client(bucket)
        taken = client.meta.service_model.operation_model(operation).input_shape.members
        params = {"Bucket": bucket, "Key": key, **self.params,
                  **({} if version is None else {"VersionId": version}),
                  **({} if byte_range is None else {"Range": byte_range})}
        try:
            getattr(client, xform_name(operation))(
                **{k: v for k, v in params.items() if k in taken})
        except _Prepared as prepared:
            request = prepared.request
            return request.url, {name: value.decode() if isinstance(value, bytes) else value
                                 for name, value in request.headers.items()}
        raise AssertionError("botocore sent the request it was to sign only")


def _s3_transport(client: dict, config: dict, ca_bundle: str | None) -> Transport:
    """What botocore's client would connect through: its ``verify``, else its CA bundle
    (``AWS_CA_BUNDLE``, or a profile's ``ca_bundle``), its config's proxies, else the
    environment's."""
    verify = client.get("verify")
    return Transport(tls=_context((ca_bundle or None) if verify is None else verify),
                     proxies=_proxies_of(config.get("proxies")), trust_env=True)


def _proxies_of(proxies: object) -> tuple[tuple[str, str], ...] | None:
    return None if not isinstance(proxies, dict) else tuple(proxies.items())


_signers: dict[str, S3Signer] = {}
_signers_lock = threading.Lock()
_sessions: dict[str | None, Any] = {}
_sessions_lock = threading.Lock()  # a botocore session is not thread-safe: clients made in turn


def _session(profile: str | None) -> Any:
    """One botocore session for each profile, shared by the signers of all ``storage_options``
    (and by the clients of each bucket's region): it loads S3's service model (most of the
    60 ms of a process's first client: a client for other options then takes 6 ms, not 67)
    and, where no key is given, walks the credential providers once in a process rather than
    once for each client."""
    import botocore.session
    with _sessions_lock:
        if profile not in _sessions:
            _sessions[profile] = botocore.session.Session(profile=profile)
        return _sessions[profile]


def _signer(options: dict, url: str) -> S3Signer:
    """One signer for each ``storage_options``: making a botocore client takes tens of ms,
    importing botocore a hundred more, so it is made only where ``remote_sigv4`` cannot sign."""
    key = repr(sorted(options.items(), key=lambda item: item[0]))
    with _signers_lock:
        if key not in _signers:
            _signers[key] = _own_signer(options) or _BotocoreSigner(dict(options), url)
        return _signers[key]


def _own_signer(options: dict) -> S3Signer | None:
    """``remote_sigv4``'s signer for the options that the requests depend on, if it takes them."""
    client = options.get("client_kwargs") or {}
    return own_signer({name: value for name, value in options.items()
                       if name not in _FILE_SYSTEM_ONLY},
                      _s3_transport(client, {}, os.environ.get("AWS_CA_BUNDLE")
                                    if _over_tls(options, client) else None))


def _over_tls(options: dict, client: dict) -> bool:
    """Whether the requests go over TLS (where a CA bundle matters: a bundle that cannot be
    read fails only those)."""
    endpoint = client.get("endpoint_url") or options.get("endpoint_url")
    return (not endpoint.startswith("http://") if endpoint
            else bool(options.get("use_ssl", True)))


class _S3(Source):
    """An S3 object's requests, signed by ``signer`` for each range."""

    def __init__(self, signer: S3Signer, url: str) -> None:
        super().__init__(signer.transport, url)
        self.signer = signer
        self.bucket, _, self.key = url.split("://", 1)[1].partition("/")
        self.version: str | None = None
        if signer.version_aware and "?versionId=" in self.key:
            self.key, _, self.version = self.key.partition("?versionId=")

    def request(self, start: int, end: int) -> tuple[str, dict[str, str]]:
        return self.signer.signed(self.bucket, self.key, self.version, f"bytes={start}-{end - 1}")

    def head(self) -> tuple[str, dict[str, str]]:
        """A HeadObject, signed as the GetObject of ``request`` is."""
        return self.signer.signed(self.bucket, self.key, self.version, None)

    def refusal(self, status: int, reason: str, head: Any, body: bytes) -> Exception:
        """S3's error code and message from its answer's XML; a bucket in another region than
        the one signed for is asked again there (a transient failure: the retry goes there)."""
        region = head.get("x-amz-bucket-region")
        if region and self.signer.moved(self.bucket, region):
            return _BadAnswer("busy", f"the bucket is in region {region}: asked again there")
        text = body.decode("utf-8", "replace")
        code, message = (re.search(rf"<{tag}>([^<]*)</{tag}>", text) for tag in ("Code", "Message"))
        return StatusAnswer(status, reason, code and code[1], message and message[1])
