from django.db import migrations

from pglock_celery.django.operations import InstallGuard


class Migration(migrations.Migration):
    dependencies = (("shop", "0001_initial"),)

    operations = (InstallGuard(model_name="Ledger", lock_name="shop:{tenant}"),)
