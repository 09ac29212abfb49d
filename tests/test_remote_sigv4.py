"""S3 requests signed without botocore (``shmseq.remote_sigv4``): for every case it takes, the
very request botocore signs (URL, every signed header, the signature), at the same instant;
every case it leaves to botocore is left; a process that reads an index from S3 with its keys
given never imports botocore."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("botocore")

from shmseq import remote_sigv4, remote_sources  # noqa: E402
from shmseq.remote_stream import Transport  # noqa: E402

NOW = datetime.datetime(2026, 3, 7, 23, 59, 58, tzinfo=datetime.timezone.utc)
UNSIGNED_BY_BOTOCORE = {"user-agent", "amz-sdk-invocation-id", "amz-sdk-request"}
KEYS = {"key": "AKIDEXAMPLE", "secret": "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"}
ENDPOINT = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000",
                              "region_name": "us-east-1"}}


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch, tmp_path):
    """No AWS setting but those a case sets, no ~/.aws, and one instant for both signers."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(remote_sigv4, "_now", lambda: NOW)
    import botocore.auth
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: NOW.replace(tzinfo=None))
    monkeypatch.setattr(remote_sources, "_sessions", {})
    monkeypatch.setattr(remote_sources, "_signers", {})


def both(options: dict, url: str) -> tuple[remote_sources._S3, remote_sources._S3]:
    own = remote_sources._own_signer(options)
    assert own is not None, f"{options} are botocore's to sign"
    return (remote_sources._S3(own, url),
            remote_sources._S3(remote_sources._BotocoreSigner(dict(options), url), url))


def request(signed: tuple[str, dict[str, str]]) -> tuple[str, dict[str, str]]:
    url, headers = signed
    return url, {name.lower(): value for name, value in headers.items()
                 if name.lower() not in UNSIGNED_BY_BOTOCORE}


