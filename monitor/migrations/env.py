"""Alembic's environment for Regatta's store: migrations run on the connection that
monitor.migrate passes in ``config.attributes["connection"]``, inside its transaction."""
from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None)
with context.begin_transaction():
    context.run_migrations()
