"""pglock_patroni_cafile, pglock_patroni_certfile, pglock_patroni_keyfile: checked when the
settings are read (a worker's start), per shard too; the fence's own TLS context."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from pglock_celery.config import PglockConfig, load_config
from pglock_celery.exceptions import ConfigurationError
from pglock_celery.leader import leader_source
from pglock_celery.patroni import LeaderFence
from pglock_celery.task import configuration_problems
from tests.support.locks import eager_app
from tests.support.patroni import make_tls

URL = "https://127.0.0.1:8008"


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_tls(tmp_path_factory.mktemp("tls"))


def test_a_tls_file_that_does_not_exist_is_refused_naming_the_setting(tmp_path: Path) -> None:
    missing = tmp_path / "ca.pem"
    with pytest.raises(ConfigurationError) as refused:
        load_config({"pglock_patroni_cafile": str(missing)}, {})
    assert "pglock_patroni_cafile" in str(refused.value)
    assert "cannot be read: No such file or directory" in str(refused.value)


def test_a_tls_file_from_the_environment_is_named_by_its_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as refused:
        load_config({}, {"PGLOCK_PATRONI_CERTFILE": str(tmp_path)})  # a directory
    assert "PGLOCK_PATRONI_CERTFILE" in str(refused.value), refused.value


def test_a_ca_file_that_is_not_pem_certificates_is_refused(tmp_path: Path) -> None:
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigurationError) as refused:
        load_config({"pglock_patroni_cafile": str(junk)}, {})
    assert "pglock_patroni_cafile: not a PEM file of CA certificates" in str(refused.value)


def test_a_key_without_its_certificate_or_not_matching_it_is_refused(
    pem: dict[str, Path],
) -> None:
    with pytest.raises(ConfigurationError) as alone:
        PglockConfig(patroni_keyfile=str(pem["patroni_keyfile"]))
    assert "pglock_patroni_keyfile is set without pglock_patroni_certfile" in str(alone.value)
    with pytest.raises(ConfigurationError) as mismatched:
        PglockConfig(
            patroni_certfile=str(pem["patroni_certfile"]),
            patroni_keyfile=str(pem["server_keyfile"]),
        )
    assert "pglock_patroni_certfile, pglock_patroni_keyfile" in str(mismatched.value)


def test_a_worker_refuses_to_start_with_an_unreadable_tls_file(tmp_path: Path) -> None:
    app = eager_app(
        "host=127.0.0.1 dbname=x", patroni_url=URL, patroni_cafile=str(tmp_path / "gone.pem")
    )
    [problem] = configuration_problems(app)
    assert "pglock_patroni_cafile" in problem and "cannot be read" in problem, problem


def test_the_fence_verifies_with_the_ca_given_and_shows_the_client_certificate(
    pem: dict[str, Path],
) -> None:
    config = PglockConfig(
        patroni_url=(URL,),
        patroni_cafile=str(pem["patroni_cafile"]),
        patroni_certfile=str(pem["patroni_certfile"]),
        patroni_keyfile=str(pem["patroni_keyfile"]),
    )
    fence = leader_source(config)
    assert isinstance(fence, LeaderFence)
    context = fence._client.tls
    assert context is not None
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    [ca] = context.get_ca_certs()  # only the CA given, not the system's
    assert dict(item[0] for item in ca["subject"])["commonName"] == "pglock test CA"
    # Without the settings: the default context, as before.
    assert LeaderFence.from_setting(URL)._client.tls is None


def test_a_shard_gives_its_own_tls_files_or_takes_the_maps(
    pem: dict[str, Path], tmp_path: Path
) -> None:
    other = make_tls(tmp_path / "other")
    config = load_config(
        {
            "pglock_patroni_cafile": str(pem["patroni_cafile"]),
            "pglock_shards": {
                "a": {"dsn": "host=pg-a dbname=app", "patroni_url": URL},
                "b": {
                    "dsn": "host=pg-b dbname=app",
                    "patroni_url": URL,
                    "patroni_cafile": str(other["patroni_cafile"]),
                    "patroni_certfile": str(other["patroni_certfile"]),
                    "patroni_keyfile": str(other["patroni_keyfile"]),
                },
            },
        },
        {},
    )
    a, b = config.for_shard("a"), config.for_shard("b")
    assert a.patroni_cafile == str(pem["patroni_cafile"]) and a.patroni_certfile is None
    assert b.patroni_cafile == str(other["patroni_cafile"])
    assert b.patroni_keyfile == str(other["patroni_keyfile"])
    with pytest.raises(ConfigurationError) as refused:
        load_config(
            {
                "pglock_shards": {
                    "c": {"dsn": "host=pg-c", "patroni_cafile": str(tmp_path / "gone.pem")}
                }
            },
            {},
        )
    assert "shard 'c': its patroni_cafile: cannot be read" in str(refused.value), refused.value
