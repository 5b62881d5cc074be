"""The embedded broker takes job messages in the order they were sent (app.fs_broker).

kombu's filesystem transport named messages by an unpadded monotonic millisecond count and
took the first name in text order: past a change in the number of digits a job launched
later ran first (an evaluate job waited behind every job launched after it)."""

from __future__ import annotations

from pathlib import Path

from kombu import Connection
from kombu.transport import filesystem, virtual

from app.fs_broker import OrderedFilesystemTransport


def _connection(root: Path) -> Connection:
    """A connection to a broker under `root`. kombu keeps the filesystem transport's
    exchanges and bindings in one state per process (its class's), which would remember the
    queues of an earlier test's folder: each connection gets a state of its own here."""

    class Isolated(OrderedFilesystemTransport):
        global_state = virtual.BrokerState()

    folders = {name: root / name for name in ("queue", "processed", "control")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    return Connection("filesystem://localhost//", transport=Isolated, transport_options={
        "data_folder_in": str(folders["queue"]), "data_folder_out": str(folders["queue"]),
        "processed_folder": str(folders["processed"]), "store_processed": False,
        "control_folder": str(folders["control"])})


def test_messages_come_out_in_the_order_they_went_in_across_a_change_of_digits(
        tmp_path, monkeypatch):
    import app.fs_broker as fs_broker

    # both clocks cross a power of ten between the two sends: 999999 ms -> 1000000 ms (kombu's
    # own names then sort the second message first), 999.999 s -> 1000 s in nanoseconds
    monotonic = iter([999.999, 1000.0, 1000.001])
    monkeypatch.setattr(filesystem, "monotonic", lambda: next(monotonic))
    nanoseconds = iter([999_999_000_000, 1_000_000_000_000, 1_000_001_000_000])
    monkeypatch.setattr(fs_broker.time, "time_ns", lambda: next(nanoseconds))
    with _connection(tmp_path) as conn:
        queue = conn.SimpleQueue("gpu")
        for n in (1, 2, 3):
            queue.put({"job": n})
        got = []
        for _ in range(3):
            message = queue.get(timeout=5)
            got.append(message.payload["job"])
            message.ack()
        queue.close()
    assert got == [1, 2, 3]


def test_the_embedded_broker_uses_the_ordered_transport(settings):
    from app.fs_broker import TRANSPORT
    from app.queue import broker_settings, client

    assert broker_settings(settings)["broker_transport"] == TRANSPORT
    with client(settings).connection_for_write() as conn:
        assert isinstance(conn.transport, OrderedFilesystemTransport)


def test_a_message_being_written_is_not_taken(tmp_path):
    """A message is written under a name no queue reads, then renamed: a worker listing the
    folder mid-write could otherwise take (and drop) a half-written message."""
    with _connection(tmp_path) as conn:
        queue = conn.SimpleQueue("gpu")
        (tmp_path / "queue" / ".00000000000000000001_x.gpu.msg.part").write_bytes(b"{\"half")
        queue.put({"job": 7})
        message = queue.get(timeout=5)
        assert message.payload == {"job": 7}
        message.ack()
        queue.close()
    assert (tmp_path / "queue" / ".00000000000000000001_x.gpu.msg.part").exists()
    assert not [p for p in (tmp_path / "queue").iterdir() if p.name.endswith(".msg")]
