"""edgetune/sqlite.py: the one SQLite base, on real files: migrations, refusals, typed errors, move_aside; and
the daemon DB's v1 migration adopting a file written before daemon.db was versioned."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
import threading
from pathlib import Path

import pytest

from edgetune.errors import EdgetuneError
from edgetune.sqlite import DBBusy, DBCorrupt, DBError, DBForeign, DBFull, DBTooNew, Schema, Store, move_aside

FIX = "pass --db with another path"
V1 = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL)"
V2 = "ALTER TABLE notes ADD COLUMN tag TEXT; CREATE INDEX notes_tag ON notes(tag)"


class Notes(Store):
    SCHEMA = Schema("notes DB", 0x54455354, (V1,))

    def __init__(self, path: Path, **kw):
        super().__init__(path, fix=FIX, **kw)

    def add(self, text: str) -> None:
        with self.tx() as c:
            c.execute("INSERT INTO notes (text) VALUES (?)", (text,))

    def texts(self) -> list[str]:
        return [r["text"] for r in self.query("SELECT text FROM notes ORDER BY id")]


class NotesV2(Notes):
    SCHEMA = Schema("notes DB", 0x54455354, (V1, V2))


def pragma(path: Path, name: str) -> int:
    with sqlite3.connect(path) as c:
        return c.execute(f"PRAGMA {name}").fetchone()[0]


def test_a_new_file_is_migrated_tagged_and_in_wal_mode(tmp_path):
    p = tmp_path / "sub" / "notes.db"
    with Notes(p) as db:
        assert db.schema_version == 1
        assert db.query_one("PRAGMA journal_mode")[0] == "wal"
        db.add("a")
    assert pragma(p, "application_id") == 0x54455354 and pragma(p, "user_version") == 1


def test_a_newer_migration_upgrades_in_place_and_keeps_the_rows(tmp_path):
    p = tmp_path / "notes.db"
    with Notes(p) as db:
        db.add("kept")
    with NotesV2(p) as db:
        assert db.schema_version == 2 and db.texts() == ["kept"]
        with db.tx() as c:
            c.execute("UPDATE notes SET tag='x'")
    with NotesV2(p) as db:  # reopening runs nothing again
        assert db.schema_version == 2 and db.query_one("SELECT tag FROM notes")[0] == "x"


def _open_at(path: Path, barrier, out) -> None:
    barrier.wait()
    try:
        NotesV2(path).close()
        out.put("ok")
    except Exception as e:  # the test reads what failed
        out.put(f"{type(e).__name__}: {e}")


def test_processes_opening_a_new_file_at_once_migrate_it_once(tmp_path):
    # the daemon's first start beside a CLI verb: each must find the file migrated, none may run a step twice
    ctx = multiprocessing.get_context("fork")
    for i in range(8):
        p = tmp_path / f"{i}" / "notes.db"
        barrier, out = ctx.Barrier(3), ctx.Queue()
        procs = [ctx.Process(target=_open_at, args=(p, barrier, out)) for _ in range(3)]
        for proc in procs:
            proc.start()
        got = [out.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join()
        assert got == ["ok"] * 3, got
        assert pragma(p, "user_version") == 2


def test_a_failing_migration_leaves_the_old_version(tmp_path):
    p = tmp_path / "notes.db"
    Notes(p).close()

    class Broken(Notes):
        SCHEMA = Schema("notes DB", 0x54455354, (V1, "ALTER TABLE notes ADD COLUMN tag TEXT; CREATE TABLE notes (x)"))

    with pytest.raises(DBError, match="notes DB"):
        Broken(p)
    assert pragma(p, "user_version") == 1
    with sqlite3.connect(p) as c:
        assert "tag" not in [r[1] for r in c.execute("PRAGMA table_info(notes)")]  # the whole step rolled back


def test_a_newer_schema_is_refused_untouched(tmp_path):
    p = tmp_path / "notes.db"
    NotesV2(p).close()
    with pytest.raises(DBTooNew, match=r"schema v2, newer than this edgetune \(v1\); upgrade edgetune") as e:
        Notes(p)
    assert e.value.path == p and str(p) in str(e.value)
    assert pragma(p, "user_version") == 2


@pytest.mark.parametrize("make", ["other program", "other edgetune store"])
def test_a_foreign_file_is_refused_untouched(tmp_path, make):
    p = tmp_path / "notes.db"
    if make == "other program":
        with sqlite3.connect(p) as c:
            c.execute("CREATE TABLE photos (id INTEGER)")
    else:
        class Other(Store):
            SCHEMA = Schema("other DB", 0x4F544852, ("CREATE TABLE other (x)",))

        Other(p, fix="-").close()
    before = p.read_bytes()
    with pytest.raises(DBForeign) as e:
        Notes(p)
    assert isinstance(e.value, EdgetuneError) and e.value.path == p
    assert str(e.value) == f"{p} is not an edgetune notes DB (another SQLite file); {FIX}"
    assert p.read_bytes() == before


def test_an_unversioned_file_of_ours_is_adopted_but_not_one_with_other_tables(tmp_path):
    class Legacy(Notes):
        SCHEMA = Schema("notes DB", 0x54455354, ("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, "
                                                 "text TEXT NOT NULL)",), legacy_tables=frozenset({"notes"}))

    ours, other = tmp_path / "ours.db", tmp_path / "other.db"
    for p in (ours, other):
        with sqlite3.connect(p) as c:
            c.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL)")
            c.execute("INSERT INTO notes (text) VALUES ('old')")
    with sqlite3.connect(other) as c:
        c.execute("CREATE TABLE photos (id INTEGER)")
    with Legacy(ours) as db:
        assert db.schema_version == 1 and db.texts() == ["old"]
    assert pragma(ours, "application_id") == 0x54455354
    with pytest.raises(DBForeign):
        Legacy(other)


def test_a_file_that_is_not_a_database_is_corrupt(tmp_path):
    p = tmp_path / "notes.db"
    p.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(DBCorrupt) as e:
        Notes(p)
    assert e.value.path == p and str(e.value).startswith(f"notes DB {p} is corrupt (") and str(e.value).endswith(FIX)


def test_damaged_pages_are_corrupt_on_read(tmp_path):
    p = tmp_path / "notes.db"
    with Notes(p) as db:
        for i in range(50):
            db.add(f"{i:04d}" * 200)
    page = pragma(p, "page_size")
    data = bytearray(p.read_bytes())
    assert len(data) > 8 * page
    for n in range(2, len(data) // page):  # every page after the schema page: b-tree headers become garbage
        data[n * page:n * page + 16] = b"\xff" * 16
    p.write_bytes(bytes(data))
    with Notes(p) as db, pytest.raises(DBCorrupt, match="notes DB .* is corrupt .*malformed"):
        db.texts()


def test_a_full_disk_rolls_back_keeps_the_file_and_the_store_usable(tmp_path):
    """The real SQLITE_FULL boundary, via the DB's page limit: SQLite rolls the transaction back itself, and the
    helper's own rollback must not fail on that."""
    p = tmp_path / "notes.db"
    db = Notes(p, full_fix="free some space and rerun")
    db.add("first")
    pages = db.query_one("PRAGMA page_count")[0]
    db.query(f"PRAGMA max_page_count={pages}")
    with pytest.raises(DBFull) as e:
        with db.tx() as c:
            c.execute("INSERT INTO notes (text) VALUES ('small')")
            c.execute("INSERT INTO notes (text) VALUES (?)", ("x" * 1_000_000,))
    assert str(e.value) == (f"disk full while writing the notes DB {p}: the write was rolled back and the DB is "
                            "intact; free some space and rerun")
    assert not db.conn.in_transaction
    assert db.query_one("PRAGMA quick_check")[0] == "ok" and db.texts() == ["first"]
    db.query(f"PRAGMA max_page_count={pages * 1000}")
    db.add("after")  # space is back: the same connection writes again
    assert db.texts() == ["first", "after"]
    db.close()


