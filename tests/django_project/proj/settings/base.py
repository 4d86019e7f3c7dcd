"""Settings every environment shares. The database and broker come from SHOP_* variables.

No HOST unless SHOP_DB_HOST is set (libpq's default, the Unix socket), PORT "" unless
SHOP_DB_PORT is set, OPTIONS as a project has them.
"""

import os

SECRET_KEY = "only-for-the-tests"
DEBUG = False
USE_TZ = True
TIME_ZONE = "Europe/Paris"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["pglock_celery.django", "shop"]

_default = {
    "ENGINE": "django.db.backends.postgresql",
    "NAME": os.environ.get("SHOP_DB_NAME", "shop"),
    "USER": os.environ.get("SHOP_DB_USER", "shop"),
    "PASSWORD": os.environ.get("SHOP_DB_PASSWORD", ""),
    "PORT": os.environ.get("SHOP_DB_PORT", ""),
    "CONN_MAX_AGE": 60,
    "OPTIONS": {"connect_timeout": 5, "application_name": "shop"},
}
if os.environ.get("SHOP_DB_OPTIONS"):
    _default["OPTIONS"]["options"] = os.environ["SHOP_DB_OPTIONS"]
if os.environ.get("SHOP_DB_HOST"):
    _default["HOST"] = os.environ["SHOP_DB_HOST"]
DATABASES = {"default": _default}

CELERY_BROKER_URL = os.environ.get("SHOP_BROKER_URL", "memory://")
CELERY_RESULT_BACKEND = os.environ.get("SHOP_BROKER_URL", "cache+memory://")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("SHOP_QUEUE", "shop")
# More task modules, as a project lists them (the tests name one that a worker refuses).
CELERY_IMPORTS = tuple(filter(None, os.environ.get("SHOP_TASK_MODULES", "").split(",")))
