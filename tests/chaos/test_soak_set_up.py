"""`make soak ARGS="--patroni ..."` sets up on a fresh machine what it needs, as `make test`
does: here the account Patroni runs as, missing (an account of the test's own stands in
for ``pglock-patroni``, created by the soak's set-up and removed by the test)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.chaos import soak
from tests.support import patroni
from tests.support.ci import missing
from tests.support.patroni import ClusterUnavailable, PatroniCluster


def test_the_patroni_soak_creates_the_missing_account_patroni_runs_as(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if os.geteuid() != 0:
        missing("creating an account needs root")
    account = f"pglock-t{uuid.uuid4().hex[:8]}"
    with pytest.raises(KeyError):
        pwd.getpwnam(account)
    monkeypatch.setattr(patroni, "ACCOUNT", account)
    made: list[PatroniCluster] = []

    def start_nothing(self: PatroniCluster, *args: Any, **kwargs: Any) -> None:
        made.append(self)  # the soak got as far as a cluster, made for the account
        raise ClusterUnavailable("this test starts no cluster")

    monkeypatch.setattr(PatroniCluster, "start", start_nothing)
    logs = set(Path(tempfile.gettempdir()).glob("pglock-soak-*"))
    try:
        assert soak.main(["--patroni", "--duration", "1"]) == 2
        assert pwd.getpwnam(account).pw_name == account
        assert len(made) == 1 and made[0].account is not None
        assert made[0].account.pw_name == account
    finally:
        subprocess.run(["userdel", account], check=False, capture_output=True)
        for cluster in made:
            cluster.stop()
        for kept in set(Path(tempfile.gettempdir()).glob("pglock-soak-*")) - logs:
            shutil.rmtree(kept)  # the soak's log directory, empty
    with pytest.raises(KeyError):
        pwd.getpwnam(account)
