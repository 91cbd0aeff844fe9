"""``--web.config.file`` parsing: every accepted setting, and a precise ConfigError for every mistake."""

from __future__ import annotations

import base64
import datetime
import ssl
from pathlib import Path

import bcrypt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.http.basicauth import parse_basic_authorization
from gpu_energy_exporter.http.tls import TLSServerConfig
from gpu_energy_exporter.http.webconfig import WebConfig, load_web_config


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    self_signed(d, "server")
    self_signed(d, "other")
    return d


def load(tmp_path: Path, text: str) -> WebConfig:
    path = tmp_path / "web.yml"
    path.write_text(text)
    return load_web_config(path)


def tls(certs: Path, extra: str = "") -> str:
    return f"tls_server_config:\n  cert_file: {certs}/server.crt\n  key_file: {certs}/server.key\n{extra}"


GOOD_HASH = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()


# ----------------------------------------------------------------------------------------------------
# valid files


def test_no_file_means_plain_http_without_auth() -> None:
    cfg = load_web_config(None)
    assert cfg.ssl_context() is None
    assert not cfg.tls_enabled and not cfg.auth_enabled
    assert cfg.check_basic_auth(None)


@pytest.mark.parametrize("text", ["", "# only a comment\n", "tls_server_config: {}\n",
                                  "tls_server_config:\n  cert_file: ''\n"])
def test_empty_sections_mean_plain_http(tmp_path: Path, text: str) -> None:
    cfg = load(tmp_path, text)
    assert cfg.tls is None and cfg.ssl_context() is None
    assert cfg.headers == () and cfg.rate_limit is None


def test_full_file(tmp_path: Path, certs: Path) -> None:
    cfg = load(tmp_path, tls(certs, f"""
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: {certs}/other.crt
  client_allowed_sans: [prometheus.example]
  min_version: TLS13
  max_version: TLS13
  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256]
  prefer_server_cipher_suites: false
http_server_config:
  http2: false
  headers:
    Strict-Transport-Security: max-age=31536000
basic_auth_users:
  alice: {GOOD_HASH}
rate_limit:
  interval: 500ms
  burst: 10
"""))
    assert cfg.tls is not None
    assert cfg.tls.client_auth_type == "RequireAndVerifyClientCert"
    ctx = cfg.ssl_context()
    assert ctx is not None
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert not ctx.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    names = {c["name"] for c in ctx.get_ciphers()}
    assert "ECDHE-ECDSA-AES128-GCM-SHA256" in names
    assert "ECDHE-ECDSA-AES256-GCM-SHA384" not in names
    assert cfg.headers == (("Strict-Transport-Security", "max-age=31536000"),)
    assert cfg.rate_limit is not None and cfg.rate_limit.interval_s == 0.5 and cfg.rate_limit.burst == 10
    assert cfg.auth_enabled
    assert ctx is cfg.ssl_context()  # cached while the files do not change


