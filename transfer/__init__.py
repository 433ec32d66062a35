"""KV-page transfer between the prefill and decode meshes.

Two small interfaces, `KVSender` and `KVReceiver` (`Connector`: both ends of an
in-process pipe), chosen at construction; the receiving side is polled through
`inbound.Inbound`, so the decode loop never branches on the backend.
The exports load lazily (module `__getattr__`): `jaxpd.transfer.wire`
(msgpack bodies, wire version, errors) is plain Python for the router, which must not
load jax; the connectors load it when first used.
"""
from jaxpd.lazy import lazy_exports

_EXPORTS = {
    "Connector": "jaxpd.transfer.connector", "KVHandoff": "jaxpd.transfer.connector",
    "KVSender": "jaxpd.transfer.connector", "KVReceiver": "jaxpd.transfer.connector",
    "TransferStats": "jaxpd.transfer.connector",
    "TransferError": "jaxpd.transfer.wire", "WireVersionError": "jaxpd.transfer.wire",
    "LayoutMismatchError": "jaxpd.transfer.wire",
    "DevicePutConnector": "jaxpd.transfer.device_put",
}
__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
