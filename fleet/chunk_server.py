"""The fleet server's MQTT file transfer: answers each device's `model/chunk/req` with the chunks of a registered
model file on that device's `model/chunk` topic (edgetune.protocol), for devices that cannot reach /releases/.

Pull, not push: a device asks for a window of the chunks it misses (at most CHUNKS_PER_REQUEST) and gets exactly
those, at QoS 1 and not retained, each published only after the broker acknowledged the one before: nothing is
sent that nobody asked for, and no file sits retained on the broker. Requests wait in a bounded queue for one
worker thread (a full queue drops the newest: its device asks again after its timeout). A request for a file the
fleet does not have, or for chunks past its end, is answered with one `model/chunk` carrying `error`, so the
device fails with that reason at once; a malformed request is logged and dropped. Servers of one `share_group`
split the requests (MQTT 5 shared subscription). Like /releases/, it serves any registered model without
credentials: a file is worth nothing without its signed manifest, which the device checks it against.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import OrderedDict
from pathlib import Path

from edgetune.broker import BrokerError, BrokerSettings, Client, Connection, Handler, Message
from edgetune.protocol import (MODEL_CHUNK_REQ, Chunk, ChunkRequest, ProtocolError, Topics, chunk_count,
                               parse_chunk_request, parse_topic, topic_filter)
from edgetune.sqlite import DBError
from fleet import rollout_store as rs
from fleet.mqtt import hostname
from fleet.store import FleetStore, open_fleet_store

log = logging.getLogger("fleet.chunks")

QUEUE_MAX = 256  # requests waiting for the worker
FILES_KEPT = 2  # model files kept in memory: a rollout serves one release and its rollback
PUBLISH_TIMEOUT_S = 10.0


class ChunkServer(Handler):
    def __init__(self, settings: BrokerSettings, db: Path | str | None, share: str | None = None):
        self.store: FleetStore = open_fleet_store(db, threads=True)
        self.client = Client(settings, f"edgetune-fleet-chunks-{hostname()}-{os.getpid()}", self,
                             subscriptions=(topic_filter(MODEL_CHUNK_REQ.sub, share=share),),
                             name="fleet-chunks-mqtt")
        self._requests: queue.Queue[tuple[str, bytes] | None] = queue.Queue(QUEUE_MAX)
        self._files: OrderedDict[str, bytes] = OrderedDict()
        self._thread = threading.Thread(target=self._run, name="fleet-chunks", daemon=True)

    def start(self) -> "ChunkServer":
        self.client.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._requests.put(None)
        self._thread.join(30)
        self.client.stop()
        self.store.close()

    def on_message(self, conn: Connection, msg: Message) -> None:
        try:
            device = parse_topic(msg.topic).device_id
            self._requests.put_nowait((device, msg.payload))
        except ProtocolError as e:
            log.warning("model/chunk/req on %s: %s", msg.topic[:200], e)
        except queue.Full:
            log.warning("model/chunk/req from %s dropped: %d requests are waiting", msg.topic[:200], QUEUE_MAX)

    def _run(self) -> None:
        while (item := self._requests.get()) is not None:
            device, payload = item
            try:
                self.serve(device, payload)
            except (DBError, BrokerError) as e:
                log.warning("model chunks for %s: %s; the device asks again", device, e)
            except Exception:
                log.exception("model chunks for %s failed", device)

    def serve(self, device: str, payload: bytes) -> None:
        """Answer one request of `device`: its chunks, or one error chunk saying why not."""
        try:
            req = parse_chunk_request(payload)
        except ProtocolError as e:
            log.warning("refused a model/chunk/req from %s: %s", device, e)
            return
        topic = Topics(device).model_chunk
        data = self._file(req.sha256)
        error = self._refusal(req, data)
        if error or data is None:
            log.warning("model/chunk/req from %s refused: %s", device, error)
            self.client.publish_wait(topic, Chunk(req.sha256, req.chunk_size, req.first, b"", error).encode(),
                                     PUBLISH_TIMEOUT_S)
            return
        cs = req.chunk_size
        for i in range(req.first, req.first + req.count):
            self.client.publish_wait(topic, Chunk(req.sha256, cs, i, data[i * cs:(i + 1) * cs]).encode(),
                                     PUBLISH_TIMEOUT_S)
        log.info("sent chunks %d-%d of %s… to %s", req.first, req.first + req.count - 1, req.sha256[:12], device)

    @staticmethod
    def _refusal(req: ChunkRequest, data: bytes | None) -> str | None:
        if data is None:
            return f"no model with sha256 {req.sha256} in the fleet's registry"
        n = chunk_count(len(data), req.chunk_size)
        if req.first + req.count > n:
            return (f"chunks {req.first}..{req.first + req.count - 1} asked for, the file has {n} of "
                    f"{req.chunk_size} bytes")
        return None

    def _file(self, sha256: str) -> bytes | None:
        """The registered file (the last few kept in memory), None for a file the fleet does not have."""
        if sha256 not in self._files:
            data = rs.model_data(self.store, sha256)
            if data is None:
                return None
            self._files[sha256] = data
            while len(self._files) > FILES_KEPT:
                self._files.popitem(last=False)
        self._files.move_to_end(sha256)
        return self._files[sha256]
