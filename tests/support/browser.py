"""Headless Debian Chromium through its chromedriver (no browser download), for page tests."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from typing import Any

from tests.support.ci import missing


def chromium(arguments: Sequence[str], *, browser_log: bool = False) -> Any:
    """Start Chromium with ``arguments``; fail in CI (skip elsewhere) when it is missing.

    ``browser_log`` keeps the page's console messages for ``get_log("browser")``.
    """
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        missing(
            "Chromium and chromium-driver (Debian packages) are not installed: "
            "`make` installs them when run as root"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in arguments:
        options.add_argument(argument)
    if browser_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))
