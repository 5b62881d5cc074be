"""The embedded broker's transport: kombu's filesystem transport, with messages taken in the
order they were sent.

kombu's own transport names a message file `<monotonic ms>_<uuid>.<queue>.msg` and takes the
first name in text order. The number is not zero-padded, so once it gains a digit the order
breaks ("1355605_..." sorts before "787069_...": a job launched later ran first, and an
evaluate job queued behind a long training run waited for every job launched after it), and
the monotonic clock starts again at boot, so messages left queued across a reboot sorted
after new ones. Here the name starts with the wall-clock time in nanoseconds, zero-padded to
a fixed width, so text order is launch order across restarts; and the file is written under a
name no queue reads, then renamed, so a worker never takes a message half-written.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

# digits of the nanosecond timestamp in a message's name: time.time_ns() has 19 until 2286
NAME_DIGITS = 20


def message_name(queue: str) -> str:
    """The file name of a new message on `queue`: sorts as text in the order of sending."""
    return f"{time.time_ns():0{NAME_DIGITS}d}_{uuid.uuid4()}.{queue}.msg"


class OrderedChannel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = message_name(queue)
        final = os.path.join(self.data_folder_out, name)
        # ".<name>.part": `_get` takes only names whose text after the first "." is
        # "<queue>.msg", so a file being written is never taken
        partial = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(partial, "wb", buffering=0) as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class OrderedFilesystemTransport(filesystem.Transport):
    Channel = OrderedChannel


# the Celery setting `broker_transport` that selects it (app.queue.broker_settings)
TRANSPORT = f"{__name__}:{OrderedFilesystemTransport.__name__}"