CASES = {
    "endpoint": (ENDPOINT | KEYS, "s3://bench/shards/shard-00000.tar"),
    "endpoint given at the top": ({**KEYS, "endpoint_url": "https://minio.example:9000/store/"},
                                  "s3://bench/a.tar"),
    "endpoint at https's own port": ({**KEYS, "endpoint_url": "https://minio.example:443"},
                                     "s3://bench/a.tar"),
    "no region": (KEYS, "s3://my-bucket/train/a.tar"),
    "us-east-1": ({**KEYS, "client_kwargs": {"region_name": "us-east-1"}}, "s3://my-bucket/a"),
    "another region": ({**KEYS, "client_kwargs": {"region_name": "eu-west-1"}},
                       "s3://my-bucket/a"),
    "plain http": ({**KEYS, "use_ssl": False, "client_kwargs": {"region_name": "ap-south-1"}},
                   "s3://my-bucket/a"),
    "a dotted bucket": ({**KEYS, "client_kwargs": {"region_name": "eu-west-1"}},
                        "s3://my.dotted.bucket/a"),
    "a bucket of capitals": (KEYS, "s3://My_Bucket/a"),
    "a short bucket": (KEYS, "s3://bk/a"),
    "a key to quote": (KEYS, "s3://my-bucket/dir with space/a+b=c&d~e/ü/%41.tar"),
    "a key from a slash": (KEYS, "s3://my-bucket//leading"),
    "a session token": ({**KEYS, "token": "FQoGZXIvYXdzE//token+/=="}, "s3://my-bucket/a"),
    "user and password": ({"username": KEYS["key"], "password": KEYS["secret"]},
                          "s3://my-bucket/a"),
    "anonymous": ({"anon": True, "client_kwargs": {"region_name": "us-west-2"}},
                  "s3://public-data/a.tar"),
    "requester pays": ({**KEYS, "requester_pays": True}, "s3://my-bucket/a"),
    "a version": ({**KEYS, "version_aware": True}, "s3://my-bucket/a.tar?versionId=3/L4kqtJl+"),
    "a version not asked for": (KEYS, "s3://my-bucket/a.tar?versionId=3"),
    "options fsspec alone takes": ({**ENDPOINT, **KEYS, "use_listings_cache": False,
                                    "default_block_size": 1 << 20}, "s3://bench/a.tar"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_request_is_signed_as_botocore_signs_it(case):
    options, url = CASES[case]
    own, botocore = both(options, url)
    assert request(own.request(0, 1 << 20)) == request(botocore.request(0, 1 << 20))
    assert request(own.head()) == request(botocore.head())


def test_the_credentials_and_region_of_the_environment_are_botocores(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDFROMENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret/from+env")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "token-from-env")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ca-central-1")
    monkeypatch.setenv("AWS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    own, botocore = both({}, "s3://my-bucket/a.tar")
    assert request(own.request(5, 10)) == request(botocore.request(5, 10))
    assert "Credential=AKIDFROMENV/20260307/ca-central-1/" in own.request(5, 10)[1]["Authorization"]
    given, botocore = both({**KEYS, "client_kwargs": {"region_name": "eu-north-1"}},
                           "s3://my-bucket/a.tar")
    assert request(given.request(5, 10)) == request(botocore.request(5, 10))  # options first


def test_a_bucket_found_in_another_region_is_signed_there():
    own, botocore = both({**KEYS, "client_kwargs": {"region_name": "us-east-1"}},
                         "s3://my-bucket/a.tar")
    assert own.signer.moved("my-bucket", "eu-central-1")
    assert botocore.signer.moved("my-bucket", "eu-central-1")
    assert not own.signer.moved("my-bucket", "eu-central-1")
    url, headers = own.request(0, 10)
    assert url == "https://my-bucket.s3.eu-central-1.amazonaws.com/a.tar"
    assert request((url, headers)) == request(botocore.request(0, 10))


BOTOCORES = {
    "a profile": {**KEYS, "profile": "training"},
    "botocore's config": {**KEYS, "config_kwargs": {"s3": {"addressing_style": "virtual"}}},
    "a client option": {**KEYS, "client_kwargs": {"region_name": "us-east-1",
                                                  "aws_account_id": "123456789012"}},
    "parameters of s3fs's": {**KEYS, "s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256"}},
    "a key without its secret": {"key": "AKIDEXAMPLE"},
    "no credentials": {"client_kwargs": {"region_name": "us-east-1"}},
    "China's partition": {**KEYS, "client_kwargs": {"region_name": "cn-north-1"}},
    "GovCloud": {**KEYS, "client_kwargs": {"region_name": "us-gov-west-1"}},
}


@pytest.mark.parametrize("case", BOTOCORES)
def test_what_botocore_decides_is_left_to_it(case):
    assert remote_sigv4.own_signer(BOTOCORES[case], Transport()) is None


@pytest.mark.parametrize("setting", ["AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_CONFIG_FILE",
                                     "AWS_USE_FIPS_ENDPOINT", "AWS_RESPONSE_CHECKSUM_VALIDATION",
                                     ".aws/config", ".aws/credentials"])
def test_botocore_signs_where_it_is_configured(setting, monkeypatch, tmp_path):
    if setting.startswith("."):
        (tmp_path / setting).parent.mkdir()
        (tmp_path / setting).write_text("[default]\nregion = eu-west-3\n")
    else:
        monkeypatch.setenv(setting, "x")
    assert remote_sigv4.own_signer(ENDPOINT | KEYS, Transport()) is None
    assert isinstance(remote_sources._signer(ENDPOINT | KEYS, "s3://bench/a"),
                      remote_sources._BotocoreSigner)


def test_the_signing_key_is_made_once_a_day(monkeypatch):
    own, _ = both(ENDPOINT | KEYS, "s3://bench/a.tar")
    made = []
    real = remote_sigv4.hmac.new
    monkeypatch.setattr(remote_sigv4.hmac, "new", lambda *args: made.append(args[1]) or real(*args))
    for start in range(3):
        own.request(start, start + 1)
    assert made.count(b"aws4_request") == 1 and len(made) == 4 + 3  # the key's, then a signature each


LOADED_IN_A_FRESH_PROCESS = """
import json, sys
from shmseq.shards import ShardIndex
index = ShardIndex.load(sys.argv[1], json.loads(sys.argv[2]))
print(json.dumps({"shards": len(index.shards),
                  "botocore": sorted(m for m in sys.modules if m.split(".")[0] == "botocore")}))
"""


def test_an_index_on_s3_is_read_without_importing_botocore(tmp_path):
    """Importing botocore and making its client took the trainer 0.16 s of CPU before its
    workers started: with the keys given, it reads the index without it."""
    pytest.importorskip("moto.moto_server.werkzeug_app")
    from servers import serving
    from shmseq.shards import write_shards
    (tmp_path / "set").mkdir()
    write_shards(({"__key__": f"{k:03d}", "txt": str(k).encode()} for k in range(6)),
                 str(tmp_path / "set" / "shard-%02d.tar"), samples_per_shard=2)
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith("AWS_")}
    with serving(lambda servers: servers.S3Server()) as moto:
        root = moto.upload(tmp_path / "set", "set")
        done = subprocess.run(
            [sys.executable, "-c", LOADED_IN_A_FRESH_PROCESS, f"{root}/shards.json",
             json.dumps(moto.storage_options)], capture_output=True, text=True, timeout=60,
            env={**environment, "HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"shards": 3, "botocore": []}


@pytest.fixture
def private_ca(tmp_path):
    """A self-signed certificate, as a private CA's bundle (``openssl`` makes it)."""
    bundle = tmp_path / "ca.pem"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=shmseq private CA", "-keyout", str(tmp_path / "ca.key"),
                        "-out", str(bundle)], check=True, capture_output=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("no openssl to make a certificate")
    return bundle


def issuers(source: remote_sources.Source) -> list[str]:
    tls = source.transport.tls
    return [] if tls is None else [dict(pair[0] for pair in cert["subject"])["commonName"]
                                   for cert in tls.get_ca_certs()]


@pytest.mark.parametrize("signer", ["own", "botocore"])
def test_aws_ca_bundle_is_trusted_over_tls_as_botocore_trusts_it(signer, private_ca,
                                                                 monkeypatch):
    """A private CA named in ``AWS_CA_BUNDLE`` (MinIO or Ceph behind their own certificates) is
    what an https endpoint's certificate is checked against, whoever signs; an http endpoint
    reads no bundle (one that cannot be read fails nothing there). It was left out before:
    only ``client_kwargs={"verify": ...}`` was taken."""
    monkeypatch.setenv("AWS_CA_BUNDLE", str(private_ca))
    extra = {"profile": None} if signer == "botocore" else {}  # a profile option: botocore's
    https = {**KEYS, **extra, "endpoint_url": "https://minio.example:9000"}
    made = remote_sources.source("s3://bench/a.tar", https)
    assert isinstance(made.signer, remote_sigv4.OwnSigner) == (signer == "own")
    assert issuers(made) == ["shmseq private CA"]
    monkeypatch.setenv("AWS_CA_BUNDLE", str(private_ca.with_name("missing.pem")))
    plain = remote_sources.source("s3://bench/a.tar",
                                  {**https, "endpoint_url": "http://127.0.0.1:9"})
    assert plain.transport.tls is None