def test_relative_paths_resolve_against_the_config_directory(
    tmp_path: Path, certs: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    (certs / "web.yml").write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: ./server.key\n")
    cfg = load_web_config(certs / "web.yml")
    assert cfg.tls is not None
    assert cfg.tls.cert_file == str(certs / "server.crt")
    assert cfg.tls.key_file == str(certs / "server.key")


def test_inline_pem(tmp_path: Path, certs: Path) -> None:
    cert = (certs / "server.crt").read_text()
    key = (certs / "server.key").read_text()
    ca = (certs / "other.crt").read_text()

    def block(text: str) -> str:
        return "|\n" + "".join("    " + line + "\n" for line in text.splitlines())

    cfg = load(tmp_path, f"""tls_server_config:
  cert: {block(cert)}  key: {block(key)}  client_ca: {block(ca)}  client_auth_type: VerifyClientCertIfGiven
""")
    ctx = cfg.ssl_context()
    assert ctx is not None and ctx.verify_mode == ssl.CERT_OPTIONAL
    assert "PRIVATE KEY" not in repr(cfg)  # inline secrets stay out of logs


@pytest.mark.parametrize("auth,mode", [("NoClientCert", ssl.CERT_NONE), ("RequestClientCert", ssl.CERT_NONE),
                                       ("RequireAnyClientCert", ssl.CERT_REQUIRED),
                                       ("RequireClientCert", ssl.CERT_REQUIRED)])
def test_client_auth_types(tmp_path: Path, certs: Path, auth: str, mode: ssl.VerifyMode) -> None:
    ca = f"  client_ca_file: {certs}/other.crt\n" if "Require" in auth else ""
    cfg = load(tmp_path, tls(certs, f"  client_auth_type: {auth}\n{ca}"))
    ctx = cfg.ssl_context()
    assert ctx is not None and ctx.verify_mode == mode


# ----------------------------------------------------------------------------------------------------
# mistakes


@pytest.mark.parametrize("text,message", [
    ("tls_server_config: [\n", "not valid YAML"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("basic_auth: {}\n", "unknown key 'basic_auth' in the top level"),
    ("tls_server_config:\n  certfile: x\n", "unknown key 'certfile' in tls_server_config"),
    ("http_server_config:\n  gzip: true\n", "unknown key 'gzip' in http_server_config"),
    ("rate_limit:\n  every: 1s\n", "unknown key 'every' in rate_limit"),
    ("tls_server_config:\n  cert_file: a.crt\n", "missing one of key or key_file"),
    ("tls_server_config:\n  key_file: a.key\n", "missing one of cert or cert_file"),
    ("tls_server_config:\n  cert_file: 42\n", "tls_server_config.cert_file must be a string"),
    ("http_server_config:\n  headers:\n    Server: nginx\n", "header 'Server' can not be configured"),
    ("http_server_config:\n  headers:\n    X-Frame-Options: allow\n", "'allow' is not one of deny, sameorigin"),
    ("http_server_config:\n  http2: maybe\n", "http2 must be true or false"),
    ("rate_limit:\n  interval: 1s\n  burst: 0\n", "burst must be a positive integer"),
    ("rate_limit:\n  interval: soon\n  burst: 1\n", "rate_limit.interval 'soon'"),
    ("basic_auth_users:\n  123: x\n", "user name 123 must be a non-empty string"),
    ("basic_auth_users:\n  'a:b': x\n", "contains ':'"),
])
def test_config_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, text)
    assert message in str(exc.value)
    assert str(tmp_path / "web.yml") in str(exc.value)  # the file is named


@pytest.mark.parametrize("extra,message", [
    ("  client_auth_type: Sometimes\n", "client_auth_type 'Sometimes' is not one of NoClientCert"),
    ("  client_ca_file: {certs}/other.crt\n", "client_auth_type is NoClientCert"),
    ("  client_auth_type: RequireAnyClientCert\n", "cannot accept a client certificate without verifying"),
    ("  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {certs}/other.crt\n"
     "  client_allowed_sans: [a]\n", "client_allowed_sans requires client_auth_type"),
    ("  min_version: TLS14\n", "min_version 'TLS14' is not one of TLS10"),
    ("  min_version: TLS13\n  max_version: TLS12\n", "min_version TLS13 is above max_version TLS12"),
    ("  cipher_suites: [TLS_RSA_WITH_RC4_128_SHA]\n", "unknown or insecure cipher 'TLS_RSA_WITH_RC4_128_SHA'"),
    ("  curve_preferences: [CurveP256]\n", "curve_preferences is not supported"),
    ("  curve_preferences: [P-999]\n", "unknown curve 'P-999'"),
    ("  prefer_server_cipher_suites: yes please\n", "prefer_server_cipher_suites must be true or false"),
    ("  cert: inline\n", "either cert or cert_file, not both"),
    ("  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: missing-ca.crt\n",
     "client_ca_file '{tmp}/missing-ca.crt': cannot read: No such file or directory"),
    ("  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {certs}/server.key\n",
     "holds no usable PEM certificate"),
])
def test_tls_config_errors(tmp_path: Path, certs: Path, extra: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, tls(certs, extra.format(certs=certs)))
    assert message.format(tmp=tmp_path) in str(exc.value)


def test_missing_cert_file(tmp_path: Path, certs: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, f"tls_server_config:\n  cert_file: nope.crt\n  key_file: {certs}/server.key\n")
    assert f"tls_server_config.cert_file '{tmp_path}/nope.crt': cannot read: No such file or directory" \
        in str(exc.value)


def test_cert_is_not_pem(tmp_path: Path, certs: Path) -> None:
    (tmp_path / "bad.crt").write_text("hello")
    with pytest.raises(ConfigError, match="cert_file .*bad.crt' holds no PEM certificate"):
        load(tmp_path, f"tls_server_config:\n  cert_file: bad.crt\n  key_file: {certs}/server.key\n")


def test_key_does_not_match_cert(tmp_path: Path, certs: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be used together"):
        load(tmp_path, f"tls_server_config:\n  cert_file: {certs}/server.crt\n  key_file: {certs}/other.key\n")


def test_encrypted_key_is_refused(tmp_path: Path, certs: Path) -> None:
    key = serialization.load_pem_private_key((certs / "server.key").read_bytes(), password=None)
    (tmp_path / "enc.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase")))
    with pytest.raises(ConfigError, match="enc.key' is encrypted"):
        load(tmp_path, f"tls_server_config:\n  cert_file: {certs}/server.crt\n  key_file: enc.key\n")


