"""Migrations build exactly the ORM's schema, and upgrade an older database in place."""

import json

import pytest
from sqlalchemy import inspect, select, text

from ppqa.store.db import open_db
from ppqa.store.migrations import MIGRATIONS, migrate
from ppqa.store.models import Base, Job


def schema_of(conn) -> dict:
    """Everything inspection sees: columns (type, nullability), keys, indexes, constraints."""
    insp = inspect(conn)
    schema = {}
    for table in sorted(insp.get_table_names()):
        schema[table] = {
            "columns": {c["name"]: (c["type"].compile(dialect=conn.dialect), c["nullable"])
                        for c in insp.get_columns(table)},
            "pk": insp.get_pk_constraint(table)["constrained_columns"],
            "fks": sorted((tuple(fk["constrained_columns"]), fk["referred_table"],
                           tuple(fk["referred_columns"]), (fk.get("options") or {}).get("ondelete"))
                          for fk in insp.get_foreign_keys(table)),
            "indexes": sorted((ix["name"], tuple(ix["column_names"]), bool(ix["unique"]))
                              for ix in insp.get_indexes(table)),
            "uniques": sorted((uq["name"], tuple(uq["column_names"]))
                              for uq in insp.get_unique_constraints(table)),
        }
    return schema


def orm_schema(db) -> dict:
    """The schema `create_all` builds, on the same database (after dropping what is there)."""
    with db.write() as conn:
        Base.metadata.drop_all(conn)
        assert inspect(conn).get_table_names() == []
        Base.metadata.create_all(conn)
    with db.read() as conn:
        return schema_of(conn)


def test_blank_database_migrates_to_the_orm_schema(db_location):
    db = open_db(db_location)
    with db.read() as conn:
        migrated = schema_of(conn)
    assert set(migrated) == {"ppqa_migrations", "documents", "jobs", "questions", "answers",
                             "reports"}
    assert migrated == orm_schema(db)
    db.close()


def test_migrate_is_idempotent_and_recorded(db_location):
    db = open_db(db_location, migrate=False)
    assert migrate(db) == [name for name, _ in MIGRATIONS]
    assert migrate(db) == []
    with db.read() as conn:
        names = conn.execute(text("SELECT name FROM ppqa_migrations ORDER BY name")).scalars().all()
    assert names == [name for name, _ in MIGRATIONS]
    with pytest.raises(ValueError, match="unknown migration"):
        migrate(db, upto="9999_nope")
    db.close()


def test_older_database_is_upgraded_in_place(db_location):
    db = open_db(db_location, migrate=False)
    assert migrate(db, upto="0001_initial") == ["0001_initial"]
    with db.write() as conn:  # rows written by a ppqa of that time, with plain SQL
        conn.execute(text("INSERT INTO documents (id, sha256, name, text, created_at) VALUES "
                          "(1, :sha, 'old', 'Old text.', '2026-01-02 03:04:05')"), {"sha": "a" * 64})
        for job_id, model in ((1, "smollm2"), (2, None)):
            conn.execute(text(
                "INSERT INTO jobs (id, document_id, question_count, params, job_key, status, "
                "priority, attempts, created_at) VALUES (:id, 1, 1, :params, :key, 'done', 0, 1, "
                "'2026-01-02 03:04:05')"),
                {"id": job_id, "params": json.dumps({"model": model, "max_new_tokens": 8}),
                 "key": str(job_id) * 64})
            conn.execute(text("INSERT INTO questions (id, job_id, position, custom_id, text) "
                              "VALUES (:id, :id, 0, 'q1', 'Why?')"), {"id": job_id})
        conn.execute(text("INSERT INTO answers (question_id, text, token_count, finish_reason, "
                          "created_at) VALUES (1, 'Because.', 2, 'stop', '2026-01-02 03:04:06')"))
    with db.read() as conn:
        assert "reports" not in inspect(conn).get_table_names()
    assert migrate(db) == ["0002_reports", "0003_job_model", "0004_template_source"]
    with db.read() as conn:
        upgraded = schema_of(conn)
        assert conn.execute(text("SELECT text FROM documents")).scalar_one() == "Old text."
        assert conn.execute(text("SELECT text FROM answers")).scalar_one() == "Because."
        jobs = conn.execute(select(Job.id, Job.model, Job.params).order_by(Job.id)).all()
    # The new column is filled from what the old rows stored in params.
    assert [(j.id, j.model, j.params["max_new_tokens"]) for j in jobs] == [
        (1, "smollm2", 8), (2, None, 8)]
    assert upgraded == orm_schema(db)
    db.close()
