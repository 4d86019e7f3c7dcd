import django.utils.timezone
from django.db import migrations, models

# Each ledger row records the backend that wrote it, whatever the ORM sent (a trigger,
# not db_default: Django 4.2, the oldest the package allows, has none).
WRITER = """
CREATE FUNCTION shop_ledger_writer() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.backend := pg_backend_pid();
    RETURN NEW;
END $$;
CREATE TRIGGER shop_ledger_writer BEFORE INSERT ON shop_ledger
    FOR EACH ROW EXECUTE FUNCTION shop_ledger_writer();
"""
UNWRITER = "DROP TRIGGER shop_ledger_writer ON shop_ledger; DROP FUNCTION shop_ledger_writer();"


class Migration(migrations.Migration):
    initial = True
    dependencies = ()

    operations = (
        migrations.CreateModel(
            name="Ledger",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("tenant", models.CharField(max_length=64)),
                ("entry", models.CharField(max_length=64)),
                ("backend", models.IntegerField(null=True)),
                ("written_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("data", models.JSONField(default=dict)),
            ],
        ),
        migrations.RunSQL(WRITER, UNWRITER),
        migrations.CreateModel(
            name="Note",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("tenant", models.CharField(max_length=64)),
                ("text", models.CharField(max_length=200)),
            ],
        ),
    )