def test_bad_bcrypt_hash_names_the_user_not_the_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, "basic_auth_users:\n  alice: plaintext-password\n")
    assert "password of user 'alice' is not a bcrypt hash" in str(exc.value)
    assert "plaintext-password" not in str(exc.value)


def test_unreadable_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read web config file .*missing.yml.*No such file"):
        load_web_config(tmp_path / "missing.yml")


# ----------------------------------------------------------------------------------------------------
# basic auth and SAN helpers


@pytest.mark.parametrize("header,expected", [
    (None, None), ("", None), ("Bearer abc", None), ("Basic !!!", None),
    ("Basic " + base64.b64encode(b"no-colon").decode(), None),
    ("Basic " + base64.b64encode(b"\xff:pw").decode(), None),
    ("Basic " + base64.b64encode(b"alice:pa:ss").decode(), ("alice", b"pa:ss")),
    ("basic " + base64.b64encode(b"alice:").decode(), ("alice", b"")),
])
def test_parse_basic_authorization(header: str | None, expected: tuple[str, bytes] | None) -> None:
    assert parse_basic_authorization(header) == expected


@pytest.mark.parametrize("prefix", ["$2a$", "$2b$", "$2y$"])
def test_check_basic_auth_accepts_every_bcrypt_prefix(tmp_path: Path, prefix: str) -> None:
    cfg = load(tmp_path, f"basic_auth_users:\n  alice: '{GOOD_HASH.replace('$2b$', prefix)}'\n")
    good = "Basic " + base64.b64encode(b"alice:pw").decode()
    assert cfg.check_basic_auth(good)
    assert not cfg.check_basic_auth("Basic " + base64.b64encode(b"alice:pw2").decode())
    assert not cfg.check_basic_auth("Basic " + base64.b64encode(b"bob:pw").decode())
    assert not cfg.check_basic_auth(None)


def test_client_san_matching() -> None:
    t = TLSServerConfig(cert_file="x", key_file="y", client_auth_type="RequireAndVerifyClientCert",
                        client_allowed_sans=("prometheus.example", "2001:db8::1"))
    assert t.client_san_allowed({"subjectAltName": (("DNS", "prometheus.example"),)})
    # Python prints IPv6 SANs uncompressed and upper-case.
    assert t.client_san_allowed({"subjectAltName": (("IP Address", "2001:DB8:0:0:0:0:0:1"),)})
    assert not t.client_san_allowed({"subjectAltName": (("DNS", "evil.example"),)})
    assert not t.client_san_allowed({"subject": ((("commonName", "prometheus.example"),),)})
    assert not t.client_san_allowed(None)
    assert TLSServerConfig(cert_file="x", key_file="y").client_san_allowed(None)
