"""What is measured and where it is kept.

    monitor.models       typed SQLAlchemy tables (run, step, event, host, metric rows; the
                         per-run summary and per-process progress the store keeps)
    monitor.schema       row validation derived from the models (RowError names the field)
    monitor.dialect      SQLite path or SQLAlchemy URL -> engine; per-database differences
    monitor.migrate      Alembic migrations (monitor/migrations), run when a store opens
    monitor.store        Store: batched, exactly-once writes; UnknownRun
    monitor.rollup       the per-run summary kept while writing
    monitor.queries      the one read module (mixed into Store), over:
    monitor.series       step-metric series, imbalance, timeline, pipeline stages
    monitor.host_samples CPU %, memory and GPU per host over wall time
    monitor.runs         runs list, run, events, user metrics, edits, exports
    monitor.recovery     what each failure cost (pure, over event dicts of either shape)
    monitor.event_kinds  every event kind: class (major/minor/none), label, colour
    monitor.sink         SqlSink, HttpSink, NullSink, make_sink
    monitor.queued       the non-blocking queue / spool / retry machinery behind the sinks
    monitor.spool        the local file of undelivered rows
    monitor.replay       `regatta replay`: deliver what finished producers left spooled

It never imports elastic/, webui/ or jobs/, so any training framework can use it.
"""
