"""jax.distributed's key-value store in memory (`Store`) and a leader/follower pair of
`PlanChannel`s over it (`pair`): the multi-process plan without processes."""
import threading

from jaxpd.engine.multihost.plan_channel import PlanChannel, ProcessGroup

TOKEN = b"plan-token-0123456789abcdef"


class Store:
    """jax.distributed's client, in memory: the calls `PlanChannel` makes."""

    def __init__(self):
        self.data, self.lock = {}, threading.Condition()

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        with self.lock:
            if key in self.data and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.data[key] = bytes(value)
            self.lock.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        with self.lock:
            if not self.lock.wait_for(lambda: key in self.data, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.data[key]

    def key_value_try_get_bytes(self, key):
        with self.lock:
            if key not in self.data:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.data[key]

    def key_value_delete(self, key):
        with self.lock:
            self.data.pop(key, None)


def pair(store, key=TOKEN, num=2):
    leader = PlanChannel(ProcessGroup(num, 0, "127.0.0.1:1"), key, client=store)
    follower = PlanChannel(ProcessGroup(num, 1, "127.0.0.1:1"), key, client=store)
    return leader, follower

