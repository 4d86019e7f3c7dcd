import django.utils.timezone
from django.db import migrations, models


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
                (
                    "backend",
                    models.IntegerField(
                        db_default=models.Func(
                            function="pg_backend_pid", output_field=models.IntegerField()
                        )
                    ),
                ),
                ("written_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("data", models.JSONField(default=dict)),
            ],
        ),
        migrations.CreateModel(
            name="Note",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("tenant", models.CharField(max_length=64)),
                ("text", models.CharField(max_length=200)),
            ],
        ),
    )
