"""What is measured and where it is kept.

    monitor.models   typed SQLAlchemy tables (run, step, event, host rows)
    monitor.store    Store (SQLite, WAL) and validate_row
    monitor.queries  the dashboard's read helpers (mixed into Store)
    monitor.sink     Sink, SQLiteSink, HttpSink, NullSink, make_sink
    monitor.queued   the non-blocking queue / spool / retry machinery behind the sinks
    monitor.spool    the local file of undelivered rows

It never imports elastic/, webui/ or jobs/, so any training framework can use it.
"""