def test_an_error_in_the_body_rolls_back_and_is_not_wrapped(tmp_path):
    with Notes(tmp_path / "notes.db") as db:
        with pytest.raises(KeyError):
            with db.tx() as c:
                c.execute("INSERT INTO notes (text) VALUES ('gone')")
                raise KeyError("x")
        assert db.texts() == []
        with pytest.raises(DBError, match="notes DB .*no such table: nope"):
            db.query("SELECT * FROM nope")


def test_a_read_only_file_names_its_directory_and_the_fix(tmp_path):
    p = tmp_path / "notes.db"
    db = Notes(p)
    with sqlite3.connect(f"file:{p}?mode=ro", uri=True) as ro, pytest.raises(sqlite3.Error) as raised:
        ro.execute("INSERT INTO notes (text) VALUES ('x')")  # the real SQLITE_READONLY a read-only mount gives
    e = db.error(raised.value)
    assert isinstance(e, DBError) and e.path == p
    assert f"must be able to write the file and its directory {tmp_path}" in str(e), str(e)
    db.close()


def test_a_lock_held_past_the_timeout_is_busy(tmp_path):
    p = tmp_path / "notes.db"
    Notes(p).close()
    holder = sqlite3.connect(p, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with Notes(p, timeout=0) as db, pytest.raises(DBBusy, match=f"notes DB {p} stayed locked"):
            db.add("x")
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_threads_share_one_connection(tmp_path):
    with Notes(tmp_path / "notes.db", threads=True) as db:
        workers = [threading.Thread(target=lambda i=i: [db.add(f"{i}-{k}") for k in range(20)]) for i in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert sorted(db.texts()) == sorted(f"{i}-{k}" for i in range(4) for k in range(20))


def test_move_aside_moves_the_wal_files_too_and_never_overwrites(tmp_path):
    p = tmp_path / "notes.db"
    assert move_aside(p) is None
    asides = []
    for round_ in range(2):
        for suffix, body in (("", b"db"), ("-wal", b"wal"), ("-shm", b"shm")):
            Path(f"{p}{suffix}").write_bytes(body + bytes([round_]))
        asides.append(move_aside(p))
    assert asides[0] != asides[1] and not p.exists()
    for round_, aside in enumerate(asides):
        assert ".broken-" in aside.name
        for suffix, body in (("", b"db"), ("-wal", b"wal"), ("-shm", b"shm")):
            assert Path(f"{aside}{suffix}").read_bytes() == body + bytes([round_])


# ---- the daemon DB ------------------------------------------------------------------------------------------

def test_daemon_db_adopts_a_file_of_the_unversioned_daemon(tmp_path):
    """A device upgrading keeps its counters, published marks and command journal."""
    from daemon.store import DaemonStore, Journal

    p = tmp_path / "daemon.db"
    with sqlite3.connect(p) as c:
        # v1 is the DDL the unversioned DaemonStore and command journal ran; run bare (no user_version, no
        # application_id) it makes the file an old daemon left behind
        for stmt in filter(str.strip, DaemonStore.SCHEMA.migrations[0].split(";")):
            c.execute(stmt.replace("IF NOT EXISTS ", ""))
        c.execute("INSERT INTO kv VALUES ('session', '41')")
        c.execute("INSERT INTO published_records VALUES ('rec-1', 3, 0)")
        c.execute("INSERT INTO commands VALUES ('c1', 'ping', 'null', 'fleet', 'accepted', ?, 1, 1)",
                  (json.dumps({"id": "c1", "status": "accepted"}),))
    store = DaemonStore(p)
    try:
        assert store.schema_version == 1 and store.next_session() == 42
        assert store.unpublished(["rec-1", "rec-2"]) == {"rec-2"}
        journal = Journal(store)
        assert journal.response("c1") == {"id": "c1", "status": "accepted"}
        assert journal.in_status(["accepted"]) == [("c1", "ping", {}, "fleet")]
        assert not journal.insert("c1", "ping", None, "fleet", {"status": "accepted"})  # still a known id
    finally:
        store.close()
    assert pragma(p, "application_id") == DaemonStore.SCHEMA.app_id


def test_daemon_stores_refuse_each_others_files(tmp_path):
    from daemon.outbox import Outbox
    from daemon.store import DaemonStore

    DaemonStore(tmp_path / "daemon.db").close()
    Outbox(tmp_path / "outbox.db").close()
    with pytest.raises(DBForeign, match="not an edgetune outbox .*start the daemon again"):
        Outbox(tmp_path / "daemon.db")
    with pytest.raises(DBForeign, match="not an edgetune daemon DB"):
        DaemonStore(tmp_path / "outbox.db")


def test_results_db_errors_name_the_callers_fix(tmp_path):
    from daemon.store import RESULTS_DB_FIX
    from tuner.db import RESET_FIX, ResultsDB

    p = tmp_path / "results.db"
    p.write_bytes(b"garbage" * 200)
    with pytest.raises(DBCorrupt, match="report --reset` to move it aside"):
        ResultsDB(p)
    with pytest.raises(DBCorrupt) as e:
        ResultsDB(p, fix=RESULTS_DB_FIX)
    assert str(e.value).endswith(RESULTS_DB_FIX) and RESET_FIX not in str(e.value)
